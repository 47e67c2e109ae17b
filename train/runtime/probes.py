"""Micro-benchmarks of the devices: a square matmul's FLOP/s and a streaming read's bandwidth, each the best of
several repeats (what the CPU peak, MFU and the planner's calibration are made of), run on one device this process
owns (in a multi-process run the first global device may be another process's) or on every local device at once
(virtual CPU devices share the machine, so only that shows what a step gets)."""
from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mesh import make_mesh


def best_seconds(f: Callable[[jax.Array], Any], x: jax.Array, repeats: int) -> float:
    """The fastest of `repeats` timed calls of jitted `f` on `x` (any tree of arrays out), after one untimed call
    that compiles it."""
    jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - t)
    return best


def _ones(shape: tuple[int, ...], dtype: str, every_device: bool, device: jax.Device | None = None) -> jax.Array:
    """Ones of `shape` on `device` (default: this process's first), or one such array per local device stacked on a
    leading axis that the devices split (each works on its own copy, all at once)."""
    if not every_device:
        return jnp.ones(shape, jnp.dtype(dtype), device=device or jax.local_devices()[0])
    k = jax.local_device_count()
    mesh = make_mesh({"data": k}, devices=jax.local_devices())
    return jax.device_put(jnp.ones((k, *shape), jnp.dtype(dtype)), NamedSharding(mesh, P("data")))


def measure_matmul_flops(n: int = 2048, repeats: int = 5, dtype: str = "float32", every_device: bool = False,
                         device: jax.Device | None = None) -> float:
    """FLOP/s of an n x n matmul in `dtype` on `device` (default: this process's first), or of one per local device
    at once (their sum), best of `repeats`."""
    x = _ones((n, n), dtype, every_device, device)
    return 2.0 * n ** 3 * (x.size // (n * n)) / best_seconds(jax.jit(lambda a: a @ a), x, repeats)


def measure_memory_gbps(nbytes: int = 1 << 28, repeats: int = 5, every_device: bool = False) -> float:
    """GB/s read from memory: a sum over a float32 array of `nbytes` (well past the caches) on this process's first
    device, or `nbytes` split over every local device at once (their sum), best of `repeats`. A read, not a copy: a
    copy's fresh output buffer costs page faults on CPU, not bandwidth."""
    k = jax.local_device_count() if every_device else 1
    x = _ones((nbytes // (4 * k),), "float32", every_device)
    return nbytes / best_seconds(jax.jit(lambda a: jnp.sum(a, axis=-1)), x, repeats) / 1e9
