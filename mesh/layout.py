"""Named device mesh with the axes data, pipeline, fsdp, expert, context, tensor (outermost first), and the
device order: devices are laid out process-major (hybrid across hosts), so the innermost axes (tensor, then
context, expert, fsdp) stay inside one host's fast domain (NVLink) and the outer ones cross hosts."""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np

from mesh.errors import UserError
from mesh.topology import Topology

AXES: tuple[str, ...] = ("data", "pipeline", "fsdp", "expert", "context", "tensor")


class MeshConfigError(UserError):
    """A mesh setting the user can fix; the message is one line naming the setting."""


def use_cpu_devices(n: int) -> None:
    """Ask for `n` virtual CPU devices; must run before JAX initializes a backend.

    Harmless on GPU machines: it only shapes the CPU backend, which the default backend shadows.
    """
    if n < 1:
        raise MeshConfigError(f"--num_cpu_devices={n}: need at least 1 device")
    jax.config.update("jax_num_cpu_devices", int(n))


def resolve_axis_sizes(sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Fill in defaults (1) and the one `-1` axis; check that the sizes multiply to `num_devices`."""
    unknown = sorted(set(sizes) - set(AXES))
    if unknown:
        raise MeshConfigError(f"mesh.{unknown[0]}: unknown mesh axis; use one of {', '.join(AXES)}")
    full = {axis: int(sizes.get(axis, 1)) for axis in AXES}
    wildcards = [axis for axis, size in full.items() if size == -1]
    if len(wildcards) > 1:
        raise MeshConfigError(f"mesh.{wildcards[0]} and mesh.{wildcards[1]} are both -1; at most one axis may take "
                              "the remaining devices")
    for axis, size in full.items():
        if size == 0 or size < -1:
            raise MeshConfigError(f"mesh.{axis}={size}: axis sizes must be positive (or -1 for the remaining devices)")
    fixed = math.prod(size for size in full.values() if size != -1)
    if wildcards:
        if num_devices % fixed:
            raise MeshConfigError(
                                  f"mesh.{wildcards[0]}=-1: the other axes multiply to {fixed}, which does not divide "
                                  f"{num_devices} devices; change the axis sizes")
        full[wildcards[0]] = num_devices // fixed
    elif fixed != num_devices:
        desc = "x".join(f"{a}={s}" for a, s in full.items() if s != 1) or "all axes 1"
        raise MeshConfigError(
                              f"mesh: {desc} needs {fixed} devices but {num_devices} are available; "
                              f"change the mesh.* sizes (or set one to -1)")
    return full


def make_mesh(sizes: Mapping[str, int], num_devices: int | None = None,
              devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """Mesh over `devices` (default: the first `num_devices` of all devices, default all of them).

    All six axes are always present (size 1 when unused) so partition specs read the same on every
    layout; all axes are `Auto`, so XLA propagates shardings between the constraints we give it.
    """
    if devices is None:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        if num_devices is not None:
            if not 1 <= num_devices <= len(devices):
                raise MeshConfigError(f"num_devices={num_devices}: only {len(devices)} devices are available")
            devices = devices[:num_devices]
        shape = resolve_axis_sizes(sizes, len(devices))
        per_host = jax.local_device_count()
        if jax.process_count() > 1 and len(devices) % per_host == 0:
            # Several hosts: inner axes inside a host, what does not fit spans hosts evenly.
            devices = [devices[i] for i in hybrid_order(shape, per_host, "these processes")]
    shape = resolve_axis_sizes(sizes, len(devices))
    grid = np.asarray(devices, dtype=object).reshape([shape[a] for a in AXES])
    return jax.sharding.Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def axis_sizes(mesh: jax.sharding.Mesh) -> dict[str, int]:
    """{axis: size} of a mesh, in mesh order."""
    return dict(zip(mesh.axis_names, mesh.devices.shape))


def hybrid_device_order(sizes: Mapping[str, int], topology: Topology) -> list[int]:
    """`hybrid_order` for the hosts of `topology`."""
    return hybrid_order(sizes, topology.devices_per_host, topology.name)


def hybrid_order(sizes: Mapping[str, int], dph: int, where: str = "this cluster") -> list[int]:
    """Physical device index for each mesh position (row-major), intra-host x inter-host, for hosts of
    `dph` devices (devices numbered host-major).

    Filling from the innermost axis outwards, each axis takes the largest factor of its size that still
    fits in the host (gcd with the room left); what remains of every axis spans hosts. A mesh position
    is (outer coordinates, inner coordinates); the inner ones index a device inside a host, the outer ones
    a host, so inner factors never leave a host and outer factors split evenly across hosts.
    """
    names = list(sizes)
    n = math.prod(sizes.values())
    if n <= dph:
        return list(range(n))
    if n % dph:
        raise MeshConfigError(f"mesh of {n} devices does not fill whole hosts of {dph} on {where}; "
                              f"use a multiple of {dph} devices")
    room, inner = dph, {}
    for a in reversed(names):
        inner[a] = math.gcd(sizes[a], room)
        room //= inner[a]
    inner_size = dph // room  # devices of one host a mesh fills; room > 1 leaves hosts shared by outer blocks
    order = []
    for pos in np.ndindex(*[sizes[a] for a in names]):
        outer_idx, inner_idx = 0, 0
        for a, c in zip(names, pos):
            outer_idx = outer_idx * (sizes[a] // inner[a]) + c // inner[a]
            inner_idx = inner_idx * inner[a] + c % inner[a]
        order.append((outer_idx // room) * dph + (outer_idx % room) * inner_size + inner_idx)
    return order


def hybrid_devices(sizes: Mapping[str, int], topology: Topology, devices=None) -> list:
    """Devices in hybrid order, for `make_mesh(sizes, devices=...)` (sizes in mesh order)."""
    if devices is None:
        devices = jax.devices()
    physical = sorted(devices, key=lambda d: (d.process_index, d.id))
    order = hybrid_device_order(sizes, topology)
    if len(order) > len(physical):
        raise MeshConfigError(f"mesh needs {len(order)} devices but {len(physical)} are available")
    return [physical[i] for i in order]
