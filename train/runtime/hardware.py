"""What a device can do: peak FLOP/s (for MFU), memory bandwidth (for the planner's calibration) and memory capacity
(for the fits-in-memory check).

GPUs and TPUs: the datasheet table of mesh/chips.py, by device_kind. CPUs: the one measured peak of
train/runtime/cpu_peak.py, since no datasheet describes a virtual device; virtual CPU devices share the machine, so
each gets its share.
"""
from __future__ import annotations

import os
import pathlib
import re
import resource

import jax

import models
from mesh import chips
from train.runtime import cpu_peak

GiB = 1 << 30  # the unit of every memory figure the project prints


def peak_flops_per_device(compute_dtype: str, override_tflops: float = 0.0) -> float:
    """Peak FLOP/s of one device of the default backend, for MFU."""
    if override_tflops > 0:
        return override_tflops * 1e12
    device = jax.devices()[0]
    if device.platform != "cpu":
        return chips.peak_flops(device.device_kind, compute_dtype) or 0.0  # unknown: MFU 0 unless --peak_tflops
    return cpu_peak.per_device()


def peak_is_measured(override_tflops: float = 0.0) -> bool:
    """Whether the MFU peak is the measured CPU one (not a datasheet's or --peak_tflops)."""
    return override_tflops <= 0 and jax.devices()[0].platform == "cpu"


def peak_record(compute_dtype: str, override_tflops: float = 0.0) -> dict:
    """Where the MFU peak comes from, for config.json: FLOP/s per device and its source, so every MFU figure can
    be reproduced."""
    flops = peak_flops_per_device(compute_dtype, override_tflops)
    device = jax.devices()[0]
    if override_tflops > 0:
        return {"flops_per_device": flops, "source": "--peak_tflops"}
    if device.platform != "cpu":
        return {"flops_per_device": flops, "source": f"datasheet ({device.device_kind}, {compute_dtype})"}
    return {"flops_per_device": flops, "source": "measured (train/runtime/cpu_peak.py), shared over "
            f"{jax.local_device_count()} local devices", **cpu_peak.record()}


_CHECKED: list[float] = []  # the machine's measured peak once a run's rate has checked it, in this process


def mfu(flops_per_step: float, seconds: float, peak: float, measured: bool) -> float:
    """Model FLOPs utilization against `peak` (FLOP/s of all devices; 0: unknown). When the peak is the measured
    CPU one (`measured`), the first rate a process sees checks it (cpu_peak.check: measured again when the rate
    shows it off by an order of magnitude, or beats it), and the checked figure is used from then on."""
    if not peak or not seconds:
        return 0.0
    rate = flops_per_step / seconds
    if measured:
        local, total = max(jax.local_device_count(), 1), jax.device_count()
        if not _CHECKED:
            _CHECKED.append(cpu_peak.check(rate * local / total)["flops"])  # this machine's share of the rate
        peak = _CHECKED[0] / local * total
    return rate / peak


def compute_dtype(config) -> str:
    """The dtype the model computes in once its preset and overrides are resolved: what sets the peak
    (a preset's bf16 is not in the raw `model.compute_dtype`, which stays unset)."""
    return models.from_dict(config.model.to_dict()).compute_dtype


def memory_per_device() -> int | None:
    """Bytes one device may use: the allocator's limit on GPUs; on CPUs what the host lets this process use
    (host_memory), shared out over the local devices."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if device.platform == "cpu":
        total = host_memory()
        return None if total is None else total // max(jax.local_device_count(), 1)
    return None


def host_memory() -> int | None:
    """Bytes this process may still allocate on its host: the physical memory, capped by a cgroup's memory limit
    and by the address space `ulimit -v` leaves beyond what the process has mapped already (past it, an
    allocation aborts the process inside XLA)."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = pathlib.Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        limits.append(max(soft - _mapped_bytes(), 0))
    return min(limits) if limits else None


def _mapped_bytes() -> int:
    """This process's address space in use (VmSize), 0 where /proc does not say."""
    try:
        status = pathlib.Path("/proc/self/status").read_text()
    except OSError:
        return 0
    found = re.search(r"^VmSize:\s+(\d+) kB", status, re.M)
    return int(found.group(1)) * 1024 if found else 0
