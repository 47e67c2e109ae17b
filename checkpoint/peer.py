"""The local tier's copy on a neighbour: process i also keeps process (i+1) % n's local step, moved once per save
by a ring collective-permute over every device (NCCL on GPUs, gloo on CPU), each device carrying 1/d of a blob,
so the local steps of one lost node survive on another and come back to its replacement the same way."""
from __future__ import annotations

import functools
import json
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mesh.numbers import ceil_div

AXES = ("process", "device")
_HEADER = 8  # bytes: the length of the JSON header that leads a packed blob


def ring_mesh() -> jax.sharding.Mesh:
    """Every device, one row per process (each process's devices in id order)."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.asarray(devices, dtype=object).reshape(jax.process_count(), -1)
    return jax.sharding.Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


@functools.lru_cache(maxsize=4)
def _shift(mesh: jax.sharding.Mesh, toward: int):
    """A program in which row p receives row (p + toward) % n's data: process p gets process p+toward's blob."""
    n = mesh.shape["process"]
    pairs = [(source, (source - toward) % n) for source in range(n)]
    spec = P(*AXES)
    moved = jax.shard_map(lambda x: jax.lax.ppermute(x, "process", pairs), mesh=mesh, in_specs=spec,
                          out_specs=spec, check_vma=False)
    return jax.jit(moved, out_shardings=NamedSharding(mesh, spec))


def pack(header: dict[str, Any], chunks: list[np.ndarray]) -> np.ndarray:
    """One uint8 blob: the header's length, the header (JSON), then every chunk's bytes."""
    text = json.dumps(header).encode()
    parts = [np.frombuffer(len(text).to_bytes(_HEADER, "little"), np.uint8), np.frombuffer(text, np.uint8)]
    parts += [np.ascontiguousarray(c).reshape(-1).view(np.uint8) for c in chunks]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def unpack(blob: np.ndarray) -> tuple[dict[str, Any], np.ndarray]:
    """(header, the bytes after it); an empty blob (nothing sent) gives ({}, empty)."""
    if blob.size < _HEADER:
        return {}, blob[:0]
    length = int.from_bytes(blob[:_HEADER].tobytes(), "little")
    return json.loads(blob[_HEADER:_HEADER + length].tobytes()), blob[_HEADER + length:]


def send(blob: np.ndarray, toward: int) -> tuple[jax.Array, int]:
    """Dispatch the ring move of every process's `blob` (collective: every process calls it in the same order);
    process p will receive process (p + toward)'s. Returns (the moved array, not waited for; the padded length)."""
    from jax.experimental import multihost_utils
    mesh = ring_mesh()
    d = mesh.shape["device"]
    longest = int(np.max(multihost_utils.process_allgather(np.int64(blob.size))))
    width = ceil_div(max(longest, 1), d)
    padded = np.zeros(width * d, np.uint8)
    padded[:blob.size] = blob
    row = jax.process_index()
    pieces = [jax.device_put(padded[k * width:(k + 1) * width].reshape(1, 1, width), device)
              for k, device in enumerate(mesh.devices[row])]
    sharding = NamedSharding(mesh, P(*AXES))
    global_blob = jax.make_array_from_single_device_arrays((mesh.shape["process"], d, width), sharding, pieces)
    return _shift(mesh, toward)(global_blob), width * d


def received(moved: jax.Array) -> np.ndarray:
    """This process's part of a moved array, in device order: the blob it was sent, zero padded."""
    shards = sorted(moved.addressable_shards, key=lambda s: s.index[1].start or 0)
    return np.concatenate([np.asarray(s.data).reshape(-1) for s in shards])
