"""`--calibrate=FILE`: a square-matmul sweep on this device gives the fraction of peak reached at each size, and a
streaming element-wise op its memory bandwidth (`hbm_gbps`), written with the chosen topology into a user topology
file (never into the package's presets)."""
from __future__ import annotations

import datetime
import pathlib

import jax

from mesh import topology as topology_lib
from train.planner.search import PlanError
from train.runtime import cpu_peak, probes

ROOT = pathlib.Path(__file__).resolve().parents[2]
SIZES = (128, 256, 512, 1024, 2048, 4096, 8192)


def sweep(dtype: str, max_n: int) -> list[tuple[int, float]]:
    return [(n, probes.measure_matmul_flops(n, dtype=dtype)) for n in SIZES if n <= max_n]


def write(topology: str, path: str, dtype: str) -> pathlib.Path:
    out = pathlib.Path(path).expanduser().resolve()
    if ROOT in out.parents and out.parent.name not in ("experiments", "topologies") and "tmp" not in out.parts:
        raise PlanError(f"--calibrate={path}: write calibrations to a user file outside the package, "
                        f"e.g. ~/.config/spmdtrain/{topology}.json")
    topo = topology_lib.get_topology(topology)
    platform = jax.devices()[0].platform
    measured = sweep(dtype, 8192 if platform != "cpu" else 1024)
    peaks, machine = dict(topo.peak_tflops), 1
    if dtype not in peaks:
        if platform != "cpu":
            raise PlanError(f"--topology={topology}: no peak_tflops for {dtype}; add the datasheet figure first")
        # A CPU has no datasheet peak: the one measured peak MFU uses too (raised if this sweep's sizes the peak is
        # measured at beat it; smaller matmuls take too few microseconds to time), as each virtual device's share;
        # the efficiency curve is a fraction of the whole machine's.
        machine = jax.local_device_count()
        best = max(f for n, f in measured if n >= min(cpu_peak.SIZES))
        peaks[dtype] = cpu_peak.per_device(best / machine) / 1e12
    curve = [[float(n), round(f / (peaks[dtype] * 1e12 * machine), 4)] for n, f in measured]
    # One device streaming alone; virtual CPU devices share the machine's memory bus, so each gets its share.
    hbm = probes.measure_memory_gbps(1 << (30 if platform != "cpu" else 28))
    hbm /= jax.local_device_count() if platform == "cpu" else 1
    topo = topology_lib.dataclasses.replace(topo, peak_tflops=peaks, hbm_gbps=round(hbm, 2),
                                            matmul_efficiency={**topo.matmul_efficiency, dtype: curve})
    provenance = {"command": f"python -m train.plan --calibrate={path} --topology={topology}",
                  "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                  "date": datetime.date.today().isoformat()}
    try:
        topology_lib.save_topology(topo, out, provenance=provenance)
    except OSError as e:
        raise PlanError(f"--calibrate={path}: cannot write there ({e.strerror}); choose a writable file") from None
    return out
