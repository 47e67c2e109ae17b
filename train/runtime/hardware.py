"""What a device can do: peak FLOP/s (for MFU), memory bandwidth (for the planner's calibration) and memory capacity
(for the fits-in-memory check).

GPUs and TPUs: the datasheet table of mesh/chips.py, by device_kind. CPUs: a large matmul measured once
and cached, since no datasheet describes a virtual device; virtual CPU devices share the machine, so each
gets its share.
"""
from __future__ import annotations

import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp

import models
from mesh import chips

GiB = 1 << 30  # the unit of every memory figure the project prints


def _cache_file() -> pathlib.Path:
    root = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "spmdtrain"
    return root / "cpu_peak.json"


def measure_matmul_flops(n: int = 2048, repeats: int = 5, dtype: str = "float32") -> float:
    """FLOP/s of an n x n matmul in `dtype` on the first device, best of `repeats`."""
    x = jnp.ones((n, n), jnp.dtype(dtype), device=jax.devices()[0])
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


def measure_memory_gbps(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """GB/s one device reads from its memory: a sum over a float32 array of `nbytes` (well past the caches), best
    of `repeats`. A read, not a copy: a copy's fresh output buffer costs page faults on CPU, not bandwidth."""
    x = jnp.ones((nbytes // 4,), jnp.float32, device=jax.devices()[0])
    f = jax.jit(jnp.sum)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def peak_flops_per_device(compute_dtype: str, override_tflops: float = 0.0) -> float:
    """Peak FLOP/s of one device of the default backend, for MFU."""
    if override_tflops > 0:
        return override_tflops * 1e12
    device = jax.devices()[0]
    if device.platform != "cpu":
        return chips.peak_flops(device.device_kind, compute_dtype) or 0.0  # unknown: MFU 0 unless --peak_tflops
    cache = _cache_file()
    key = f"{jax.__version__}:{os.cpu_count()}"
    try:
        cached = json.loads(cache.read_text())
    except (OSError, ValueError):
        cached = {}
    machine = cached.get(key)
    if machine is None:
        machine = measure_matmul_flops()
        cached[key] = machine
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(cached))
    return machine / max(jax.local_device_count(), 1)


def compute_dtype(config) -> str:
    """The dtype the model computes in once its preset and overrides are resolved: what sets the peak
    (a preset's bf16 is not in the raw `model.compute_dtype`, which stays unset)."""
    return models.from_dict(config.model.to_dict()).compute_dtype


def memory_per_device() -> int | None:
    """Bytes one device may use: the allocator's limit on GPUs; RAM shared out on CPUs."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if device.platform == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
        return total // max(jax.local_device_count(), 1)
    return None
