"""`--calibrate=FILE`: a square-matmul sweep gives the fraction of peak reached at each size, and a streaming read
the memory bandwidth (`hbm_gbps`), written with the chosen topology into a user topology file (never into the
package's presets). Virtual CPU devices share one machine, so there every device runs the probes at once, as they
run a step, and each gets its share (the topology is marked `shared_host`). Last, the planned model's reference
step (train/plan/reference_step.py) sets the planner's roofline against a measured step: `step_overhead`."""
from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib

import jax

import models
from mesh import errors
from mesh import topology as topology_lib
from train.plan import reference_step
from train.plan.search import PlanError
from train.runtime import cpu_peak, probes

ROOT = pathlib.Path(__file__).resolve().parents[2]
SIZES = (128, 256, 512, 1024, 2048, 4096, 8192)
REPEATS = 100  # best of many: small matmuls on shared cores time bimodally; the sweep must catch a fast moment
STEP_REPEATS = 50  # the reference step is short: as many chances at a fast moment as the layouts it predicts get


def sweep(dtype: str, max_n: int, every_device: bool) -> list[tuple[int, float]]:
    return [(n, probes.measure_matmul_flops(n, REPEATS, dtype, every_device)) for n in SIZES if n <= max_n]


def measure(topology: str, dtype: str) -> topology_lib.Topology:
    """`topology` with this machine's matmul curve, peak (CPU) and memory bandwidth."""
    topo = topology_lib.get_topology(topology)
    shared = jax.devices()[0].platform == "cpu"
    measured = sweep(dtype, 1024 if shared else 8192, every_device=shared)
    peaks, machine = dict(topo.peak_tflops), jax.local_device_count() if shared else 1
    if dtype not in peaks:
        if not shared:
            raise PlanError(f"--topology={topology}: no peak_tflops for {dtype}; add the datasheet figure first")
        # A CPU has no datasheet peak: the one measured peak MFU uses too (checked against this sweep's best at the
        # sizes the peak is measured at; smaller matmuls take too few microseconds to time), as each virtual device's
        # share; the efficiency curve is a fraction of the whole machine's (the sweep's rates are every device's sum).
        best = max(f for n, f in measured if n >= min(cpu_peak.SIZES))
        peaks[dtype] = cpu_peak.check(best)["flops"] / machine / 1e12
    # Four significant digits, never 0: a CPU's small matmuls against a GPU topology's peak are 1e-4 or less.
    curve = [[float(n), max(float(f"{f / (peaks[dtype] * 1e12 * machine):.4g}"), 1e-9)] for n, f in measured]
    # Virtual CPU devices share the machine's memory bus: all of them read at once and each gets its share.
    hbm = probes.measure_memory_gbps(1 << (28 if shared else 30), REPEATS, every_device=shared)
    hbm /= machine
    # a step overhead the file may hold was taken against its old sweep: 1 until this machine's step is measured
    return dataclasses.replace(topo, peak_tflops=peaks, hbm_gbps=round(hbm, 2), shared_host=shared, step_overhead=1.0,
                               matmul_efficiency={**topo.matmul_efficiency, dtype: curve})


def with_step(topo: topology_lib.Topology, cfg: models.ModelConfig, global_batch: int) -> topology_lib.Topology:
    """`topo` (calibrated) with the `step_overhead` of `cfg`'s reference step, or unchanged (1) where that step
    cannot be held in memory."""
    overhead = reference_step.step_overhead(cfg, global_batch, topo, STEP_REPEATS)
    return topo if overhead is None else dataclasses.replace(topo, step_overhead=round(overhead, 3))


def write(topology: str, path: str, cfg: models.ModelConfig, global_batch: int) -> pathlib.Path:
    """Measure this machine for `cfg` (its compute dtype and its reference step at `global_batch`) and write
    `topology` so calibrated to `path`."""
    out = pathlib.Path(path).expanduser().resolve()
    if ROOT in out.parents and out.parent.name not in ("experiments", "topologies") and "tmp" not in out.parts:
        raise PlanError(f"--calibrate={path}: write calibrations to a user file outside the package, "
                        f"e.g. ~/.config/spmdtrain/{topology}.json")
    errors.check_writable("--calibrate", path, parents=True)  # before minutes of measuring
    topo = with_step(measure(topology, cfg.compute_dtype), cfg, global_batch)
    save(topo, out, f"python -m train.plan --calibrate={path} --topology={topology}", cfg, global_batch)
    return out


def save(topo: topology_lib.Topology, out: pathlib.Path, command: str, cfg: models.ModelConfig,
         global_batch: int) -> None:
    """Write the calibrated `topo` to `out` with what it was measured on (machine, date, command, reference)."""
    provenance = {"command": command, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                  "date": datetime.date.today().isoformat(),
                  "step_overhead_reference": reference_step.describe(cfg, global_batch),
                  "peak": {cfg.compute_dtype: peak_source(topo.name, cfg.compute_dtype, measured=topo.shared_host)}}
    try:
        topology_lib.save_topology(topo, out, provenance=provenance)
    except OSError as e:
        raise PlanError(f"--calibrate={out}: cannot write there ({e.strerror}); choose a writable file") from None


def peak_source(topology: str, dtype: str, measured: bool = False) -> str:
    """Where a topology's `dtype` peak comes from: this machine's measured CPU peak (`measured`), a calibrated
    file's record of it, or the datasheet (mesh/chips.py) behind a preset."""
    if measured:
        return "this machine's measured CPU peak, " + cpu_peak.describe(cpu_peak.record())
    path = pathlib.Path(topology).expanduser()
    if path.suffix == ".json" and path.is_file():
        try:
            source = json.loads(path.read_text()).get("provenance", {}).get("peak", {}).get(dtype)
        except (OSError, ValueError, AttributeError):
            source = None
        return f"{path.name}: {source}" if source else f"{path.name} (no record of where its peak came from)"
    return f"the {topology} preset's datasheet figure (mesh/chips.py)"
