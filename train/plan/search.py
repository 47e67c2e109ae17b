"""Enumerate every layout of a model on N devices (mesh axis sizes, pipeline schedule, microbatches, virtual
stages, remat, optimizer-state sharding, gradient accumulation), predict each, rank the fitting ones by step time."""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Iterator, Mapping

import models
from mesh import topology as topology_lib
from mesh.layout import AXES
from train.plan import feasible, memory, timing
from train.plan import fixed as fixed_lib
from train.plan.candidate import REMATS, Candidate, Prediction, mesh_of
from train.plan.fixed import PlanError

# Usable share of a device's memory: the rest is left for the CUDA/XLA runtime, NCCL buffers and
# fragmentation. An assumption, not a measurement.
USABLE_MEMORY = 0.9
ALWAYS_SEARCHED = ("data", "pipeline", "fsdp", "tensor")
parse_fixed = fixed_lib.parse


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def searched_axes(cfg: models.ModelConfig) -> tuple[str, ...]:
    """The mesh axes the planner varies: `expert` only for a model with experts, `context` only for sequences
    long enough for it to pay (feasible.long_sequence); plan.fixed may set any axis."""
    extra = ("expert",) * feasible.has_experts(cfg) + ("context",) * feasible.long_sequence(cfg)
    return tuple(a for a in AXES if a in ALWAYS_SEARCHED + extra)


def meshes(n: int, fixed: Mapping[str, Any], cfg: models.ModelConfig) -> Iterator[dict[str, int]]:
    """Every mesh multiplying to n with the fixed axes at their sizes and the unsearched ones at 1."""
    searched = searched_axes(cfg)

    def rec(i: int, left: int, acc: dict[str, int]):
        axis = AXES[i]
        if i == len(AXES) - 1:
            if left == fixed.get(axis, left) and (axis in searched or axis in fixed or left == 1):
                yield {**acc, axis: left}
            return
        options = [fixed[axis]] if axis in fixed else _divisors(left) if axis in searched else [1]
        for s in options:
            if left % s == 0:
                yield from rec(i + 1, left // s, {**acc, axis: s})
    yield from rec(0, n, {})


def pipeline_options(p: int, n_layers: int, rows: int) -> list[tuple[str, int, int]]:
    """(schedule, microbatches, virtual stages) for p stages with `rows` rows per replica and update: every
    microbatch count dividing the rows (down to one row each) that the schedule allows (sharding/schedules.py)."""
    if p == 1:
        return [("none", 1, 1)]
    out = []
    for m in _divisors(rows):
        out.append(("gpipe", m, 1))
        if m >= p:
            out.append(("1f1b", m, 1))
        if m % p == 0:
            out += [("interleaved", m, v) for v in _divisors(n_layers // p) if v >= 2]
    return out


def evaluate(cfg: models.ModelConfig, c: Candidate, global_batch: int, topo: topology_lib.Topology,
             donated: bool) -> Prediction:
    cfg = dataclasses.replace(cfg, remat=c.remat)
    mem = memory.predict(cfg, c, global_batch, donated)
    t = timing.predict(cfg, c, global_batch, topo)
    capacity = topo.device_memory_gb * 1e9 * USABLE_MEMORY
    return Prediction(candidate=c, memory=mem, fits=not capacity or mem["total"] <= capacity, **t)


def _candidates(sizes: dict[str, int], n_layers: int, replica_rows: int, accum: int,
                fixed: Mapping[str, Any], rows_multiple: int = 1) -> Iterator[Candidate]:
    """`rows_multiple`: what a replica's rows per update and microbatch must be a multiple of (a mixture splits
    them over `context`)."""
    mesh = mesh_of(sizes)
    shards = (False, True) if sizes["data"] > 1 else (False,)  # it shards over `data`: a no-op without it
    shards = tuple(s for s in shards if fixed.get("shard_opt_state", s) == s)
    for name, m, v in pipeline_options(sizes["pipeline"], n_layers, replica_rows // accum):
        if (replica_rows // accum // m) % rows_multiple:
            continue
        for remat in REMATS:
            for shard in shards:
                c = Candidate(mesh, name, m, v, remat, shard, accum)
                if fixed_lib.allows(fixed, c, replica_rows):
                    yield c


def _layout(cfg: models.ModelConfig, sizes: dict[str, int], global_batch: int, topo: topology_lib.Topology,
            fixed: Mapping[str, Any], donated: bool, max_accum: int) -> list[Prediction]:
    """Every candidate on one mesh, at the fewest accumulation steps where one fits."""
    replica_rows = global_batch // feasible.replicas(sizes)
    accums = [fixed["grad_accum_steps"]] if "grad_accum_steps" in fixed else \
        [a for a in _divisors(replica_rows) if a <= max_accum]
    out: list[Prediction] = []
    for accum in [a for a in accums if replica_rows % a == 0]:
        found = [evaluate(cfg, c, global_batch, topo, donated)
                 for c in _candidates(sizes, models.stack_length(cfg), replica_rows, accum, fixed,
                                      sizes["context"] if feasible.has_experts(cfg) else 1)]
        out += found
        if any(p.fits for p in found):
            break  # more accumulation only adds steps once the layout fits
    return out


def explore(cfg: models.ModelConfig, global_batch: int, topo: topology_lib.Topology, fixed: Mapping[str, Any],
            donated: bool = True, max_accum: int = 64) -> tuple[list[Prediction], Counter]:
    """(every candidate's best version, fitting ones first by step time; {reason: meshes skipped})."""
    out: list[Prediction] = []
    skipped: Counter = Counter()
    for sizes in meshes(topo.num_devices, fixed, cfg):
        reason = feasible.skip_reason(cfg, sizes, global_batch)
        found = [] if reason else _layout(cfg, sizes, global_batch, topo, fixed, donated, max_accum)
        if reason or not found:
            skipped[reason or "no candidate keeps plan.fixed"] += 1
        out += found
    if not out:
        why = "; ".join(f"{n} skipped: {r}" for r, n in skipped.most_common()) or "no mesh"
        raise PlanError(f"no layout of {topo.num_devices} devices runs the model with "
                        f"train.global_batch_size={global_batch} and plan.fixed={_text(fixed)!r} ({why}); "
                        f"change the batch, the pins or the device count")
    ranked = sorted(out, key=lambda p: (not p.fits, p.step_time_s if p.fits else p.memory["total"],
                                        p.memory["total"]))
    return ranked, skipped


def search(cfg: models.ModelConfig, global_batch: int, topo: topology_lib.Topology, fixed: Mapping[str, Any],
           donated: bool = True, max_accum: int = 64) -> list[Prediction]:
    """Every candidate's best version (fewest accumulation steps that fit), fitting ones first, by step time."""
    return explore(cfg, global_batch, topo, fixed, donated, max_accum)[0]


def skipped_text(skipped: Counter) -> str:
    return ", ".join(f"{n} skipped: {r}" for r, n in skipped.most_common())


def _text(fixed: Mapping[str, Any]) -> str:
    return ",".join(f"{k}:{str(v).lower() if isinstance(v, bool) else v}" for k, v in fixed.items())


def check_fits(ranked: list[Prediction], topo: topology_lib.Topology) -> None:
    if not ranked[0].fits:
        best = ranked[0].memory["total"] / 1e9
        raise PlanError(f"the model fits nowhere on {topo.num_devices} devices of {topo.name}: the smallest layout "
                        f"needs {best:,.1f} GB per device of {topo.device_memory_gb:g} GB; add hosts (--hosts) or "
                        f"lower train.global_batch_size")
