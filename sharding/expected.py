"""The communication a layout must do by construction, per step and per device, in nccl-tests bytes S.

Data parallel: one all-reduce of the gradients over the axes that split the batch but not the weight.
FSDP / ZeRO-3: the weights are all-gathered over `fsdp` in the forward pass and again in the backward
pass (the memory-saving choice of ZeRO-3), except the embedding table, whose lookup needs no weight in
the backward pass; their gradients are reduce-scattered once.
Megatron tensor parallelism: per block, the family's activation all-reduces (models.TensorTraffic: for GPT and
Llama one after attention and one after the MLP), each mirrored in the backward pass, plus the embedding
(forward) and the head's input gradient (backward); full rematerialization repeats the attention one.
Pipeline (sharding/pipeline.py): every forward of a model chunk but the last sends its activation on, every
backward of a chunk but the first (its B when split) its input gradient back, and nothing else travels (idle
cells send nothing; at a V's turn the message stays on its device); each backward cell (B and W too) recomputes
its forward; FSDP weights are gathered once per step (pipeline.FSDP_GATHER), not in the forward
and again in the backward; the embedding and head, replicated on every stage, have their gradients summed over
`pipeline` too. Stages differ (only the first embeds, only the last runs the head), so per device means the mean
over the stages, as the audit counts.
Sequence parallelism (Megatron, `seq -> tensor`): each forward all-reduce becomes a reduce-scatter and an
all-gather of the next block's input; the backward mirrors both and gathers each matmul input again for its
weight gradient (the gathered copy is not kept); pipelined, the stage messages are split over `tensor` too.
Context parallelism: the ring passes every layer's K and V blocks c-1 hops forward, their gradients c-1 hops
back, and the weight gradients are summed over `context`; pipelined, the blocks are all-gathered in each cell
(their gradients reduce-scattered), the stage messages are split over `context`, and the gradients are summed
over the batch axes and `context` in one all-reduce.
Expert parallelism (sharding/experts.py): per mixture-of-experts layer, the dispatch and combine all-to-alls of
the device's [rows, experts, capacity, d_model] buffers over `expert`, mirrored in the backward pass (and repeated
when rematerialization recomputes the layer); under `tensor` the experts' MLP all-reduces move such buffers in
place of the dense MLP's [rows, seq, d_model] activations. Under context parallelism a mixture's layers take
their rows split over `context` in place of the sequence (an all-to-all each way, mirrored backward), and the
gradients of its experts are summed over the batch axes and `context` at once.
Audit part (what the layout must communicate); train/plan/audit.py maps the parts of `--audit`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import models
from sharding import context as context_lib
from sharding import schedule_buffers, schedules
from sharding.slot_program import has_split_backward
from sharding.specs import pins_weights, spec_axes


@dataclasses.dataclass(frozen=True)
class Expected:
    purpose: str
    op: str                    # as in mesh.hlo records
    axes: tuple[str, ...]      # mesh axes of one collective, in mesh order (a str for one axis)
    bytes: float               # sum over the step of S x executions, per device

    def __post_init__(self):
        if isinstance(self.axes, str):
            object.__setattr__(self, "axes", (self.axes,))


@dataclasses.dataclass(frozen=True)
class Layout:
    """What every rule reads: the model, its parameters (`leaves`, their `specs`, which are `lookup` tables),
    the rules and mesh sizes, the global batch and the pipeline's {schedule, microbatches, virtual_stages} or None
    (without `schedule`, one of the tables with 2(vm+p-1) slots)."""
    cfg: models.ModelConfig
    leaves: tuple
    specs: tuple
    lookup: tuple[bool, ...]
    rules: Mapping
    sizes: Mapping[str, int]
    global_batch: int
    pipeline: Mapping[str, int] | None
    routed: tuple[bool, ...] = ()  # per leaf: read on rows split over context (models.on_whole_rows)

    @property
    def family(self) -> models.Family:
        return models.family_of(self.cfg)

    @property
    def batch_axes(self) -> list[str]:
        return [a for a in self.rules.get("batch", ()) if self.sizes.get(a, 1) > 1]

    @property
    def pipelined(self) -> bool:
        return bool(self.pipeline) and self.sizes.get("pipeline", 1) > 1

    @property
    def chunks(self) -> int:
        """Model chunks of the pipeline (stages x virtual stages), when pipelined."""
        return self.sizes["pipeline"] * self.pipeline.get("virtual_stages", 1)

    def schedule_key(self) -> tuple[str, int, int, int]:
        """(schedule name, stages, microbatches, virtual stages) of the pipeline (when pipelined)."""
        m, v = self.pipeline["microbatches"], self.pipeline.get("virtual_stages", 1)
        name = self.pipeline.get("schedule") or ("interleaved" if v > 1 else "gpipe")
        return name, self.sizes["pipeline"], m, v

    def schedule(self) -> schedules.Schedule:
        """The pipeline's table (when pipelined)."""
        return schedules.build(*self.schedule_key())

    @property
    def rows(self) -> int:
        """Rows of the batch on one device (the batch axes split it)."""
        return self.global_batch // math.prod(self.sizes[a] for a in self.batch_axes)

    @property
    def itemsize(self) -> int:
        return jax.numpy.dtype(self.cfg.compute_dtype).itemsize

    @property
    def experts(self) -> models.ExpertBuffers | None:
        return self.family.parallel.expert_buffers(self.cfg)


def _rows_over_context(x: Layout) -> bool:
    """A mixture under context parallelism: its layers split the rows over `context` in place of the sequence
    (Hooks.whole_rows), so it routes whole rows in their order."""
    return x.experts is not None and x.sizes.get("context", 1) > 1


def _shard_bytes(leaf, spec: P, sizes: Mapping[str, int], drop: str | None = None) -> float:
    """Bytes of one device's piece of `leaf` under `spec`, optionally as if `drop` did not split it."""
    ways = math.prod(sizes[a] for a in spec_axes(spec) if a != drop)
    return math.prod(leaf.shape) * leaf.dtype.itemsize / ways


def _on_every_stage(spec: P) -> bool:
    """A weight replicated over `pipeline`: the top parameters (embedding, final norm, head); the stack is split."""
    return "pipeline" not in spec_axes(spec)


def gradient_all_reduces(x: Layout) -> list[Expected]:
    """Data parallelism: one all-reduce of each gradient over the batch axes that do not split its weight
    (those held on every pipeline stage are summed over `pipeline` too, in `stage_replicated_gradients`);
    context splits the work like the batch, and XLA sums the weight gradients over it on its own."""
    reduced: dict[tuple[str, ...], float] = {}
    routed = x.routed if _rows_over_context(x) else (False,) * len(x.leaves)
    for leaf, spec, joint in zip(x.leaves, x.specs, routed):
        if not (x.pipelined and _on_every_stage(spec)):
            axes = tuple(a for a in x.batch_axes if a not in spec_axes(spec)) + ("context",) * joint
            axes += _context_in_pipeline(x, spec)
            if axes:
                axes = tuple(a for a in x.sizes if a in axes)
                reduced[axes] = reduced.get(axes, 0.0) + _shard_bytes(leaf, spec, x.sizes)
    if x.sizes.get("context", 1) > 1 and not x.pipelined:  # experts on rows over context: summed above
        reduced[("context",)] = sum(_shard_bytes(leaf, spec, x.sizes) for leaf, spec, joint
                                    in zip(x.leaves, x.specs, routed) if "context" not in spec_axes(spec) and not joint)
    return [Expected("gradient all-reduce", "all_reduce", axes, nbytes) for axes, nbytes in reduced.items()]


def _context_in_pipeline(x: Layout, spec: P) -> tuple[str, ...]:
    """("context",) when a pipeline sums a weight's gradients over `context` with the batch axes, in one all-reduce
    (sharding/pipeline.py, where `context` is manual like them); else ()."""
    return ("context",) if x.pipelined and x.sizes.get("context", 1) > 1 and "context" not in spec_axes(spec) else ()


def fsdp_gathers(x: Layout) -> list[Expected]:
    """FSDP on each batch axis that splits weights: gathered forward and backward (lookup tables forward
    only; once per step under a pipeline), gradients reduce-scattered. Experts held apart are neither; experts
    split over `expert` too are gathered once without rematerialization: the all-to-all region takes them whole
    over `fsdp` and keeps that copy for its backward, as the backward keeps a weight the model's hooks pin gathered
    (sharding.specs.pins_weights)."""
    expert_axes = set(x.rules.get("experts", ()))
    apart = {a for a in expert_axes if x.sizes.get(a, 1) > 1}
    out = []
    for axis in x.batch_axes:
        gathered = gathers = 0.0
        for leaf, spec, is_lookup in zip(x.leaves, x.specs, x.lookup):
            if axis in spec_axes(spec) and axis not in expert_axes:
                full = _shard_bytes(leaf, spec, x.sizes, drop=axis)
                kept = x.cfg.remat == "none" and (bool(apart & set(spec_axes(spec))) or pins_weights(x.rules, x.sizes))
                once = x.pipelined or is_lookup or kept
                gathered += full
                gathers += full if once else 2 * full
        if gathered:
            purpose = "weight all-gather (once per step, pipeline)" if x.pipelined else \
                "weight all-gather (forward, kept for the backward)" if gathers == gathered else \
                "weight all-gather (forward + backward)"
            out.append(Expected(purpose, "all_gather", axis, gathers))
            out.append(Expected("gradient reduce-scatter", "reduce_scatter", axis, gathered))
    return out


def stage_replicated_gradients(x: Layout) -> list[Expected]:
    """The embedding, final norm and head are held by every stage, but only the first stage (embedding)
    and the last (head) produce their gradients, so the replicas must be summed over `pipeline` as well
    as over the batch axes that do not shard them: one all-reduce over both (sharding/pipeline.py)."""
    if not x.pipelined:
        return []
    by_axes: dict[tuple[str, ...], float] = {}
    for leaf, spec in zip(x.leaves, x.specs):
        if _on_every_stage(spec):
            axes = tuple(a for a in x.sizes if a == "pipeline" or (a in x.batch_axes and a not in spec_axes(spec))
                         or a in _context_in_pipeline(x, spec))
            by_axes[axes] = by_axes.get(axes, 0.0) + _shard_bytes(leaf, spec, x.sizes)
    return [Expected("embedding/head gradient all-reduce (on every stage)", "all_reduce", axes, nbytes)
            for axes, nbytes in by_axes.items()]


def _expert_buffer_bytes(x: Layout) -> float:
    """One device's per-expert token buffers of one MoE layer: [rows, n_experts, capacity, d_model] (its rows
    split over `context` too under context parallelism)."""
    rows = x.rows // (x.sizes.get("context", 1) if _rows_over_context(x) else 1)
    return rows * x.experts.experts * x.experts.capacity * x.cfg.d_model * x.itemsize


def _activation_all_reduces(cfg: models.ModelConfig, chunks: int, stages: int) -> float:
    """Megatron's activation all-reduces per device per step, in units of the replica's whole batch of
    activations [rows, seq, d_model] (the microbatches of a pipeline add up to one such unit).

    Per layer: forward 2 (after attention, after the MLP) and backward 2 (the input gradients of the
    column-parallel attention and MLP); full remat recomputes the attention one only, since the MLP one
    makes nothing but the layer's output, which the layer's backward never reads (XLA drops it). Plus
    the embedding's vocab-parallel lookup (forward) and the head's input gradient (backward). The
    vocab-parallel loss's [rows, seq] reductions are 1/d_model of a unit each and left out.
    Pipelined over `chunks` model chunks (sharding/pipeline.py): each backward cell recomputes its
    chunk's forward, 2 more per layer. Its output is dead there (the gradient arrives from the next
    stage), which XLA sees when a chunk is one layer, with no layer loop around it: the chunk's last
    all-reduce goes (both forward ones under full remat, whose primal pass computes only the output),
    except on the last chunk, whose output feeds the head. The embedding runs twice on the first stage
    (forward cell, and again in the backward cell), the head's input gradient once on the last stage:
    3 per step over the stages, averaged like everything else since the audit reports the mean device.
    """
    t = models.family_of(cfg).parallel.tensor_traffic
    full = cfg.remat == "full"
    per_layer = 2 * t.forward_per_layer + t.recomputed_by_full_remat * full
    if not chunks:
        return per_layer * cfg.n_layers + t.embed_forward + t.head_backward
    dead = (chunks - 1) * (t.forward_per_layer if full else 1) if cfg.n_layers == chunks else 0
    top = 2 * t.embed_forward + t.head_backward
    return ((per_layer + t.forward_per_layer) * cfg.n_layers - dead + top) / stages


def _sequence_parallel(cfg: models.ModelConfig, act: float, chunks: int, stages: int) -> list[Expected]:
    """Megatron sequence parallelism's activation traffic over `tensor`, `act` bytes a unit. Each activation
    all-reduce tensor parallelism would do (`_activation_all_reduces`, pipelined or not) becomes a reduce-scatter
    and an all-gather: forward, the scatter of a block's output and the gather of the next matmul input;
    backward, the gather of the scatter's gradient and the scatter of the gather's. The backward also gathers
    each forward all-gather's input again for its weight gradient (the gathered copy is not kept), except the
    attention's under full remat, whose recompute gathers it for the backward. The top mirrors it: the
    embedding lookup reduce-scatters forward and gathers its gradient back, the head gathers its input and
    reduce-scatters that gradient. Pipelined, each backward cell's recomputed forward counts like the forward."""
    t = models.family_of(cfg).parallel.tensor_traffic
    units = _activation_all_reduces(cfg, chunks, stages)
    again = (t.forward_per_layer - t.recomputed_by_full_remat * (cfg.remat == "full")) * cfg.n_layers
    return [Expected("activation reduce-scatter (sequence parallel)", "reduce_scatter", "tensor", units * act),
            Expected("activation all-gather (sequence parallel)", "all_gather", "tensor",
                     (units + again / (stages if chunks else 1)) * act)]


def tensor_activations(x: Layout) -> list[Expected]:
    """Megatron tensor parallelism's activation all-reduces (or sequence parallelism's scatters and gathers);
    under experts, the experts' MLP all-reduces (forward, backward; scatters under sequence parallelism) move
    their buffers, not activations: pipelined, once more in each backward cell's recomputed forward, on the stage
    that holds the layer (a 1/stages share of the mean device)."""
    if x.sizes.get("tensor", 1) == 1 or not any("tensor" in spec_axes(s) for s in x.specs):
        return []
    cfg = x.cfg
    act = x.rows * (cfg.seq_len // x.sizes.get("context", 1)) * cfg.d_model * x.itemsize  # one device's rows
    chunks = x.chunks if x.pipelined else 0
    stages = x.sizes["pipeline"] if x.pipelined else 1
    mixture = 0.0 if x.experts is None else x.experts.layers / stages  # MoE layers per device
    buffers = mixture * (3 if x.pipelined else 2) * (_expert_buffer_bytes(x) - act) if mixture else 0.0
    if "tensor" in x.rules.get("seq", ()):
        scatters, gathers = _sequence_parallel(cfg, act, chunks, x.sizes.get("pipeline", 1))
        if x.experts is None:
            return [scatters, gathers]
        # A mixture's MLP reductions scatter its buffers; its weight gradients read the kept buffers, so its
        # input is not gathered again (models/moe.py takes whole rows in and gives whole rows back).
        return [dataclasses.replace(scatters, bytes=scatters.bytes + buffers),
                dataclasses.replace(gathers, bytes=gathers.bytes - mixture * act)]
    nbytes = _activation_all_reduces(cfg, chunks, x.sizes.get("pipeline", 1)) * act + buffers
    return [Expected("activation all-reduce (Megatron)", "all_reduce", "tensor", nbytes)]


def context_ring(x: Layout) -> list[Expected]:
    """Ring attention passes every layer's K and V blocks c-1 hops forward and their gradients c-1 hops back
    (again where the backward recomputes attention: full remat and save_dots); a sliding layer only the blocks its
    window reaches (sharding/context.ring_steps: with c = 4 chunks of 8 positions and a window of 8, 2 of the 3).
    In a pipeline's cells the blocks are
    all-gathered instead and their gradients reduce-scattered (sharding/context.py, _next_block), by every cell that
    runs a chunk's forward: the forward cell, and each backward cell (B and W for a split backward) that recomputes
    it, full remat again."""
    context = x.sizes.get("context", 1)
    if context == 1:
        return []
    cfg = x.cfg
    heads_ways = math.prod(x.sizes[a] for a in x.rules.get("heads", ()) if x.sizes.get(a, 1) > 1)
    kv_heads = x.family.parallel.kv_heads(cfg) // heads_ways
    block = x.rows * (cfg.seq_len // context) * kv_heads * cfg.head_dim * x.itemsize
    if x.pipelined:
        # A split backward runs B and W cells per chunk, except the first chunk's B (pipeline_stages: idle), so
        # the mean device runs 2 - 1/chunks of them per chunk.
        forwards, backwards = _cell_passes(x, full_remat_only=True)
        whole = 2 * context * cfg.n_layers * block / x.sizes["pipeline"]  # K and V of the stage's layers, gathered
        return [Expected("context K/V all-gather", "all_gather", "context", forwards * whole),
                Expected("context K/V gradient reduce-scatter", "reduce_scatter", "context", backwards * whole)]
    hops = sum(len(context_lib.ring_steps(context, cfg.seq_len, spec.window)) for spec in models.layer_specs(cfg))
    return [Expected("ring attention K/V blocks", "collective_permute", "context",
                     ring_passes(cfg.remat) * 2 * hops * block)]


def ring_passes(remat: str) -> int:
    """Times a step runs the ring over each layer: forward, backward (the gradients going back), and the recompute
    of full remat or save_dots (which saves no attention matmul: they have batch dimensions)."""
    return 2 + (remat in ("full", "save_dots"))


def _cell_passes(x: Layout, full_remat_only: bool = False) -> tuple[float, float]:
    """(forward passes, backward passes) a pipelined layer runs per microbatch on the mean device: the forward
    cell, and each backward cell (B and W for a split backward, except the first chunk's B, pipeline_stages: idle,
    so 2 - 1/chunks of them per chunk) recomputing the forward, once more when remat recomputes the layer inside
    it (any remat, or only full remat's for work a saved-dots policy keeps)."""
    backwards = 2 - 1 / x.chunks if has_split_backward(x.schedule()) else 1
    again = x.cfg.remat == "full" if full_remat_only else x.cfg.remat != "none"
    return 1 + backwards * (1 + again), backwards


def expert_all_to_alls(x: Layout) -> list[Expected]:
    """Per mixture layer the dispatch and combine all-to-alls of the device's buffers over `expert`, forward
    and backward (and again when rematerialization recomputes the layer); pipelined, in every cell pass over
    the stage's layers."""
    if x.experts is None or x.sizes.get("expert", 1) == 1:
        return []
    return [Expected("expert dispatch and combine", "all_to_all", "expert",
                     _mixture_all_to_alls(x) * _expert_buffer_bytes(x))]


def _mixture_all_to_alls(x: Layout) -> float:
    """All-to-alls per step of a pair the mixture layers run (there and back) on the mean device: per layer 2 in
    the forward and 2 in the backward, 2 more when remat recomputes the layer; pipelined, 2 per cell pass over
    the stage's layers (`_cell_passes`)."""
    if x.pipelined:
        forwards, backwards = _cell_passes(x)
        return x.experts.layers / x.sizes["pipeline"] * 2 * (forwards + backwards)
    return x.experts.layers * (4 + 2 * (x.cfg.remat != "none"))


def context_rows(x: Layout) -> list[Expected]:
    """A mixture under context parallelism trades its input's sequence split for a row split and back, per layer
    forward and backward (and again when rematerialization recomputes the layer): all-to-alls of the device's
    [rows, seq / context, d_model] activations. Pipelined, the last all-to-all of a backward cell's recomputed
    forward (rows back to `context`) makes nothing but the chunk's output, which is dead there (the gradient comes
    from the next stage) when the chunk holds one group, with no layer loop around it: XLA drops it on every chunk
    but the last, whose output feeds the head (as for Megatron's all-reduces; measured without remat)."""
    if not _rows_over_context(x):
        return []
    act = x.rows * (x.cfg.seq_len // x.sizes["context"]) * x.cfg.d_model * x.itemsize
    units = _mixture_all_to_alls(x)
    if x.pipelined and models.stack_length(x.cfg) == x.chunks:
        units -= (x.chunks - 1) / x.sizes["pipeline"]
    return [Expected("mixture rows over context", "all_to_all", "context", units * act)]


def stage_sends(x: Layout) -> list[Expected]:
    """The pipeline's messages: only cells with something to send send it (sharding.slot_program.send_patterns), so a
    step moves each microbatch's activation and gradient once across each stage boundary, whatever the schedule's
    idle slots; per device, the mean over the stages."""
    if not x.pipelined:
        return []
    micro = x.rows // x.pipeline["microbatches"]
    split = x.sizes.get("tensor", 1) if "tensor" in x.rules.get("seq", ()) else 1  # sequence parallel messages
    split *= x.sizes.get("context", 1)  # each device sends its slice of the rows' sequence
    act = micro * x.cfg.seq_len // split * x.cfg.d_model * x.itemsize
    return [Expected("stage activations and gradients", "collective_permute", "pipeline",
                     messages_per_step(*x.schedule_key()) * act)]


def messages_per_step(name: str, p: int, m: int, v: int) -> float:
    """Messages one device sends per step, the mean over the stages: the messages the buffer plans receive from
    another stage (what stays on a device at a V's turn is not sent)."""
    return sum(int(r.sum()) for r in _received(name, p, m, v)) / p


def sends_per_step(name: str, p: int, m: int, v: int) -> int:
    """Permutes a step issues: per channel, the slots in which some stage sends on it (the others run none)."""
    return sum(int(r.any(axis=1).sum()) for r in _received(name, p, m, v))


@functools.lru_cache(maxsize=1024)
def _received(name: str, p: int, m: int, v: int) -> list[np.ndarray]:
    """bool [slots, p] per channel between stages: which stage receives a message in which slot (the buffer
    plans' writes). Cached: the planner asks for the same few schedules for every layout it searches."""
    schedule = schedules.build(name, p, m, v)
    plans = (schedule_buffers.activation_buffers(schedule), schedule_buffers.gradient_buffers(schedule))
    return [write >= 0 for plan in plans for channel, write in plan.writes.items() if channel != schedule_buffers.SELF]


# One rule per kind of parallelism, in the order the table lists them.
RULES: list[Callable[[Layout], list[Expected]]] = [
    gradient_all_reduces, fsdp_gathers, stage_replicated_gradients, tensor_activations, context_ring,
    expert_all_to_alls, context_rows, stage_sends]


def expected_traffic(cfg: models.ModelConfig, abstract_params: Any, param_specs: Any, rules: Mapping,
                     sizes: Mapping[str, int], global_batch: int,
                     pipeline: Mapping[str, int] | None = None) -> list[Expected]:
    """What the layout requires; `pipeline` = {schedule, microbatches, virtual_stages} when mesh.pipeline > 1."""
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(abstract_params)[0])
    lookup_keys = models.family_of(cfg).parallel.lookup_keys(cfg)  # tables only looked up: gathered forward only
    lookup = tuple(len(path) == 1 and getattr(path[0], "key", None) in lookup_keys for path in paths)
    specs = tuple(jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, P)))
    layout = Layout(cfg, leaves, specs, lookup, rules, sizes, global_batch, pipeline)
    if _rows_over_context(layout):  # only then: the planner calls this for every layout it searches
        keys = [tuple(str(getattr(k, "key", k)) for k in path) for path in paths]
        routed = tuple(k[0] == models.LAYERS and models.on_whole_rows(k[1:]) for k in keys)
        layout = dataclasses.replace(layout, routed=routed)
    return [row for rule in RULES for row in rule(layout)]
