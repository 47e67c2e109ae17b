"""The one measured CPU peak behind MFU and the planner's calibration: no datasheet describes a CPU, so the machine's
best float32 matmul rate is measured once, over several sizes and repeats so that a busy moment cannot lower it,
and cached per jax version and core count; a run or a calibration that beats it proves the machine faster, so the
peak is re-measured and the higher figure kept, and an MFU can never exceed 100%."""
from __future__ import annotations

import datetime
import json
import os
import pathlib

import jax

from train.runtime import probes

SIZES = (512, 1024, 2048)  # square matmuls: the largest usually wins; the smaller ones guard a slow large run
REPEATS = 5


def cache_file() -> pathlib.Path:
    root = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "spmdtrain"
    return root / "cpu_peak_measured.json"  # not cpu_peak.json, whose entries older versions read as bare numbers


def measure() -> float:
    """The machine's best float32 matmul FLOP/s over SIZES x REPEATS (one device runs it with every core)."""
    return max(probes.measure_matmul_flops(n, REPEATS) for n in SIZES)


def _key() -> str:
    return f"{jax.__version__}:{os.cpu_count()}"


def _read() -> dict:
    try:
        return json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}


def record(at_least: float = 0.0) -> dict:
    """{"flops": machine FLOP/s, "measured": ISO time, "how": ...}: the cached peak, measured when there is none
    or when `at_least` (a rate this machine was seen doing) beats it; the higher figure is kept."""
    cached = _read()
    entry = cached.get(_key())
    if not isinstance(entry, dict) or entry.get("flops", 0.0) < at_least:  # an old cache held a bare number
        flops = max(measure(), at_least)
        entry = {"flops": flops, "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "how": f"best float32 matmul of sizes {list(SIZES)} x {REPEATS} repeats"
                        + (", raised to a rate a run reached" if flops == at_least else "")}
        cached[_key()] = entry
        try:
            cache_file().parent.mkdir(parents=True, exist_ok=True)
            cache_file().write_text(json.dumps(cached, indent=1))
        except OSError:
            pass  # an unwritable cache only costs a new measurement next time
    return entry


def per_device(at_least_per_device: float = 0.0) -> float:
    """One virtual device's share of the machine's peak (the local devices share its cores)."""
    devices = max(jax.local_device_count(), 1)
    return record(at_least_per_device * devices)["flops"] / devices
