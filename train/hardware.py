"""What a device can do: peak FLOP/s (for MFU) and memory capacity (for the fits-in-memory check).

GPUs: dense peak from the vendors' datasheets. CPUs: a large matmul measured once and cached, since
no datasheet describes a virtual device; virtual CPU devices share the machine, so each gets its share.
"""
from __future__ import annotations

import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp

# Dense (no sparsity) peak TFLOP/s per GPU: (bf16/fp16 tensor core, fp32 without TF32).
# H100/H200 SXM: NVIDIA H100 datasheet (989 bf16, 67 fp32); H200 shares the H100 compute die.
# A100 SXM: NVIDIA A100 datasheet (312 bf16, 19.5 fp32). L40S: datasheet (362 bf16, 91.6 fp32).
# B200: NVIDIA DGX B200 datasheet, 72 PFLOPs dense FP8 per 8 GPUs -> 2250 bf16 dense per GPU; fp32 75.
GPU_PEAK_TFLOPS = {
    "H200": (989.0, 67.0), "H100": (989.0, 67.0), "A100": (312.0, 19.5),
    "L40S": (362.0, 91.6), "B200": (2250.0, 75.0),
}


def _cache_file() -> pathlib.Path:
    root = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "spmdtrain"
    return root / "cpu_peak.json"


def measure_matmul_flops(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an n x n float32 matmul on the first device, best of `repeats`."""
    x = jnp.ones((n, n), jnp.float32, device=jax.devices()[0])
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


def peak_flops_per_device(compute_dtype: str, override_tflops: float = 0.0) -> float:
    """Peak FLOP/s of one device of the default backend, for MFU."""
    if override_tflops > 0:
        return override_tflops * 1e12
    device = jax.devices()[0]
    if device.platform == "gpu":
        for name, (half, single) in GPU_PEAK_TFLOPS.items():
            if name in device.device_kind:
                return (half if compute_dtype in ("bfloat16", "float16") else single) * 1e12
        return 0.0  # unknown GPU: MFU is reported as 0 unless --peak_tflops is given
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
