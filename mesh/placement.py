"""Where the groups of a collective over some mesh axes sit on a topology: hosts spanned, members per host,
groups sharing a host's links, and warnings for axes that leave a host. Audit part (where each mesh axis's
traffic travels); train/plan/audit.py maps the parts of `--audit`."""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Mapping, Sequence

import numpy as np

from mesh.layout import axis_sizes
from mesh.topology import Topology, TopologyError


def _sizes_and_order(mesh_or_sizes, device_order):
    """({axis: size} in mesh order, physical device index of each mesh position)."""
    if isinstance(mesh_or_sizes, Mapping):
        sizes = {a: int(s) for a, s in mesh_or_sizes.items()}
        n = math.prod(sizes.values())
        order = np.arange(n) if device_order is None else np.asarray(device_order)
    else:  # a jax Mesh: physical index = rank of (process_index, id), i.e. process-major
        mesh = mesh_or_sizes
        sizes = axis_sizes(mesh)
        flat = list(mesh.devices.flat)
        rank = {k: i for i, k in enumerate(sorted((d.process_index, d.id) for d in flat))}
        order = (np.array([rank[(d.process_index, d.id)] for d in flat]) if device_order is None
                 else np.asarray(device_order))
    assert sorted(order.tolist()) == list(range(len(order))), "device_order must be a permutation"
    return sizes, order


@dataclasses.dataclass(frozen=True)
class Placement:
    """How the groups of a collective over `axes` land on hosts.

    group_size: devices per group; num_groups; hosts: max hosts one group spans; members_per_host: max
    members of one group on one host; crossing_groups_per_host: max number of host-crossing groups with a
    member on the same host (they share its NICs); even: every group has the same number of members on
    every host it touches; local: the members' positions inside their hosts (for torus dims).
    """
    axes: tuple[str, ...]
    group_size: int
    num_groups: int
    hosts: int
    members_per_host: int
    crossing_groups_per_host: int
    even: bool
    level: str
    local_dims_spanned: int = 0


def groups_of(sizes: Mapping[str, int], axes: Sequence[str]) -> np.ndarray:
    """[num_groups, group_size] mesh positions (row-major) of the groups of a collective over `axes`."""
    names = list(sizes)
    missing = [a for a in axes if a not in sizes]
    if missing:
        raise ValueError(f"axis {missing[0]}: not a mesh axis; the mesh has {', '.join(names)}")
    shape = [sizes[a] for a in names]
    pos = np.arange(math.prod(shape)).reshape(shape)
    keep = [names.index(a) for a in names if a not in axes]
    moved = np.transpose(pos, keep + [names.index(a) for a in names if a in axes])
    group = math.prod(sizes[a] for a in axes)
    return moved.reshape(-1, group)


def placement(mesh_or_sizes, axes: Sequence[str], topology: Topology, device_order=None) -> Placement:
    """Where the groups of a collective over `axes` sit on `topology` (device i on host i // devices_per_host)."""
    sizes, order = _sizes_and_order(mesh_or_sizes, device_order)
    axes = tuple(a for a in sizes if a in axes) if all(a in sizes for a in axes) else tuple(axes)
    if len(order) > topology.num_devices:
        raise TopologyError(f"topology {topology.name} has {topology.num_devices} devices but the mesh needs "
                            f"{len(order)}; raise --hosts to {math.ceil(len(order) / topology.devices_per_host)}")
    groups = groups_of(sizes, axes)
    phys = order[groups]
    host = phys // topology.devices_per_host
    per_host = [np.unique(h, return_counts=True) for h in host]
    hosts_spanned = max(len(u) for u, _ in per_host)
    members = max(int(c.max()) for _, c in per_host)
    counts = {int(c) for _, cs in per_host for c in cs}
    even = len(counts) == 1 and len({len(u) for u, _ in per_host}) == 1
    crossing = np.zeros(topology.hosts, dtype=int)
    for u, _ in per_host:
        if len(u) > 1:
            crossing[u] += 1
    dims_spanned = 0
    if topology.intra.dims and groups.shape[1] > 1:
        coords = np.stack(np.unravel_index(phys % topology.devices_per_host, topology.intra.dims), -1)
        dims_spanned = int(max((np.ptp(c, axis=0) > 0).sum() for c in coords))
    return Placement(axes=axes, group_size=groups.shape[1], num_groups=groups.shape[0], hosts=hosts_spanned,
                     members_per_host=members, crossing_groups_per_host=int(crossing.max()), even=even,
                     level="inter" if hosts_spanned > 1 else "intra", local_dims_spanned=dims_spanned)


# Axes whose traffic sits on every layer's critical path: they belong inside a host's fast domain.
INTRA_HOST_AXES = {"tensor": "per-layer all-reduces", "context": "per-layer ring attention permutes"}


def placement_warnings(mesh_or_sizes, topology: Topology, device_order=None) -> list[str]:
    """One line per problem: `tensor` or `context` leaving a host, or an axis split unevenly across hosts."""
    sizes, _ = _sizes_and_order(mesh_or_sizes, device_order)
    out = []
    for axis, size in sizes.items():
        if size == 1:
            continue
        p = placement(mesh_or_sizes, (axis,), topology, device_order)
        if axis in INTRA_HOST_AXES and p.level == "inter":
            out.append(f"mesh axis {axis} crosses hosts on {topology.name} (groups span {p.hosts} hosts): its "
                       f"{INTRA_HOST_AXES[axis]} run on {topology.inter.name}; keep {axis} <= "
                       f"{topology.devices_per_host} devices per host")
        if p.level == "inter" and not p.even:
            out.append(f"mesh axis {axis} is split unevenly across hosts on {topology.name}: its groups have "
                       f"different numbers of members per host; use hybrid_device_order or change the axis sizes")
    return out


def axis_links(mesh_or_sizes, topology: Topology, device_order=None, warn: bool = True) -> dict[str, Placement]:
    """{axis: Placement} for every mesh axis of size > 1; `level` says which link its collectives cross."""
    sizes, _ = _sizes_and_order(mesh_or_sizes, device_order)
    if warn:
        for line in placement_warnings(mesh_or_sizes, topology, device_order):
            warnings.warn(line, stacklevel=2)
    return {a: placement(mesh_or_sizes, (a,), topology, device_order) for a, s in sizes.items() if s > 1}
