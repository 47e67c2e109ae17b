"""From logical axis names to PartitionSpecs and NamedShardings on a mesh.

Parameters must divide evenly (an error names the parameter, its shape and the axis); activations
are only hints to XLA, so an axis that does not divide an activation dimension is left out.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mesh.layout import axis_sizes
from models.contract import Hooks
from sharding import context
from sharding import experts as experts_lib
from sharding.rules import Rules, ShardingConfigError


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def mesh_spec(logical: P, rules: Rules, shape: tuple[int, ...] | None = None,
              mesh_sizes: Mapping[str, int] | None = None, *, strict: bool = False, name: str = "") -> P:
    """Map one array's logical names to mesh axes.

    A mesh axis serves at most one dimension (the first that claims it, except `seq`, which claims last: with
    sequence parallelism `seq -> (context, tensor)`, so the residual stream's sequence takes `tensor` while
    inside attention and the MLP `heads`/`mlp` keep it); axes of size 1 are dropped.
    With `shape`, a dimension the axes do not divide raises (strict) or loses those axes (hint).
    """
    used: set[str] = set()
    out: list = [None] * len(logical)
    claim_order = sorted(range(len(logical)), key=lambda dim: logical[dim] == "seq")
    for dim in claim_order:
        logical_name = logical[dim]
        axes = [a for a in rules.get(logical_name, ()) if a not in used] if logical_name else []
        if mesh_sizes is not None:
            axes = [a for a in axes if mesh_sizes[a] > 1]
        if shape is not None and mesh_sizes is not None and axes:
            ways = math.prod(mesh_sizes[a] for a in axes)
            if shape[dim] % ways:
                if strict:
                    split = "x".join(f"{a}={mesh_sizes[a]}" for a in axes)
                    raise ShardingConfigError(
                        f"parameter {name} of shape {tuple(shape)}: dimension {dim} ({logical_name!r}, size "
                        f"{shape[dim]}) is not divisible by mesh axes {split}; change the mesh or the model size")
                axes = []
        used.update(axes)
        out[dim] = None if not axes else axes[0] if len(axes) == 1 else tuple(axes)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def param_specs(abstract: Any, logical: Any, rules: Rules, mesh_sizes: Mapping[str, int]) -> Any:
    """PartitionSpec of every parameter; `abstract` holds shapes, `logical` the logical names."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf, names: mesh_spec(names, rules, leaf.shape, mesh_sizes, strict=True,
                                            name=_path_str(path)),
        abstract, logical)


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry: None -> (), 'a' -> ('a',), ('a', 'b') -> ('a', 'b')."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_axes(spec: P) -> tuple[str, ...]:
    """Every mesh axis `spec` splits over, in spec order:
    P('data', ('fsdp', 'tensor')) -> ('data', 'fsdp', 'tensor')."""
    return tuple(a for entry in spec for a in entry_axes(entry))


def sharded_dims(spec: P) -> list[tuple[int, tuple[str, ...]]]:
    """[(dimension, its mesh axes)] for each dimension `spec` splits."""
    return [(dim, entry_axes(e)) for dim, e in enumerate(spec) if e]


def add_axis(spec: P, shape: tuple[int, ...], axis: str, mesh_sizes: Mapping[str, int]) -> P:
    """Also split an array over `axis` (ZeRO-1/2 optimizer-state sharding over `data`).

    The axis goes onto the largest dimension it still divides; arrays it divides nowhere stay as they are.
    """
    size = mesh_sizes.get(axis, 1)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if size == 1 or any(axis in entry_axes(e) for e in entries):
        return spec

    best = None
    for dim, entry in enumerate(entries):
        ways = math.prod(mesh_sizes[a] for a in entry_axes(entry)) * size
        if shape[dim] % ways == 0 and (best is None or shape[dim] // ways > shape[best] // ways):
            best = dim
    if best is None:
        return spec
    axes = entry_axes(entries[best]) + (axis,)
    entries[best] = axes[0] if len(axes) == 1 else axes
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def pins_weights(rules: Rules, sizes: Mapping[str, int]) -> bool:
    """FSDP beside context parallelism and sequence parallelism: there XLA's partitioner moved the block weights'
    shards from `fsdp` onto `context` and gathered the activations over `context` in their place (on tiny
    fsdp=2 x context=2 x tensor=2, 7.4 MB of activations a step where FSDP gathers 0.9 MB of weights), so the
    model's hooks pin each weight gathered over `fsdp` (ActivationSharding.weight). Under remat none the pinned
    weight is one of the layer's saved values, so the backward reuses it rather than gathering again, as XLA
    chose there before the pin."""
    return sizes.get("fsdp", 1) > 1 and sizes.get(context.AXIS, 1) > 1 and "tensor" in rules.get("seq", ())


def without_axis(spec: P, axis: str) -> P:
    """`spec` with mesh axis `axis` removed from every entry."""
    def drop(entry):
        kept = tuple(a for a in entry_axes(entry) if a != axis)
        return None if not kept else kept[0] if len(kept) == 1 else kept
    return P(*(drop(e) for e in spec))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _pinned(w: jax.Array, sharding: NamedSharding) -> jax.Array:
    """`w` constrained to `sharding` in the forward only: its cotangent is not pinned, so the gradient of a
    weight gathered this way can be reduce-scattered straight to the parameter's own sharding."""
    return jax.lax.with_sharding_constraint(w, sharding)


def _pinned_fwd(w, sharding):
    return _pinned(w, sharding), None


def _pinned_bwd(sharding, _, g):
    return (g,)


_pinned.defvjp(_pinned_fwd, _pinned_bwd)


def opt_state_specs(tx: optax.GradientTransformation, abstract_params: Any, specs: Any,
                    mesh_sizes: Mapping[str, int], shard_over_data: bool) -> Any:
    """Specs for the optimizer state: param-shaped leaves follow their parameter (plus `data` when
    optimizer-state sharding is on); counters and other scalars are replicated.

    A leaf is a parameter's copy when its path ends with that parameter's path and it has its shape (optax's
    moments keep the parameter dict's keys), which also holds for states with masked-out parameters
    (optax.multi_transform, LoRA's frozen base), where optax.tree_map_params cannot place its placeholder."""
    abstract_state = jax.eval_shape(tx.init, abstract_params)
    flat_params = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    by_path = {_names(path): (leaf.shape, spec) for (path, leaf), spec in zip(flat_params, flat_specs)}

    def follow(path, leaf):
        names = _names(path)
        for start in range(len(names)):
            shape, spec = by_path.get(names[start:], (None, None))
            if spec is not None and shape == leaf.shape:
                return add_axis(spec, leaf.shape, "data", mesh_sizes) if shard_over_data else spec
        return P()

    return jax.tree_util.tree_map_with_path(follow, abstract_state)


def _names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def named(mesh: jax.sharding.Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


class ActivationSharding(Hooks):
    """The model's hooks on a mesh: `constrain(x, logical_names)` pins a key activation to the rules' layout."""

    def __init__(self, mesh: jax.sharding.Mesh, rules: Rules):
        self.mesh, self.rules, self.sizes = mesh, rules, axis_sizes(mesh)

    def __call__(self, x: jax.Array, names: tuple) -> jax.Array:
        spec = mesh_spec(P(*names), self.rules, x.shape, self.sizes)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def weight(self, w: jax.Array, names: tuple) -> jax.Array:
        """Where `pins_weights`, the weight gathered over `fsdp` as its matmul takes it (FSDP's all-gather), its
        gradient left free to reduce-scatter; elsewhere XLA gathers as FSDP does without being told."""
        if not pins_weights(self.rules, self.sizes):
            return w
        spec = mesh_spec(P(*names), self.rules, w.shape, self.sizes)
        return _pinned(w, NamedSharding(self.mesh, without_axis(spec, "fsdp")))

    def context_order(self, length: int) -> jax.Array | None:
        """With mesh.context > 1, the zigzag order of sharding/context.py; else the sequence stays in order."""
        ways = self.sizes.get(context.AXIS, 1)
        return None if ways == 1 else jnp.asarray(context.zigzag_order(length, ways))

    def causal_attention(self, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, implementation, segment_ids_BxL=None, window=0):
        """With mesh.context > 1, ring attention (XLA blocks; train/config/experiment.py rejects cuDNN there),
        packed documents' segment ids riding the ring with the keys, a sliding layer's ring skipping the blocks
        wholly outside its window (sharding/context.py); else the model's own kernel."""
        if self.sizes.get(context.AXIS, 1) == 1:
            return super().causal_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, implementation, segment_ids_BxL, window)
        assert implementation == "xla", implementation
        names = P("batch", "seq", "heads", "kv")
        q_spec = mesh_spec(names, self.rules, q_BxLxHxK.shape, self.sizes)
        kv_spec = mesh_spec(names, self.rules, k_BxLxGxK.shape, self.sizes)
        # Whole rows of ids on every context device: each reads the ids of the block it holds (no ring traffic).
        seg_spec = None if segment_ids_BxL is None else \
            mesh_spec(P("batch", None), self.rules, segment_ids_BxL.shape, self.sizes)
        return context.ring_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, self.mesh, q_spec, kv_spec,
                                      segment_ids_BxL, seg_spec, window)

    def whole_rows(self, x_BxLxD: jax.Array) -> jax.Array:
        """Under sequence parallelism, gather the rows' sequence over `tensor` (as before any MLP); else as is."""
        if "tensor" not in self.rules.get("seq", ()):
            return x_BxLxD
        return self(x_BxLxD, ("batch", "seq_context", "embed"))

    def rows_in_order(self, x_BxLxD: jax.Array) -> jax.Array:
        """Rows split over the batch axes and `context` (an all-to-all from the sequence split), then each row out
        of the zigzag by slices, which stay local where a gather by the order would not (XLA split it)."""
        ways, rows = self.sizes.get(context.AXIS, 1), self._context_rows()
        x_BxLxD = jax.lax.with_sharding_constraint(x_BxLxD, rows)
        return jax.lax.with_sharding_constraint(context.from_zigzag(x_BxLxD, ways), rows)

    def rows_to_context(self, x_BxLxD: jax.Array) -> jax.Array:
        ways, rows = self.sizes.get(context.AXIS, 1), self._context_rows()
        return jax.lax.with_sharding_constraint(context.to_zigzag(x_BxLxD, ways), rows)

    def _context_rows(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(experts_lib.batch_axes(self.rules, self.sizes) + (context.AXIS,)))

    def moe_experts(self, x_BxExCxD: jax.Array, experts: Any, expert_fn) -> jax.Array:
        """Experts split over `expert`: all-to-all dispatch and combine (sharding/experts.py); under context
        parallelism the buffers' rows are split over `context` too (rows_in_order), so it is manual there too."""
        if self.sizes.get(experts_lib.AXIS, 1) == 1:
            return super().moe_experts(x_BxExCxD, experts, expert_fn)
        manual = experts_lib.batch_axes(self.rules, self.sizes)
        manual += (context.AXIS,) * (self.sizes.get(context.AXIS, 1) > 1)
        return experts_lib.dispatch_combine(self.mesh, manual, x_BxExCxD, experts, expert_fn)


def constrainer(mesh: jax.sharding.Mesh, rules: Rules) -> ActivationSharding:
    """The hooks the model calls on its key activations (models.contract.Hooks)."""
    return ActivationSharding(mesh, rules)
