"""Pipeline-parallel loss and gradients in one SPMD program: a `shard_map` over the pipeline and batch axes
runs any schedule table (sharding/schedules.py) as a `lax.scan` over time slots, one `lax.switch` per slot.

Same contract as train.step.model_loss_and_grad, so GPipe, 1F1B, interleaved 1F1B and the zero-bubble ZB-H1 and
ZB-V (split backwards) are tables, not code.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import models
from mesh.layout import axis_sizes
from sharding import context as context_lib
from sharding import experts as experts_lib
from sharding import pipeline_stages as stages
from sharding import schedules
from sharding import specs as sharding_specs
from sharding.rules import Rules
from sharding.slot_program import has_split_backward, send_patterns, slot_program

PIPELINE = "pipeline"
# FSDP inside the pipeline region: stage weights gathered (and gradients reduce-scattered) once per step;
# see StageProgram. The compile report carries this so an audit knows to expect one fsdp all-gather per weight.
FSDP_GATHER = "once_per_step"
# Manual axes a weight stays split over in the region: its stage over `pipeline`, its experts over `expert` (their
# tokens come to them by all-to-all); the others (fsdp) are gathered once per step.
KEPT_SPLIT = (PIPELINE, experts_lib.AXIS)


# ----------------------------------------------------------------------------- layer order

def layer_order(n_layers: int, stages_: int, virtual_stages: int, v_shape: bool = False) -> np.ndarray:
    """int [n_layers]: the logical layer held at each position of the in-memory layer stack.

    The stack's `layers` dimension is split contiguously over `pipeline` (rule layers -> pipeline), so
    device d holds positions [d*v*Lc, (d+1)*v*Lc), read as v chunks of Lc = L/(vp) layers. Interleaving
    (Megatron-LM, Narayanan et al. SC'21) puts model chunk k = c*p + d on device d, so position
    d*v*Lc + c*Lc + l holds logical layer (c*p + d)*Lc + l; a V-shaped schedule (ZB-V) puts chunk
    k = schedules.chunk_map(p, v, True)[d, c] there instead. With v = 1 this is the identity.
    """
    p, v = stages_, virtual_stages
    lc = n_layers // (p * v)
    ks = schedules.chunk_map(p, v, v_shape)
    d, c, l = np.meshgrid(np.arange(p), np.arange(v), np.arange(lc), indexing="ij")
    return (ks[d, c] * lc + l).reshape(-1)


def _permute_layers(tree: Any, index: np.ndarray) -> Any:
    """Take `index` along dim 0 of every leaf under a `layers` key (params and their optimizer moments)."""
    def visit(path, x):
        if any(getattr(k, "key", None) == models.LAYERS for k in path):
            return jnp.take(x, jnp.asarray(index), axis=0)
        return x
    return jax.tree_util.tree_map_with_path(visit, tree)


def to_logical(tree: Any, order: np.ndarray) -> Any:
    """In-memory (pipeline) layer order -> logical order 0..L-1: what checkpoints store."""
    return _permute_layers(tree, np.argsort(order))


def from_logical(tree: Any, order: np.ndarray) -> Any:
    """Logical layer order -> the in-memory order of this pipeline layout (inverse of to_logical)."""
    return _permute_layers(tree, order)


# ----------------------------------------------------------------------------- the region's axes

class AutoAxesHints(models.contract.Hooks):
    """Inside the pipeline's shard_map: activation hints for the automatic (tensor) axes only, and with `context`
    manual there (`context` > 1 ways), each device's slice of the zigzag sequence and the ring over them."""

    def __init__(self, rules, sizes, context: int = 1, batch_axes: tuple[str, ...] = ()):
        self.rules, self.sizes, self.context, self.batch_axes = rules, sizes, context, batch_axes

    def __call__(self, x, names):
        return jax.lax.with_sharding_constraint(x, sharding_specs.mesh_spec(P(*names), self.rules, x.shape, self.sizes))

    def context_order(self, length: int) -> jax.Array | None:
        """int32 [length]: the global positions of this device's `length` tokens (its two zigzag chunks)."""
        if self.context == 1:
            return None
        order_CxL = jnp.asarray(context_lib.zigzag_order(length * self.context, self.context)).reshape(self.context,
                                                                                                      length)
        return order_CxL[jax.lax.axis_index(context_lib.AXIS)]

    # Under sequence parallelism, a mixture's rows gathered over `tensor` as outside the region (the same rule on
    # the region's automatic axes): left split, XLA read the slots from each device's part and all-reduced the
    # buffers, 8x the bytes on moe-tiny.
    whole_rows = sharding_specs.ActivationSharding.whole_rows

    def batch_mean(self, x):
        """The replicas' rows together: a mixture's router statistics are those of the whole microbatch, as one
        device accumulating over the microbatches computes them (one all-reduce of a few scalars per layer; over
        `context` too, which splits the mixture's rows, `rows_in_order`)."""
        return jax.lax.pmean(x, self.batch_axes) if self.batch_axes else x

    def rows_in_order(self, x_BxLxD):
        """With `context` manual: this device's slice of its b rows' sequence -> b / context whole rows in order
        (one all-to-all over `context`: every device sends each other its rows' share, which arrives in device
        order, i.e. zigzag; then the zigzag undone by slices), so a mixture routes whole rows."""
        if self.context == 1:
            return x_BxLxD
        x_BxLxD = jax.lax.all_to_all(x_BxLxD, context_lib.AXIS, split_axis=0, concat_axis=1, tiled=True)
        return context_lib.from_zigzag(x_BxLxD, self.context)

    def rows_to_context(self, x_BxLxD):
        """The inverse of `rows_in_order`: the rows' zigzag slices back to the devices holding the rows."""
        if self.context == 1:
            return x_BxLxD
        x_BxLxD = context_lib.to_zigzag(x_BxLxD, self.context)
        return jax.lax.all_to_all(x_BxLxD, context_lib.AXIS, split_axis=1, concat_axis=0, tiled=True)

    def moe_experts(self, x_BxExCxD, experts, expert_fn):
        """With `expert` manual here (a batch axis of the region): the experts' all-to-alls, directly."""
        if self.sizes.get(experts_lib.AXIS, 1) == 1:
            return super().moe_experts(x_BxExCxD, experts, expert_fn)
        return experts_lib.exchange(x_BxExCxD, experts, expert_fn)

    def causal_attention(self, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, implementation, segment_ids_BxL=None, window=0):
        """With `context` manual, the ring on this device's slice, its K/V blocks all-gathered (context._next_block)
        on each device's heads of the automatic axes (tensor) that split them (_on_local_shards: called on the
        whole heads, XLA replicated K and V over `tensor` first, moving `tensor` times the bytes)."""
        if self.context == 1:
            return super().causal_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, implementation, segment_ids_BxL, window)
        assert implementation == "xla", implementation  # train/config/experiment.py rejects cuDNN under context
        kv_spec = sharding_specs.mesh_spec(P("batch", "seq", "heads", "kv"), self.rules, k_BxLxGxK.shape, self.sizes)
        gather = functools.partial(_on_local_shards, context_lib.all_gather_blocks, spec=kv_spec,
                                   automatic=sharding_specs.spec_axes(kv_spec))
        # Packed documents: the ids of the whole rows in order (models/stack.py), laid out as the ring reads them.
        segments = None if segment_ids_BxL is None else context_lib.to_zigzag(segment_ids_BxL, self.context)
        return context_lib.ring(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, self.context, segments, gather=gather, window=window)


def manual_axes(rules: Rules, mesh_sizes: Mapping[str, int]) -> tuple[str, ...]:
    """`pipeline`, the axes that split the batch (data, fsdp) and `context`: the pipeline region handles these by
    hand. The batch axes must be manual: left automatic, XLA gathered the whole batch onto every stage at
    the region's entry. `context` splits the work like them: left automatic, the weight gradients (contractions
    over the split sequence) would be summed over it in every backward cell; by hand they are summed once per
    step. Everything else (tensor) stays automatic, so XLA's partitioner places Megatron's tensor-parallel
    collectives inside each stage's computation, as in the unpipelined model; only the FSDP gather and
    reduce-scatter run with tensor manual too (_on_local_shards)."""
    batch = [a for a in rules.get("batch", ()) if mesh_sizes.get(a, 1) > 1 and a != PIPELINE]
    return (PIPELINE, *batch) + ((context_lib.AXIS,) * (mesh_sizes.get(context_lib.AXIS, 1) > 1))


def _only(spec: P, axes: tuple[str, ...], drop: tuple[str, ...] = ()) -> P:
    """`spec` restricted to the mesh axes in `axes` (minus `drop`)."""
    out = []
    for entry in spec:
        kept = tuple(a for a in sharding_specs.entry_axes(entry) if a in axes and a not in drop)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*out)


def build(cfg: models.ModelConfig, mesh: jax.sharding.Mesh, rules: Rules, schedule: schedules.Schedule,
          train: bool = True) -> Callable:
    """fn(params, tokens [B, seq+1]) -> (loss, grads) (train) or loss: the pipelined model on `mesh`, the
    shard_map of a StageProgram's region (manual over `pipeline` and the batch axes)."""
    stage = StageProgram(cfg, mesh, rules, schedule, train)
    out_specs = (P(), stage.param_in) if train else P()
    return jax.shard_map(stage.region, mesh=mesh, in_specs=(stage.param_in, stage.batch_in), out_specs=out_specs,
                         axis_names=set(stage.manual), check_vma=True)


class DeviceOperands(NamedTuple):
    """One device's operands of the slot loop, the same in every slot (traced inside the region)."""
    d: jax.Array  # int32 []: this device's stage, its column of the slot program
    stack: Any  # the stage's layers as v chunks: every leaf [v, Lc, ...]
    top: Any  # the parameters outside the layer stack (embedding, final norm, head)
    micro: jax.Array  # int32 [m, b, seq+1]: this device's rows of the batch as m microbatches
    ids: jax.Array | None  # int32 [v, Lc]: the logical layer ids of its chunks, None where no layer reads its id
    weight: Callable[[jax.Array], jax.Array] | None  # a microbatch's tokens -> its loss weight; None: 1/m
    cells: list[Callable]  # the lax.switch branches, indexed by pipeline_stages' constants


class StageProgram:
    """The pipelined model on one layout, as one SPMD program.

    Per device (shard_map, manual over `pipeline` and the batch axes): its rows of the batch split into m
    microbatches; its stage's layers as v chunks. Each slot it runs its table cell, then `ppermute` carries
    the activation to the next stage (d+1) and the input gradient to the previous one (d-1), on a ring when
    interleaved (chunk c on device p-1 feeds chunk c+1 on device 0), and both ways when V-shaped (ZB-V: the
    second chunk runs back up the stages; at the V's turn a message stays on its device); only the pairs
    whose sender has a message send (send_patterns). Received messages
    wait in fixed-size buffers (schedule_buffers) until their backward, so 1F1B keeps at most p inputs per stage
    whatever m.
    The cells themselves (embedding first, head and loss last, backward by vjp) are in pipeline_stages.

    FSDP inside the pipeline: stage parameters are gathered once per step, before the slot loop, and the
    gradients stay full-size over fsdp until one reduce-scatter after it. The alternative, gathering per
    microbatch inside each cell (ZeRO-3 proper), keeps only 1/fsdp of the stage's weights resident but moves
    them 3m times a step (forward, recomputed forward, reduce-scatter of each backward) instead of twice;
    with the stage already 1/p of the model, the once-per-step gather is the ZeRO-1/2-with-pipeline
    trade made by DeepSpeed and Megatron-LM's distributed optimizer. Gradients and the loss are reduced
    over the batch axes once per step, after the loop.
    """

    def __init__(self, cfg: models.ModelConfig, mesh: jax.sharding.Mesh, rules: Rules, schedule: schedules.Schedule,
                 train: bool):
        p, v = schedule.stages, schedule.virtual_stages
        sizes = axis_sizes(mesh)
        assert sizes[PIPELINE] == p, (sizes, p)
        assert p * v >= 2 and cfg.n_layers % (p * v) == 0, (cfg.n_layers, p, v)
        self.cfg, self.train, self.v, self.m = cfg, train, v, schedule.microbatches
        # Each stage's chunks' logical layers, which a model of several attention kinds reads its LayerSpecs by
        # (models/stack.py), whatever the schedule's layer order.
        self.layer_ids = None if models.uniform_attention(cfg) else layer_order(
            models.stack_length(cfg), p, v, schedule.v_shape).reshape(p, v, -1).astype(np.int32)
        self.chunks = p * v
        self.manual = manual = manual_axes(rules, sizes)
        self.batch_axes = manual[1:]  # and `context`: each device's loss is the mean of its rows' slices
        self.replicas = math.prod(sizes[a] for a in self.batch_axes)

        abstract, logical = models.abstract_params(cfg)
        self.full_specs = sharding_specs.param_specs(abstract, logical, rules, sizes)
        self.param_in = jax.tree.map(lambda s: _only(s, manual), self.full_specs, is_leaf=lambda x: isinstance(x, P))
        self.batch_in = _only(sharding_specs.mesh_spec(P("batch", None), rules, None, sizes), manual)
        auto_rules = {k: tuple(a for a in axes if a not in manual) for k, axes in rules.items()}
        self.automatic = tuple(a for a in mesh.axis_names if a not in manual and sizes[a] > 1)
        self.context = sizes.get(context_lib.AXIS, 1)
        self.constrain = AutoAxesHints(auto_rules, sizes, self.context, self.batch_axes)

        self.program = slot_program(schedule, train)
        self.sends = send_patterns(self.program, p)
        self.split = train and has_split_backward(schedule)
        self.act_entries, self.grad_entries = (int(n) for n in self.program.pop("sizes"))
        self.count_targets = _slice_counter(cfg, self.constrain) if models.target_counter(cfg) else None

    def region(self, params: Any, tokens: jax.Array) -> Any:
        """The body of the shard_map: gather the stage, scan the slot program, reduce loss and gradients."""
        device = self.device(params, tokens)
        carry = self.initial_carry(device, tokens)
        rows = ({k: jnp.asarray(a) for k, a in self.program.items()},
                {k: jnp.asarray(index) for k, (index, _) in self.sends.items()})
        carry, _ = jax.lax.scan(functools.partial(self.slot, device), carry, rows)
        logged = jax.tree.map(lambda x: jax.lax.psum(x, self.manual) / self.replicas, carry["log"])
        # The loss alone, or with the layers' metrics (a mixture's router statistics) as train.step expects them.
        loss = logged["loss"] if len(logged) == 1 or not self.train else models.contract.scalars(logged)
        if not self.train:
            return loss
        g_layers = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), carry["g_stack"])
        grads = {**carry["g_top"], models.LAYERS: g_layers}
        return loss, {k: jax.tree.map(functools.partial(self.reduce, is_layer=k == models.LAYERS), grads[k],
                                      self.full_specs[k]) for k in grads}

    def device(self, params: Any, tokens: jax.Array) -> DeviceOperands:
        """This device's stage (its FSDP shards gathered), its microbatches and its cell programs."""
        d = jax.lax.axis_index(PIPELINE)
        params = jax.tree.map(self.gather, params, self.full_specs)  # full specs: the gather keeps the tensor split
        params = stages.make_varying(params, self.manual)
        v, m = self.v, self.m
        stack = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), params[models.LAYERS])
        top = models.top_params(params)
        # Microbatch k takes local rows k, k+m, k+2m, ...: over the batch replicas, the rows of train.step's
        # accumulation slice k, so a mixture's per-microbatch router losses are those of grad_accum_steps = m.
        micro = jnp.swapaxes(tokens.reshape(tokens.shape[0] // m, m, tokens.shape[1]), 0, 1)
        weight = (None if self.count_targets is None
                  else _microbatch_weight(self.count_targets, tokens, self.batch_axes, self.replicas))
        cells = stages.branches(self.cfg, self.constrain, self.manual, 1.0 / m if weight is None else weight,
                                self.chunks, self.split, self.context)
        assert len(cells) == stages.num_branches(self.split), len(cells)  # branch_slot_counts, the audit index these
        ids = None if self.layer_ids is None else jnp.asarray(self.layer_ids)[d]
        return DeviceOperands(d, stack, top, micro, ids, weight, cells)

    def initial_carry(self, device: DeviceOperands, tokens: jax.Array) -> dict[str, Any]:
        """The scan's carry: the two message buffers [entries, b, seq, D], what the cells log (the loss, and the
        layers' metrics) and, when training, the gradient accumulators of the stage's chunks and of the top
        parameters."""
        dt = jnp.dtype(self.cfg.compute_dtype)
        act_shape = (tokens.shape[0] // self.m, (tokens.shape[1] - 1) // self.context, self.cfg.d_model)
        x = stages.make_varying(jnp.zeros(act_shape, dt), self.manual)
        chunk = jax.tree.map(lambda a: a[0], device.stack)
        ids = None if device.ids is None else device.ids[0]
        log = jax.eval_shape(device.cells[stages.IDLE], (chunk, device.top, device.micro[0], x, x, ids))[-1]
        carry = dict(acts=jnp.zeros((self.act_entries, *act_shape), dt),
                     grads=jnp.zeros((self.grad_entries, *act_shape), dt),
                     log=jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), log))
        if self.train:
            carry.update(g_stack=jax.tree.map(jnp.zeros_like, device.stack),
                         g_top=jax.tree.map(jnp.zeros_like, device.top))
        return stages.make_varying(carry, self.manual)

    def slot(self, device: DeviceOperands, carry: dict[str, Any],
             rows: tuple[dict[str, jax.Array], dict[str, jax.Array]]) -> tuple[dict[str, Any], None]:
        """One time slot (a row of the slot program and of each channel's send pattern): run this device's
        cell, send, store what arrived."""
        row, patterns = rows
        cell = {k: a[device.d] for k, a in row.items()}
        chunk = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, cell["chunk"], 0, keepdims=False), device.stack)
        ids = None if device.ids is None else jax.lax.dynamic_index_in_dim(device.ids, cell["chunk"], 0, keepdims=False)
        ops = (chunk, device.top, device.micro[cell["mb"]], carry["acts"][cell["act_read"]],
               carry["grads"][cell["grad_read"]], ids)
        y, g_x, g_chunk, g_top, log = jax.lax.switch(cell["branch"], device.cells, ops)
        weight = None if device.weight is None else device.weight(device.micro[cell["mb"]])
        weighted = jax.tree.map(lambda x: x / self.m if weight is None else x * weight, log)
        new = dict(carry, log=jax.tree.map(jnp.add, carry["log"], weighted))
        # Send, then store what arrived (schedule_buffers' order), so an entry freed in this slot is reusable.
        kinds = {"act": ("acts", y), "grad": ("grads", g_x)} if self.train else {"act": ("acts", y)}
        arrived = {}
        for key, (_, pairs) in self.sends.items():
            with jax.named_scope(f"send_{key}"):  # send_channel reads it back from the compiled program
                arrived[key] = jax.lax.switch(patterns[key], [functools.partial(_send, pattern) for pattern in pairs],
                                              kinds[key.split("_")[0]][1])
        for kind, (buffer, message) in kinds.items():
            new[buffer] = self.store(carry[buffer], message, arrived, cell, f"{kind}_write")
        if self.train:
            # Every cell returns chunk and top gradients (zeros unless it is a backward), since switch
            # branches share one output type; the add costs one pass over the chunk's gradient, small next
            # to the chunk's matmuls on a microbatch.
            new["g_stack"] = jax.tree.map(lambda acc, g: _add_at(acc, g, cell["chunk"]), carry["g_stack"], g_chunk)
            new["g_top"] = jax.tree.map(jnp.add, carry["g_top"], g_top)
        return new, None

    @staticmethod
    def store(buffer: jax.Array, message: jax.Array, arrived: dict[str, jax.Array], cell: dict[str, jax.Array],
              key: str) -> jax.Array:
        """Store what arrived on the kind's channels at `cell[key...]`: its own way first (activations from
        the previous stage, gradients from the next one), then a V-shaped table's other way (`key`_prev or
        _next) and what stays where the V turns (`key`_self, never sent)."""
        for field in (key, f"{key}_{'prev' if key == 'act_write' else 'next'}", f"{key}_self"):
            if field in arrived or (field.endswith("_self") and field in cell):
                buffer = _store(buffer, arrived.get(field, message), cell[field])
        return buffer

    def gather(self, x: jax.Array, spec: P) -> jax.Array:
        """FSDP: the whole stage's weights, once per step."""
        sharded = sharding_specs.sharded_dims(_only(spec, self.manual, drop=KEPT_SPLIT))
        if not sharded:
            return x
        return _on_local_shards(functools.partial(_all_gather, sharded=sharded), x, spec, self.automatic)

    def reduce(self, g: jax.Array, spec: P, is_layer: bool) -> jax.Array:
        """Once per step: scatter back to the FSDP shards (first, so the all-reduce moves a shard rather than
        the whole stage), then sum over the other batch axes; mean over the batch replicas."""
        sharded = sharding_specs.sharded_dims(_only(spec, self.manual, drop=KEPT_SPLIT))
        if sharded:
            g = _on_local_shards(functools.partial(_reduce_scatter, sharded=sharded), g, spec, self.automatic)
        in_spec = set(sharding_specs.spec_axes(_only(spec, self.manual)))  # and `expert`: distinct experts
        # Embedding and head gradients exist on the first and last stage only; every stage holds a replica.
        summed = tuple(a for a in self.batch_axes if a not in in_spec) + (() if is_layer else (PIPELINE,))
        return (jax.lax.psum(g, summed) if summed else g) / self.replicas


def _all_gather(x: jax.Array, sharded: list) -> jax.Array:
    for dim, axes in sharded:
        x = jax.lax.all_gather(x, axes if len(axes) > 1 else axes[0], axis=dim, tiled=True)
    return x


def _reduce_scatter(g: jax.Array, sharded: list) -> jax.Array:
    for dim, axes in sharded:
        g = jax.lax.psum_scatter(g, axes if len(axes) > 1 else axes[0], scatter_dimension=dim, tiled=True)
    return g


def _on_local_shards(fn: Callable, x: jax.Array, spec: P, automatic: tuple[str, ...]) -> jax.Array:
    """`fn` (the FSDP gather or reduce-scatter over manual axes) on each device's shard of the automatic
    axes (tensor) that `spec` splits, by a nested shard_map that makes them manual too.

    Called directly in the region, XLA's partitioner replicates the operand of a manual all-gather or
    reduce-scatter over the automatic axes (Shardy keeps the tensor sharding on it, but the partitioner
    all-gathers over `tensor`, runs the collective on the whole tensor-parallel weight and slices the
    result back), which doubles the fsdp bytes and adds a tensor all-gather of every weight and gradient.
    A dimension split over both kinds of axis keeps that path, since its local block is not contiguous.
    """
    auto_spec = _only(spec, automatic)
    entries = [sharding_specs.entry_axes(e) for e in spec]
    mixed = any(set(e) & set(automatic) and set(e) - set(automatic) for e in entries)
    if not sharding_specs.sharded_dims(auto_spec) or mixed:
        return fn(x)
    return jax.shard_map(fn, in_specs=auto_spec, out_specs=auto_spec, axis_names=set(automatic),
                         check_vma=True)(x)


def _slice_counter(cfg: models.ModelConfig, constrain: AutoAxesHints) -> Callable[[jax.Array], jax.Array]:
    """tokens [b, seq+1] -> the counted targets of the positions this device computes: the whole rows, or under
    context parallelism its slice of them (each device's loss is the mean over its slice's counted targets)."""
    return lambda tokens: jnp.sum(stages.device_rows(tokens, cfg, constrain, constrain.context)[2], dtype=jnp.float32)


def _microbatch_weight(count_targets: Callable, tokens: jax.Array, batch_axes: tuple[str, ...],
                       replicas: int) -> Callable[[jax.Array], jax.Array]:
    """A microbatch's tokens -> its loss weight when not every target counts (packed documents): its counted
    targets over the mean count per batch replica (`context` among the batch axes: a device's slice of the rows),
    so the weighted microbatch means, summed over the microbatches and averaged over the replicas, are the mean
    over the global batch's counted targets."""
    local = count_targets(tokens)
    per_replica = (jax.lax.psum(local, batch_axes) if batch_axes else local) / replicas
    return lambda micro_tokens: count_targets(micro_tokens) / jnp.maximum(per_replica, 1.0)


def _send(pairs: tuple[tuple[int, int], ...], message: jax.Array) -> jax.Array:
    """One branch of a channel's send switch: the message over its pattern's pairs. With no pair it runs no
    collective; a device no pair targets gets zeros (as from ppermute), stored in its scratch entry."""
    return jax.lax.ppermute(message, PIPELINE, pairs) if pairs else jnp.zeros_like(message)


def _store(buffer: jax.Array, message: jax.Array, entry: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(buffer, message, entry, 0)


def _add_at(acc: jax.Array, g: jax.Array, index: jax.Array) -> jax.Array:
    current = jax.lax.dynamic_index_in_dim(acc, index, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(acc, current + g, index, 0)


def loss_and_grad(cfg: models.ModelConfig, mesh: jax.sharding.Mesh, rules: Rules,
                  schedule: schedules.Schedule) -> Callable:
    """The LossAndGrad of train.step: (params, tokens [B, seq+1]) -> (mean loss, grads)."""
    return build(cfg, mesh, rules, schedule, train=True)


def loss(cfg: models.ModelConfig, mesh: jax.sharding.Mesh, rules: Rules, schedule: schedules.Schedule) -> Callable:
    """(params, tokens) -> mean loss, forward cells only: evaluation without gathering the layer stack."""
    return build(cfg, mesh, rules, schedule, train=False)
