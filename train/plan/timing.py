"""Step time of a candidate, a roofline: matmuls at the topology's peak times a matmul efficiency, the
memory-bound work (train/plan/memory_bound.py) at the device's memory bandwidth, both times the topology's
measured `step_overhead` (train/plan/reference_step.py), the communication the layout
needs (sharding.expected) priced by mesh.cost on the topology, and the schedule table's bubble over both kinds
of work. Matmuls and memory-bound work add up: each kernel is bound by one of them and XLA runs them in turn.

Overlap is credited only where the step overlaps: FSDP's per-layer weight gathers and gradient
reduce-scatters run inside the layer scan next to other layers' matmuls (XLA's latency-hiding
scheduler on accelerators); the data-parallel gradient all-reduce waits for the last gradient, Megatron's
all-reduces sit between dependent matmuls and the lockstep pipeline's sends end each slot: all exposed.

Devices that share one host (`Topology.shared_host`: XLA's virtual CPU devices) are not independent: the step
is the sum over devices of each one's work at the host's total throughput (each device is calibrated at its
share of it, so for the even work of an SPMD step that is one device's work at its share), every replicated
part counting once per device; a pipeline's idle cells run no branch, so their cores serve the busy stages and
no bubble is charged; a collective is a copy by the same cores, so none is hidden behind compute.
"""
from __future__ import annotations

import functools
import math

import numpy as np

import models
from mesh import cost, layout, placement
from mesh import topology as topology_lib
from sharding import schedules
from sharding.expected import expected_traffic, ring_passes, sends_per_step
from train.plan import memory, memory_bound
from train.plan.candidate import Candidate

# Fraction of peak a matmul reaches, by its smallest dimension, for devices this project has not measured.
# An assumption (not a measurement, not fitted to any throughput table): small matmuls are bound by
# memory and launch overhead, large ones approach the tensor-core peak. `--calibrate` replaces it.
DEFAULT_EFFICIENCY = [[128.0, 0.3], [512.0, 0.55], [2048.0, 0.7], [8192.0, 0.75]]
OVERLAPPED = {("all_gather", ("fsdp",)), ("reduce_scatter", ("fsdp",))}


def efficiency(topo: topology_lib.Topology, dtype: str, dim: float) -> float:
    """Piecewise linear in log2(dim) through the topology's measured curve for `dtype` (else the default)."""
    curve = topo.matmul_efficiency.get(dtype) or DEFAULT_EFFICIENCY
    xs = np.log2([x for x, _ in curve])
    return float(np.interp(math.log2(max(dim, 1.0)), xs, [e for _, e in curve]))


def peak_flops(topo: topology_lib.Topology, dtype: str) -> float:
    if dtype not in topo.peak_tflops:
        raise topology_lib.TopologyError(f"--topology={topo.name}: no peak_tflops for model.compute_dtype={dtype}; "
                                         f"add \"peak_tflops\": {{\"{dtype}\": TFLOPS}} to the topology file")
    return topo.peak_tflops[dtype] * 1e12


def hardware_flops_per_device(cfg: models.ModelConfig, c: Candidate, global_batch: int) -> float:
    """Model FLOPs plus recomputed forwards (a third of training FLOPs each): full remat recomputes every
    layer once; a pipeline's backward cell recomputes its chunk's forward (and full remat inside it again)."""
    sizes = c.sizes
    per_token = models.flops_per_token(cfg) + expert_padding_flops_per_token(cfg)
    model = per_token * global_batch * cfg.seq_len / math.prod(sizes.values())
    extra = (cfg.remat == "full") + (sizes["pipeline"] > 1)
    # save_dots keeps the projections but recomputes the attention's batched matmuls (their forward FLOPs: a third)
    attention_forward = models.family_of(cfg).cost.attention_flops_per_token(cfg) / 3
    attention = attention_forward * global_batch * cfg.seq_len / math.prod(sizes.values())
    return model * (1 + extra / 3) + (attention if cfg.remat == "save_dots" else 0.0)


def expert_padding_flops_per_token(cfg: models.ModelConfig) -> float:
    """Matmul FLOPs per token the experts run beyond the model FLOPs' count: the model counts the k experts a
    token is routed to, but each expert's MLP runs on every slot of its [rows, experts, capacity] buffer, filled
    or empty, so a token costs experts x capacity / seq_len slots' worth of expert matmuls (6 per weight)."""
    experts = models.family_of(cfg).parallel.expert_buffers(cfg)
    if experts is None:
        return 0.0
    per_expert = memory.expert_params(cfg) / experts.experts
    return 6 * per_expert * (experts.experts * experts.capacity / cfg.seq_len - cfg.experts_per_token)


@functools.lru_cache(maxsize=16384)
def _placement(mesh: tuple[tuple[str, int], ...], axes: tuple[str, ...], topo_key: tuple):
    topo = _TOPOLOGIES[topo_key]
    sizes = dict(mesh)
    order = _order(mesh, topo_key)
    return placement.placement(sizes, axes, topo, device_order=order)


@functools.lru_cache(maxsize=4096)
def _order(mesh, topo_key):
    return layout.hybrid_device_order(dict(mesh), _TOPOLOGIES[topo_key])


_TOPOLOGIES: dict[tuple, topology_lib.Topology] = {}


def _key(topo: topology_lib.Topology) -> tuple:
    key = (topo.name, topo.hosts, repr(topology_lib.topology_to_dict(topo)))
    _TOPOLOGIES[key] = topo
    return key


def _count(e, cfg: models.ModelConfig, c: Candidate, layers_per_device: int) -> int:
    """How many collectives carry a row's bytes (each pays the latency terms once)."""
    accum = c.grad_accum_steps
    if e.axes == ("context",) and e.op in ("all_gather", "reduce_scatter"):  # K and V in a pipeline's cells
        cells = 2 + (cfg.remat == "full") if e.op == "all_gather" else 1  # forward, recomputes; the backward
        return 2 * layers_per_device * c.microbatches * accum * cells
    if e.axes == ("tensor",) and e.op in ("all_reduce", "reduce_scatter", "all_gather"):  # Megatron's, or SP's pair
        return max(1, round(4 * layers_per_device * c.microbatches * accum))
    if e.op == "all_gather":
        return layers_per_device * (1 if c.sizes["pipeline"] > 1 else 2 * accum)
    if e.op == "reduce_scatter":
        return layers_per_device * (1 if c.sizes["pipeline"] > 1 else accum)
    if e.op == "collective_permute" and e.axes == ("pipeline",):  # idle slots send nothing
        return sends_per_step(c.schedule, c.sizes["pipeline"], c.microbatches, c.virtual_stages) * accum
    if e.op == "collective_permute" and e.axes == ("context",):  # ring attention: K and V, each hop, each pass
        return ring_passes(cfg.remat) * 2 * (c.sizes["context"] - 1) * layers_per_device * c.microbatches * accum
    if e.op == "collective_permute":
        return 4 * (c.virtual_stages * c.microbatches + c.sizes["pipeline"] - 1) * accum
    return 1  # gradients: XLA combines them into one all-reduce


def expected_rows(cfg: models.ModelConfig, c: Candidate, global_batch: int) -> list:
    """sharding.expected's rows for the candidate's layout (sequence parallelism's rules included)."""
    abstract, specs, rules = memory.layout_specs(cfg, c.mesh, c.sequence_parallel)
    sizes = c.sizes
    pipe = ({"schedule": c.schedule, "microbatches": c.microbatches, "virtual_stages": c.virtual_stages}
            if sizes["pipeline"] > 1 else None)
    return expected_traffic(cfg, abstract, specs, rules, sizes, global_batch, pipe)


def communication(cfg: models.ModelConfig, c: Candidate, global_batch: int, topo: topology_lib.Topology,
                  counted: bool = True) -> list[tuple[str, str, tuple[str, ...], float]]:
    """[(purpose, op, axes, seconds)] per expected collective of the layout on `topo`, none overlapped.

    `counted` False prices each row as one collective of all its bytes (as the audit's projection does
    for a combined record); True splits it into the number of collectives the step issues."""
    sizes = c.sizes
    key = _key(topo)
    layers = cfg.n_layers // sizes["pipeline"]
    out = []
    for e in expected_rows(cfg, c, global_batch):
        n = _count(e, cfg, c, layers) if counted else 1
        repeated = e.op in ("all_gather", "reduce_scatter") and e.axes != ("tensor",) and sizes["pipeline"] == 1
        nbytes = e.bytes * (c.grad_accum_steps if repeated else 1)  # FSDP gathers again in every accumulation step
        p = _placement(c.mesh, tuple(e.axes), key)
        one = cost.predict_placement_us(e.op.replace("collective_permute", "permute"), nbytes / n, p, topo)
        out.append((e.purpose, e.op, tuple(e.axes), n * one * 1e-6))
    return out


def bubble_fraction(c: Candidate) -> float:
    """Idle share of the schedule table's cells (0 without a pipeline)."""
    if c.sizes["pipeline"] == 1:
        return 0.0
    return schedules.bubble_fraction(memory.schedule_table(c.schedule, c.sizes["pipeline"], c.microbatches,
                                                           c.virtual_stages))


def work_seconds(cfg: models.ModelConfig, c: Candidate, global_batch: int,
                 topo: topology_lib.Topology) -> tuple[float, dict[str, float]]:
    """(matmul seconds, {memory-bound part: seconds}) one device works per step, the roofline's times what a
    measured step took beyond it (topo.step_overhead; 1 where not measured)."""
    tokens = memory.rows_per_device(c, global_batch) * cfg.seq_len
    dim = min(tokens, cfg.d_model / c.sizes["tensor"])  # rows of a microbatch, or a row-parallel matmul's depth
    peak = peak_flops(topo, cfg.compute_dtype)
    compute = hardware_flops_per_device(cfg, c, global_batch) / (peak * efficiency(topo, cfg.compute_dtype, dim))
    overhead = topo.step_overhead
    return compute * overhead, {k: v * overhead for k, v in memory_bound.seconds(cfg, c, global_batch, topo).items()}


def predict(cfg: models.ModelConfig, c: Candidate, global_batch: int, topo: topology_lib.Topology) -> dict:
    sizes = c.sizes
    peak = peak_flops(topo, cfg.compute_dtype)
    compute, bound = work_seconds(cfg, c, global_batch, topo)
    work = compute + sum(bound.values())
    rows = communication(cfg, c, global_batch, topo)
    total = sum(r[3] for r in rows)
    hidden = 0.0 if topo.shared_host else min(sum(r[3] for r in rows if (r[1], r[2]) in OVERLAPPED), work)
    f = 0.0 if topo.shared_host else bubble_fraction(c)
    bubble = work * f / (1 - f)
    step = work + bubble + total - hidden
    model_flops = models.flops_per_token(cfg) * global_batch * cfg.seq_len / math.prod(sizes.values())
    by_purpose: dict[str, float] = {}
    for purpose, _, axes, s in rows:
        name = f"{purpose} [{'+'.join(axes)}]"
        by_purpose[name] = by_purpose.get(name, 0.0) + s
    return {"compute_s": compute, "memory_bound_s": work - compute, "memory_bound_by_part": bound,
            "communication_s": total - hidden, "communication_total_s": total,
            "bubble_s": bubble, "step_time_s": step, "tflops_per_device": model_flops / step / 1e12,
            "mfu": model_flops / step / peak, "tokens_per_s": global_batch * cfg.seq_len / step,
            "comm_by_purpose": by_purpose}
