"""Named device mesh with the axes data, pipeline, fsdp, expert, context, tensor (outermost first).

Devices are laid out process-major, so the innermost axes (tensor, then context, expert, fsdp) stay inside one
host's fast domain (NVLink) and the outer ones (data, pipeline) carry the traffic that crosses hosts.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np

from mesh.errors import UserError
from mesh.topology import hybrid_order

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
        raise MeshConfigError(
            f"mesh.{wildcards[0]} and mesh.{wildcards[1]} are both -1; at most one axis may take the remaining devices")
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
