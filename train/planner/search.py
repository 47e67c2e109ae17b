"""Enumerate every layout of a model on N devices (mesh axis sizes, pipeline schedule, microbatches, virtual
stages, remat, optimizer-state sharding, gradient accumulation), predict each, rank the fitting ones by step time."""
from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Mapping

import models
from mesh import topology as topology_lib
from mesh.layout import AXES
from train.config import ConfigError
from train.planner import memory, timing
from train.planner.candidate import Candidate, Prediction, mesh_of

REMATS = ("none", "save_dots", "full")
# Usable share of a device's memory: the rest is left for the CUDA/XLA runtime, NCCL buffers and
# fragmentation. An assumption, not a measurement.
USABLE_MEMORY = 0.9
UNSEARCHED = ("expert", "context")


class PlanError(ConfigError):
    """A planning request the user can fix; one line naming the setting."""


def parse_fixed(text: str, num_devices: int) -> dict[str, int]:
    """`tensor:8,pipeline:4` (the mesh.bench syntax) -> {axis: size}, checked against the devices."""
    fixed: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in str(text or "").split(","))):
        axis, _, size = item.partition(":")
        if axis not in AXES:
            raise PlanError(f"plan.fixed={text!r}: {axis!r} is not a mesh axis; use {', '.join(AXES)}")
        try:
            fixed[axis] = int(size)
        except ValueError:
            raise PlanError(f"plan.fixed={text!r}: use AXIS:SIZE pairs, e.g. tensor:8,pipeline:4") from None
        if fixed[axis] < 1 or num_devices % fixed[axis]:
            raise PlanError(f"plan.fixed={text!r}: {axis}={fixed[axis]} does not divide the {num_devices} devices")
    if num_devices % math.prod(fixed.values() or [1]):
        raise PlanError(f"plan.fixed={text!r}: the fixed sizes multiply to {math.prod(fixed.values())}, which does "
                        f"not divide the {num_devices} devices")
    return fixed


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(n: int, fixed: Mapping[str, int], cfg: models.ModelConfig, global_batch: int) -> Iterator[dict[str, int]]:
    """Every mesh multiplying to n that the model's widths and the batch divide. The planner does not search
    `expert` and `context` (they serve mixture-of-experts models and long sequences, which it does not model):
    they stay at 1 unless plan.fixed sets them."""
    def rec(i: int, left: int, acc: dict[str, int]):
        if i == len(AXES) - 1:
            yield {**acc, AXES[i]: left}
            return
        axis = AXES[i]
        options = [fixed[axis]] if axis in fixed else [1] if axis in UNSEARCHED else _divisors(left)
        for s in options:
            if left % s == 0:
                yield from rec(i + 1, left // s, {**acc, axis: s})
    for sizes in rec(0, n, {}):
        if "tensor" in fixed and sizes["tensor"] != fixed["tensor"]:
            continue
        if _divides(cfg, sizes) and not global_batch % (sizes["data"] * sizes["fsdp"]):
            yield sizes


# The mesh axis that splits each logical axis of the planner's strategy (sharding/rules.py, fsdp_tensor).
SPLIT_BY = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor", "embed": "fsdp"}


def _divides(cfg: models.ModelConfig, sizes: Mapping[str, int]) -> bool:
    """The model's sizes the family names per logical axis (models.Family.divisibility) divide the axis that
    splits them, and the layers divide into the pipeline's stages."""
    for logical, settings in models.family_of(cfg).divisibility(cfg).items():
        if logical in SPLIT_BY and any(size % sizes[SPLIT_BY[logical]] for _, size in settings):
            return False
    return not cfg.n_layers % sizes["pipeline"]


def pipeline_options(p: int, n_layers: int, rows: int) -> list[tuple[str, int, int]]:
    """(schedule, microbatches, virtual stages) for p stages with `rows` rows per replica and update."""
    if p == 1:
        return [("none", 1, 1)]
    out = []
    for m in (p, 2 * p, 4 * p, 8 * p):
        if rows % m:
            continue
        out.append(("1f1b", m, 1))
        if n_layers % (2 * p) == 0:
            out.append(("interleaved", m, 2))
    if rows % p == 0:
        out.append(("gpipe", p, 1))
    return out


def evaluate(cfg: models.ModelConfig, c: Candidate, global_batch: int, topo: topology_lib.Topology,
             donated: bool) -> Prediction:
    cfg = dataclasses.replace(cfg, remat=c.remat)
    mem = memory.predict(cfg, c, global_batch, donated)
    t = timing.predict(cfg, c, global_batch, topo)
    capacity = topo.device_memory_gb * 1e9 * USABLE_MEMORY
    return Prediction(candidate=c, memory=mem, fits=not capacity or mem["total"] <= capacity, **t)


def search(cfg: models.ModelConfig, global_batch: int, topo: topology_lib.Topology, fixed: Mapping[str, int],
           donated: bool = True, max_accum: int = 64) -> list[Prediction]:
    """Every candidate's best version (fewest accumulation steps that fit), fitting ones first, by step time."""
    n = topo.num_devices
    out: list[Prediction] = []
    for sizes in meshes(n, fixed, cfg, global_batch):
        replica_rows = global_batch // (sizes["data"] * sizes["fsdp"])
        mesh = mesh_of(sizes)
        for accum in [a for a in _divisors(replica_rows) if a <= max_accum]:
            found = False
            for name, m, v in pipeline_options(sizes["pipeline"], cfg.n_layers, replica_rows // accum):
                for remat in REMATS:
                    for shard in ((False, True) if sizes["data"] > 1 else (False,)):
                        c = Candidate(mesh, name, m, v, remat, shard, accum)
                        pred = evaluate(cfg, c, global_batch, topo, donated)
                        out.append(pred)
                        found |= pred.fits
            if found:
                break  # more accumulation only adds steps once the layout fits
    if not out:
        raise PlanError(f"no layout of {n} devices divides the model (heads {cfg.n_heads}, d_model {cfg.d_model}, "
                        f"layers {cfg.n_layers}) and train.global_batch_size={global_batch}; change one of them")
    return sorted(out, key=lambda p: (not p.fits, p.step_time_s if p.fits else p.memory["total"], p.memory["total"]))


def check_fits(ranked: list[Prediction], topo: topology_lib.Topology) -> None:
    if not ranked[0].fits:
        best = ranked[0].memory["total"] / 1e9
        raise PlanError(f"the model fits nowhere on {topo.num_devices} devices of {topo.name}: the smallest layout "
                        f"needs {best:,.1f} GB per device of {topo.device_memory_gb:g} GB; add hosts (--hosts) or "
                        f"lower train.global_batch_size")
