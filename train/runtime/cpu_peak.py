"""The one measured CPU peak behind MFU and the planner's calibration. No datasheet describes a CPU, so the machine's
best float32 matmul rate is measured on a device this process owns, once per machine and jax version: the first
process to need it measures while the others wait for its figure (a file lock), and all read it from the cache.

A cached figure is refused, and measured again, when no machine of this many cores could reach it (BOUND_PER_CORE)
or when a run's own rate shows it off by more than MAX_RATIO in either direction (`check`). A run's rate is never
stored as the peak: only measurements are. `python -m train.plan --measure_peak` measures again on request."""
from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import socket
import time

import filelock
import jax

from train.runtime import probes

SIZES = (512, 1024, 2048)  # square matmuls: the largest usually wins; the smaller ones guard a slow large run
REPEATS = 5
# float32 FLOP/s no core reaches: two AVX-512 FMA units do 64 FLOP a cycle, 0.38e12 at 6 GHz; 1e12 leaves room for
# wider cores, and refuses a figure off by an order of magnitude on any machine of today.
BOUND_PER_CORE = 1e12
MAX_RATIO = 10.0  # a run's rate this far from the peak, either way, shows the peak wrong
WAIT_S = 120.0    # how long a process waits for another's measurement before it measures on its own
QUICK_SIZE = 1024  # the probe that confirms a low run rate before a full measurement


def cache_file() -> pathlib.Path:
    """SPMDTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/spmdtrain (~/.cache/spmdtrain)."""
    root = os.environ.get("SPMDTRAIN_CACHE_DIR") or pathlib.Path(
        os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "spmdtrain"
    return pathlib.Path(root) / "cpu_peak_measured.json"  # not cpu_peak.json, which older versions wrote


def cores() -> int:
    return os.cpu_count() or 1


def bound() -> float:
    """The most float32 FLOP/s this machine could do: BOUND_PER_CORE x its cores."""
    return BOUND_PER_CORE * cores()


def _key() -> str:
    return f"{jax.__version__}:{cores()}:{socket.gethostname()}"


def _read() -> dict:
    try:
        cached = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def refusal(entry) -> str | None:
    """Why a cached entry cannot be the peak, or None when it can."""
    flops = entry.get("flops") if isinstance(entry, dict) else None
    if not isinstance(flops, (int, float)) or not math.isfinite(flops) or flops <= 0:
        return "no figure cached"
    if flops > bound():
        return (f"the cached {flops:.3g} FLOP/s is above what {cores()} cores can do ({bound():.3g}: "
                f"{BOUND_PER_CORE:.0e} per core)")
    return None


def measure() -> tuple[float, str]:
    """(the best float32 matmul FLOP/s over SIZES x REPEATS on this process's first device, which device)."""
    device = jax.local_devices()[0]
    flops = max(probes.measure_matmul_flops(n, REPEATS, device=device) for n in SIZES)
    return flops, f"{device.platform}:{device.id} of process {jax.process_index()}"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _measured_entry(why: str) -> dict:
    flops, device = measure()
    if flops > bound():  # a timer that lied: keep the machine's bound rather than an impossible figure
        flops, why = bound(), f"{why}; the measurement read {flops:.3g}, above the bound, so the bound is kept"
    return {"flops": flops, "measured": _now(), "measured_unix": time.time(), "device": device, "why": why,
            "how": f"best float32 matmul of sizes {list(SIZES)} x {REPEATS} repeats", "cores": cores(),
            "bound": bound(), "jax": jax.__version__, "host": socket.gethostname()}


def _write(entry: dict) -> None:
    """Store `entry` under this machine's key (a temporary file renamed over the cache: readers see a whole file)."""
    path = cache_file()
    cached = _read()
    cached[_key()] = entry
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # an unwritable cache only costs a new measurement next time


def record(remeasure: str | None = None) -> dict:
    """The cached peak entry ({"flops", "measured", "how", "why", "device", ...}), measured when none is cached, when
    the cached one is refused, or when `remeasure` says why a new one is needed. One process measures at a time;
    a process that waited takes a figure measured after it asked rather than measuring again."""
    asked = time.time()
    entry = _read().get(_key())
    why = remeasure or refusal(entry)
    if why is None:
        return entry
    try:
        cache_file().parent.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(str(cache_file()) + ".lock", timeout=WAIT_S)
        with lock:
            entry = _read().get(_key())
            if refusal(entry) is None and (remeasure is None or entry.get("measured_unix", 0) >= asked):
                return entry
            entry = _measured_entry(why)
            _write(entry)
            return entry
    except filelock.Timeout:
        why += f"; another process held the lock over {WAIT_S:.0f} s, so this one measured on its own"
    except OSError as e:
        why += f"; the cache is not writable ({e.strerror})"
    entry = _measured_entry(why)
    _write(entry)
    return entry


def per_device() -> float:
    """One local device's share of the machine's peak (the local devices share its cores)."""
    return record()["flops"] / max(jax.local_device_count(), 1)


def check(rate: float) -> dict:
    """The peak entry after a run reached `rate` FLOP/s on the whole machine: measured again when the rate is above
    the peak (an MFU over 100%) or below a MAX_RATIO-th of it and a quick matmul on this process's device confirms
    the machine slower than the peak (small models legitimately run far below it)."""
    entry = record()
    peak = entry["flops"]
    if rate > peak:
        return record(f"a run reached {rate:.3g} FLOP/s, above the cached {peak:.3g}")
    if rate * MAX_RATIO < peak:
        quick = probes.measure_matmul_flops(QUICK_SIZE, 3, device=jax.local_devices()[0])
        if quick * MAX_RATIO < peak:
            return record(f"a run reached {rate:.3g} FLOP/s and a {QUICK_SIZE} matmul {quick:.3g}, both under a "
                          f"{MAX_RATIO:g}th of the cached {peak:.3g}")
    return entry


def describe(entry: dict) -> str:
    """Where the figure came from, for the plan's table and the console."""
    return (f"measured {entry.get('measured', '?')} on {entry.get('device', '?')} ({entry.get('how', '?')}; "
            f"{cache_file()})")
