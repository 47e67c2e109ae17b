"""Pipeline-parallel loss and gradients in one SPMD program: a `shard_map` over the pipeline and batch axes
runs any schedule table (sharding/schedules.py) as a `lax.scan` over time slots, one `lax.switch` per slot.

Same contract as train.step.model_loss_and_grad, so GPipe, 1F1B and interleaved 1F1B are tables, not code.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import models
from mesh.layout import axis_sizes
from sharding import pipeline_stages as stages
from sharding import schedule_buffers, schedules
from sharding import specs as sharding_specs
from sharding.rules import Rules

PIPELINE = "pipeline"
# FSDP inside the pipeline region: stage weights gathered (and gradients reduce-scattered) once per step;
# see `build`. The compile report carries this so an audit knows to expect one fsdp all-gather per weight.
FSDP_GATHER = "once_per_step"


# ----------------------------------------------------------------------------- layer order

def layer_order(n_layers: int, stages_: int, virtual_stages: int) -> np.ndarray:
    """int [n_layers]: the logical layer held at each position of the in-memory layer stack.

    The stack's `layers` dimension is split contiguously over `pipeline` (rule layers -> pipeline), so
    device d holds positions [d*v*Lc, (d+1)*v*Lc), read as v chunks of Lc = L/(vp) layers. Interleaving
    (Megatron-LM, Narayanan et al. SC'21) puts model chunk k = c*p + d on device d, so position
    d*v*Lc + c*Lc + l holds logical layer (c*p + d)*Lc + l. With v = 1 this is the identity.
    """
    p, v = stages_, virtual_stages
    lc = n_layers // (p * v)
    d, c, l = np.meshgrid(np.arange(p), np.arange(v), np.arange(lc), indexing="ij")
    return ((c * p + d) * lc + l).reshape(-1)


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
    """Inside the pipeline's shard_map: activation hints for the automatic (tensor) axes only."""

    def __init__(self, rules, sizes):
        self.rules, self.sizes = rules, sizes

    def __call__(self, x, names):
        return jax.lax.with_sharding_constraint(x, sharding_specs.mesh_spec(P(*names), self.rules, x.shape, self.sizes))


def manual_axes(rules: Rules, mesh_sizes: Mapping[str, int]) -> tuple[str, ...]:
    """`pipeline` and the axes that split the batch (data, fsdp): the pipeline region handles these by
    hand. The batch axes must be manual: left automatic, XLA gathered the whole batch onto every stage at
    the region's entry. Everything else (tensor) stays automatic, so XLA's partitioner places Megatron's
    tensor-parallel collectives inside each stage's computation, as in the unpipelined model; only the FSDP
    gather and reduce-scatter run with tensor manual too (_on_local_shards), on each tensor shard."""
    batch = [a for a in rules.get("batch", ()) if mesh_sizes.get(a, 1) > 1 and a != PIPELINE]
    return (PIPELINE, *batch)


def _only(spec: P, axes: tuple[str, ...], drop: tuple[str, ...] = ()) -> P:
    """`spec` restricted to the mesh axes in `axes` (minus `drop`)."""
    out = []
    for entry in spec:
        kept = tuple(a for a in sharding_specs.entry_axes(entry) if a in axes and a not in drop)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*out)


# ----------------------------------------------------------------------------- the slot program

def slot_program(schedule: schedules.Schedule, train: bool) -> dict[str, np.ndarray]:
    """int32 [slots, p] per field: the branch each device runs in each slot, its microbatch and chunk, and
    the buffer entries it reads and writes (entry `size` is a scratch entry for cells that use none).

    Evaluation (train=False) runs the same table with every backward cell idle, cut after its last forward.
    """
    kind, mb, chunk = (schedule.table[:, :, f] for f in (schedules.KIND, schedules.MICROBATCH, schedules.CHUNK))
    p, v = schedule.stages, schedule.virtual_stages
    d = np.arange(p)[None, :]
    place = np.where((chunk == 0) & (d == 0), 0, np.where((chunk == v - 1) & (d == p - 1), 2, 1))
    branch = np.full(kind.shape, stages.IDLE)
    branch = np.where(kind == schedules.FORWARD, stages.FWD_FIRST + place, branch)
    if train:
        branch = np.where(kind == schedules.BACKWARD, stages.BWD_FIRST + place, branch)
    acts, grads = schedule_buffers.activation_buffers(schedule), schedule_buffers.gradient_buffers(schedule)
    scratch = lambda a, plan: np.where(a < 0, plan.size, a)  # noqa: E731
    program = dict(branch=branch, mb=np.maximum(mb, 0), chunk=np.maximum(chunk, 0),
                   act_read=scratch(acts.read, acts), act_write=scratch(acts.write, acts),
                   grad_read=scratch(grads.read, grads), grad_write=scratch(grads.write, grads))
    sizes = [acts.size + 1, grads.size + 1]
    if not train:  # no gradients travel: one scratch entry
        program = {k: a[: np.nonzero(kind == schedules.FORWARD)[0].max() + 1] for k, a in program.items()}
        program["grad_read"], program["grad_write"], sizes[1] = 0 * program["grad_read"], 0 * program["grad_write"], 1
    program = {k: a.astype(np.int32) for k, a in program.items()}
    program["sizes"] = np.array(sizes)
    return program


def branch_slot_counts(schedule: schedules.Schedule, train: bool = True) -> np.ndarray:
    """int [p, NUM_BRANCHES]: in how many slots each stage runs each `lax.switch` branch of the executor.

    Read from the executor's own slot program, so an audit can weigh the collectives of each branch by
    how often a device really runs it, where the compiled loop only says the switch runs every slot.
    """
    branch = slot_program(schedule, train)["branch"]
    return np.stack([np.bincount(column, minlength=stages.NUM_BRANCHES) for column in branch.T])


def build(cfg: Any, mesh: jax.sharding.Mesh, rules: Rules, schedule: schedules.Schedule,
          train: bool = True) -> Callable:
    """fn(params, tokens [B, seq+1]) -> (loss, grads) (train) or loss: the pipelined model on `mesh`.

    Per device (shard_map, manual over `pipeline` and the batch axes): its rows of the batch split into m
    microbatches; its stage's layers as v chunks. Each slot it runs its table cell, then `ppermute` carries
    the activation to the next stage (d+1) and the input gradient to the previous one (d-1), on a ring when
    interleaved (chunk c on device p-1 feeds chunk c+1 on device 0). Received messages wait in fixed-size
    buffers (schedule_buffers) until their backward, so 1F1B keeps at most p inputs per stage whatever m.
    The cells themselves (embedding first, head and loss last, backward by vjp) are in pipeline_stages.

    FSDP inside the pipeline: stage parameters are gathered once per step, before the slot loop, and the
    gradients stay full-size over fsdp until one reduce-scatter after it. The alternative, gathering per
    microbatch inside each cell (ZeRO-3 proper), keeps only 1/fsdp of the stage's weights resident but moves
    them 3m times a step (forward, recomputed forward, reduce-scatter of each backward) instead of twice;
    with the stage already 1/p of the model, the once-per-step gather is the ZeRO-1/2-with-pipeline
    trade made by DeepSpeed and Megatron-LM's distributed optimizer. Gradients and the loss are reduced
    over the batch axes once per step, after the loop.
    """
    p, v, m = schedule.stages, schedule.virtual_stages, schedule.microbatches
    sizes = axis_sizes(mesh)
    assert sizes[PIPELINE] == p, (sizes, p)
    assert p * v >= 2 and cfg.n_layers % (p * v) == 0, (cfg.n_layers, p, v)
    manual = manual_axes(rules, sizes)
    batch_axes = manual[1:]
    replicas = math.prod(sizes[a] for a in batch_axes)

    abstract, logical = models.abstract_params(cfg)
    full_specs = sharding_specs.param_specs(abstract, logical, rules, sizes)
    param_in = jax.tree.map(lambda s: _only(s, manual), full_specs, is_leaf=lambda x: isinstance(x, P))
    batch_in = _only(sharding_specs.mesh_spec(P("batch", None), rules, None, sizes), manual)
    auto_rules = {k: tuple(a for a in axes if a not in manual) for k, axes in rules.items()}
    automatic = tuple(a for a in mesh.axis_names if a not in manual and sizes[a] > 1)

    constrain = AutoAxesHints(auto_rules, sizes)

    program = slot_program(schedule, train)
    act_entries, grad_entries = (int(n) for n in program.pop("sizes"))
    count_targets = models.target_counter(cfg)
    ring = v > 1  # only interleaving sends from the last stage back to the first
    to_next = [(d, (d + 1) % p) for d in range(p if ring else p - 1)]
    to_prev = [((d + 1) % p, d) for d in range(p if ring else p - 1)]

    def gather(x, spec):  # FSDP: the whole stage's weights, once per step
        sharded = sharding_specs.sharded_dims(_only(spec, manual, drop=(PIPELINE,)))

        def fn(x):
            for dim, axes in sharded:
                x = jax.lax.all_gather(x, axes if len(axes) > 1 else axes[0], axis=dim, tiled=True)
            return x
        return _on_local_shards(fn, x, spec, automatic) if sharded else x

    def reduce(g, spec, is_layer):  # once per step: scatter back to the FSDP shards, then sum over the rest
        sharded = sharding_specs.sharded_dims(_only(spec, manual, drop=(PIPELINE,)))

        def scatter(g):  # first, so the all-reduce below moves a shard rather than the whole stage
            for dim, axes in sharded:
                g = jax.lax.psum_scatter(g, axes if len(axes) > 1 else axes[0], scatter_dimension=dim, tiled=True)
            return g
        g = _on_local_shards(scatter, g, spec, automatic) if sharded else g
        in_spec = {a for _, axes in sharded for a in axes}
        # Embedding and head gradients exist on the first and last stage only; every stage holds a replica.
        summed = tuple(a for a in batch_axes if a not in in_spec) + (() if is_layer else (PIPELINE,))
        return (jax.lax.psum(g, summed) if summed else g) / replicas

    def region(params, tokens):
        d = jax.lax.axis_index(PIPELINE)
        params = jax.tree.map(gather, params, full_specs)  # full specs: the gather keeps the tensor split
        params = stages.make_varying(params, manual)
        stack = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), params[models.LAYERS])
        top = models.top_params(params)
        b = tokens.shape[0] // m
        micro = tokens.reshape(m, b, tokens.shape[1])
        weight = None if count_targets is None else _microbatch_weight(count_targets, tokens, batch_axes, replicas)
        fns = stages.branches(cfg, constrain, manual, 1.0 / m if weight is None else weight)
        assert len(fns) == stages.NUM_BRANCHES, len(fns)  # branch_slot_counts and the audit index by these
        dt = jnp.dtype(cfg.compute_dtype)
        act_shape = (b, tokens.shape[1] - 1, cfg.d_model)
        carry = dict(acts=jnp.zeros((act_entries, *act_shape), dt), grads=jnp.zeros((grad_entries, *act_shape), dt),
                     loss=jnp.zeros((), jnp.float32))
        if train:
            carry.update(g_stack=jax.tree.map(jnp.zeros_like, stack), g_top=jax.tree.map(jnp.zeros_like, top))
        carry = stages.make_varying(carry, manual)

        def slot(carry, row):
            cell = {k: a[d] for k, a in row.items()}
            chunk = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, cell["chunk"], 0, keepdims=False), stack)
            ops = (chunk, top, micro[cell["mb"]], carry["acts"][cell["act_read"]], carry["grads"][cell["grad_read"]])
            y, g_x, g_chunk, g_top, loss = jax.lax.switch(cell["branch"], fns, ops)
            weighted = loss / m if weight is None else loss * weight(micro[cell["mb"]])
            new = dict(carry, loss=carry["loss"] + weighted)
            # Send, then store what arrived (schedule_buffers' order), so an entry freed in this slot is reusable.
            new["acts"] = _store(carry["acts"], jax.lax.ppermute(y, PIPELINE, to_next), cell["act_write"])
            if train:
                # Every cell returns chunk and top gradients (zeros unless it is a backward), since switch
                # branches share one output type; the add costs one pass over the chunk's gradient, small next
                # to the chunk's matmuls on a microbatch.
                new["grads"] = _store(carry["grads"], jax.lax.ppermute(g_x, PIPELINE, to_prev), cell["grad_write"])
                new["g_stack"] = jax.tree.map(lambda acc, g: _add_at(acc, g, cell["chunk"]), carry["g_stack"], g_chunk)
                new["g_top"] = jax.tree.map(jnp.add, carry["g_top"], g_top)
            return new, None

        carry, _ = jax.lax.scan(slot, carry, {k: jnp.asarray(a) for k, a in program.items()})
        loss = jax.lax.psum(carry["loss"], manual) / replicas
        if not train:
            return loss
        g_layers = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), carry["g_stack"])
        grads = {**carry["g_top"], models.LAYERS: g_layers}
        grads = {k: jax.tree.map(lambda g, s: reduce(g, s, k == models.LAYERS), grads[k], full_specs[k]) for k in grads}
        return loss, grads

    out_specs = (P(), param_in) if train else P()
    return jax.shard_map(region, mesh=mesh, in_specs=(param_in, batch_in), out_specs=out_specs,
                         axis_names=set(manual), check_vma=True)


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


def _microbatch_weight(count_targets: Callable, tokens: jax.Array, batch_axes: tuple[str, ...],
                       replicas: int) -> Callable[[jax.Array], jax.Array]:
    """A microbatch's tokens -> its loss weight when not every target counts (packed documents): its counted
    targets over the mean count per batch replica, so the weighted microbatch means, summed over the
    microbatches and averaged over the replicas, are the mean over the global batch's counted targets."""
    local = count_targets(tokens)
    per_replica = (jax.lax.psum(local, batch_axes) if batch_axes else local) / replicas
    return lambda micro_tokens: count_targets(micro_tokens) / jnp.maximum(per_replica, 1.0)


def _store(buffer: jax.Array, message: jax.Array, entry: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(buffer, message, entry, 0)


def _add_at(acc: jax.Array, g: jax.Array, index: jax.Array) -> jax.Array:
    current = jax.lax.dynamic_index_in_dim(acc, index, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(acc, current + g, index, 0)


def loss_and_grad(cfg: Any, mesh: jax.sharding.Mesh, rules: Rules,
                  schedule: schedules.Schedule) -> Callable:
    """The LossAndGrad of train.step: (params, tokens [B, seq+1]) -> (mean loss, grads)."""
    return build(cfg, mesh, rules, schedule, train=True)


def loss(cfg: Any, mesh: jax.sharding.Mesh, rules: Rules, schedule: schedules.Schedule) -> Callable:
    """(params, tokens) -> mean loss, forward cells only: evaluation without gathering the layer stack."""
    return build(cfg, mesh, rules, schedule, train=False)
