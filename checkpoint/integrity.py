"""Checksums of every array of a checkpoint, computed on the devices that hold the arrays.

Orbax's compressed chunks can decode to wrong values without an error, so a restore is trusted only
when each array's checksum matches the one written with it. A checksum is two wrapping uint32 sums
over the elements' bit patterns, mixed with each element's global position: any flipped or moved
element changes it, and it depends neither on the sharding nor on the order of the reduction, so a
checkpoint written on one mesh verifies on another.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from checkpoint import plain

_U32 = jnp.uint32


def _words(x: jax.Array) -> jax.Array:
    """The bit pattern of `x` as uint32 words (8-byte elements become a trailing pair)."""
    if x.dtype == jnp.bool_:
        return x.astype(_U32)
    size = jnp.dtype(x.dtype).itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, _U32)
    if size in (1, 2):
        return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(_U32)
    assert size == 8, f"unsupported dtype {x.dtype}"
    return jax.lax.bitcast_convert_type(x, _U32)


def _position(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major flat index (mod 2**32), built from iotas so no data moves."""
    index = jnp.zeros(shape, _U32)
    stride = 1
    for dim in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(_U32, shape, dim) * _U32(stride & 0xFFFFFFFF)
        stride *= shape[dim]
    return index


def _mix(h: jax.Array) -> jax.Array:
    """A murmur3-style finalizer: every input bit flips about half of the output bits."""
    h = h ^ (h >> 16)
    h = h * _U32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * _U32(0xC2B2AE35)
    return h ^ (h >> 16)


def _checksum(x: jax.Array) -> jax.Array:
    words = _words(x)
    pos = _position(words.shape)
    weighted = jnp.sum(words * (pos * _U32(2) + _U32(1)), dtype=_U32)
    mixed = jnp.sum(_mix(words ^ _mix(pos + _U32(0x9E3779B9))), dtype=_U32)
    return jnp.stack([weighted, mixed])


@functools.lru_cache(maxsize=8)
def _compiled(replicated: jax.sharding.Sharding | None):
    return jax.jit(lambda leaves: jnp.stack([_checksum(x) for x in leaves]), out_shardings=replicated)


def _replicated(leaves: list[jax.Array]) -> jax.sharding.Sharding | None:
    for x in leaves:
        if isinstance(x.sharding, jax.sharding.NamedSharding):
            return jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec())
    return None


def device_checksums(tree: Any) -> tuple[list[str], jax.Array | None]:
    """(paths, uint32[n, 2]) with the checksums still being computed on the devices (no wait)."""
    flat = plain.flatten(tree)
    leaves = [jnp.asarray(x) for x in flat.values()]
    if not leaves:
        return [], None
    return list(flat), _compiled(_replicated(leaves))(leaves)


def to_hex(names: list[str], sums: jax.Array | None) -> dict[str, str]:
    """{path: 16 hex digits}; blocks until the device computation is done."""
    if sums is None:
        return {}
    values = np.asarray(jax.device_get(sums))
    return {name: f"{int(a):08x}{int(b):08x}" for name, (a, b) in zip(names, values)}


def checksums(tree: Any) -> dict[str, str]:
    return to_hex(*device_checksums(tree))


def mismatches(tree: Any, expected: dict[str, str]) -> list[str]:
    """Paths of `tree` whose checksum differs from `expected` (or that `expected` does not list)."""
    return [name for name, value in checksums(tree).items() if expected.get(name) != value]
