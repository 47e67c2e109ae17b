"""Collectives over named mesh axes, for use inside `jax.shard_map`: thin wrappers over `jax.lax`, and
reference algorithms built from `ppermute` alone (ring, recursive halving-doubling, two-level
hierarchical) that show what the bus-bandwidth factors of `mesh.cost` count.

Every function takes the per-device block `x` and an axis name (or a tuple of names, treated as one
flattened axis in mesh order). Tiled semantics throughout: gathers concatenate and scatters split
along `dim`, as `lax.all_gather(..., tiled=True)` and `lax.psum_scatter(..., tiled=True)` do.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from mesh.layout import axis_sizes
from mesh.numbers import ceil_div

_REDUCERS = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}


# ----------------------------------------------------------------------------- thin wrappers

def all_reduce(x, axis, op: str = "sum"):
    """Every device gets the reduction (sum, max or min) of `x` over `axis`; S = size of x."""
    if op not in _REDUCERS:
        raise ValueError(f"op={op!r}: unknown reduction; use one of {', '.join(_REDUCERS)}")
    return _REDUCERS[op](x, axis)


def all_gather(x, axis, dim: int = 0):
    """Concatenate the blocks of `axis` along `dim` (result n times larger); S = size of the result."""
    return lax.all_gather(x, axis, axis=dim, tiled=True)


def reduce_scatter(x, axis, dim: int = 0):
    """Sum over `axis`, then device i keeps the i-th of n slices along `dim`; S = size of x."""
    return lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)


def all_to_all(x, axis, split_dim: int = 0, concat_dim: int = 0):
    """Split `x` in n slices along `split_dim`, send slice j to device j, concatenate what arrives along
    `concat_dim` (resharding one dimension into another); S = size of x."""
    return lax.all_to_all(x, axis, split_dim, concat_dim, tiled=True)


def permute(x, axis, shift: int = 1):
    """Device i sends `x` to device (i + shift) mod n along `axis` (pipeline stages, ring steps); S = size of x."""
    n = lax.axis_size(axis)
    return lax.ppermute(x, axis, perm=[(i, (i + shift) % n) for i in range(n)])


# ----------------------------------------------------------------------------- reference algorithms

def _varying(x, axis):
    """Mark `x` as varying over `axis` so per-device values can flow through ppermute and carries."""
    names = axis if isinstance(axis, tuple) else (axis,)
    aval = jax.typeof(x)
    vma = aval.vma if hasattr(aval, "vma") else aval.mat.varying  # the attribute moved between jax releases
    missing = tuple(a for a in names if a not in vma)
    return lax.pcast(x, missing, to="varying") if missing else x


def _chunks(x, n):
    """Flatten and zero-pad `x` to [n, c]: row i is the slice device i owns after a reduce-scatter."""
    flat = x.reshape(-1)
    c = ceil_div(flat.size, n)
    return jnp.pad(flat, (0, n * c - flat.size)).reshape(n, c)


def _take(rows, i):
    return lax.dynamic_index_in_dim(rows, i, axis=0, keepdims=False)


def ring_reduce_scatter(x, axis):
    """n-1 steps; at step s device i receives from i-1 the partial sum of chunk (i-2-s) mod n, adds its
    own and passes it on, so after n-1 steps it holds the full sum of chunk i. Each step moves S/n:
    bus traffic (n-1)/n S. Returns the flat chunk [ceil(size/n)] (zero-padded)."""
    x = _varying(x, axis)
    n, i = lax.axis_size(axis), lax.axis_index(axis)
    rows = _chunks(x, n)
    acc = _take(rows, (i - 1) % n)
    for s in range(n - 1):
        acc = permute(acc, axis, 1) + _take(rows, (i - 2 - s) % n)
    return acc


def ring_all_gather(chunk, axis):
    """n-1 steps passing chunks around the ring: after step s device i holds chunk (i-1-s) mod n as
    well. Each step moves S/n: bus traffic (n-1)/n S. Returns [n, *chunk.shape]."""
    chunk = _varying(chunk, axis)
    n, i = lax.axis_size(axis), lax.axis_index(axis)
    out = jnp.zeros((n,) + chunk.shape, chunk.dtype)
    out = lax.dynamic_update_index_in_dim(out, chunk, i, axis=0)
    cur = chunk
    for s in range(n - 1):
        cur = permute(cur, axis, 1)
        out = lax.dynamic_update_index_in_dim(out, cur, (i - 1 - s) % n, axis=0)
    return out


def ring_all_reduce(x, axis):
    """Ring all-reduce = ring reduce-scatter then ring all-gather: 2(n-1) steps of S/n, bus traffic
    2(n-1)/n S, the bandwidth-optimal schedule NCCL uses for large messages. Equals `lax.psum(x, axis)`."""
    n = lax.axis_size(axis)
    if n == 1:
        return x
    full = ring_all_gather(ring_reduce_scatter(x, axis), axis)
    return full.reshape(-1)[: x.size].reshape(x.shape)


def halving_doubling_all_reduce(x, axis):
    """Recursive halving then doubling (Rabenseifner) for power-of-two n, the hypercube algorithm.

    Halving: for d = n/2, n/4, ..., 1 exchange with partner i XOR d; the device whose bit d is 0 keeps
    the lower half of its buffer and adds the partner's lower half (the other keeps the upper half).
    After log2 n steps device i holds the full sum of chunk i. Doubling replays the partners in reverse
    (d = 1, 2, ..., n/2), concatenating. 2 log2 n steps (vs 2(n-1) for the ring), same bus traffic
    2(n-1)/n S. Equals `lax.psum(x, axis)`.
    """
    n = lax.axis_size(axis)
    if n & (n - 1):
        raise ValueError(f"halving_doubling_all_reduce: axis {axis} has size {n}, not a power of two; "
                         f"use ring_all_reduce")
    if n == 1:
        return x
    x = _varying(x, axis)
    i = lax.axis_index(axis)
    buf = _chunks(x, n).reshape(-1)
    d = n // 2
    while d >= 1:
        half = buf.size // 2
        lo, hi = buf[:half], buf[half:]
        upper = (i // d) % 2 == 1
        keep, send = jnp.where(upper, hi, lo), jnp.where(upper, lo, hi)
        buf = keep + lax.ppermute(send, axis, perm=[(j, j ^ d) for j in range(n)])
        d //= 2
    d = 1
    while d < n:
        upper = (i // d) % 2 == 1
        other = lax.ppermute(buf, axis, perm=[(j, j ^ d) for j in range(n)])
        buf = jnp.where(upper, jnp.concatenate([other, buf]), jnp.concatenate([buf, other]))
        d *= 2
    return buf[: x.size].reshape(x.shape)


def hierarchical_all_reduce(x, inner, outer):
    """Two-level all-reduce: ring reduce-scatter over `inner` (inside a host), ring all-reduce of the
    1/n_inner slice over `outer` (across hosts), ring all-gather over `inner`. The slow outer links carry
    only 2(n_o-1)/n_o x S/n_i per device. Equals `lax.psum(x, (outer, inner))`."""
    n_inner = lax.axis_size(inner)
    x = _varying(x, (inner, outer) if isinstance(inner, str) else tuple(inner) + (outer,))
    part = ring_reduce_scatter(x, inner) if n_inner > 1 else x.reshape(-1)
    part = ring_all_reduce(part, outer)
    full = ring_all_gather(part, inner).reshape(-1) if n_inner > 1 else part
    return full[: x.size].reshape(x.shape)


def reference(name: str):
    """The reference algorithm called `name` (ring_all_reduce, halving_doubling_all_reduce, ...)."""
    table = {f.__name__: f for f in (ring_reduce_scatter, ring_all_gather, ring_all_reduce,
                                     halving_doubling_all_reduce, hierarchical_all_reduce)}
    if name not in table:
        raise ValueError(f"reference={name!r}: unknown; use one of {', '.join(table)}")
    return table[name]


def group_size(mesh, axis) -> int:
    """Size of the (possibly multi-axis) group `axis` on `mesh`, outside shard_map."""
    names = axis if isinstance(axis, tuple) else (axis,)
    return math.prod(axis_sizes(mesh)[a] for a in names)
