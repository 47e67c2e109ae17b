"""Micro-benchmarks of the first device: a square matmul's FLOP/s and a streaming read's bandwidth, each the best of
several repeats (what the CPU peak, MFU and the planner's calibration are made of)."""
from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp


def _best_seconds(f: Callable[[jax.Array], jax.Array], x: jax.Array, repeats: int) -> float:
    """The fastest of `repeats` timed calls of jitted `f` on `x`, after one untimed call that compiles it."""
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


def measure_matmul_flops(n: int = 2048, repeats: int = 5, dtype: str = "float32") -> float:
    """FLOP/s of an n x n matmul in `dtype` on the first device, best of `repeats`."""
    x = jnp.ones((n, n), jnp.dtype(dtype), device=jax.devices()[0])
    return 2.0 * n ** 3 / _best_seconds(jax.jit(lambda a: a @ a), x, repeats)


def measure_memory_gbps(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """GB/s one device reads from its memory: a sum over a float32 array of `nbytes` (well past the caches), best
    of `repeats`. A read, not a copy: a copy's fresh output buffer costs page faults on CPU, not bandwidth."""
    x = jnp.ones((nbytes // 4,), jnp.float32, device=jax.devices()[0])
    return nbytes / _best_seconds(jax.jit(jnp.sum), x, repeats) / 1e9
