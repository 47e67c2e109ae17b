"""Interconnect topology: hosts x devices per host, a fast intra-host level and a slower inter-host level.

Answers where each mesh axis's collectives travel (which level, how many hosts, how many groups share a
host's links) and gives a hybrid device order that keeps the inner mesh axes inside one host.
Audit part (where each mesh axis's traffic travels); train/planner/audit.py maps the parts of `--audit`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import warnings
from typing import Mapping, Sequence

import numpy as np

from mesh import chips
from mesh.errors import UserError

FAMILIES = ("switch", "ring", "torus2d", "torus3d", "hypercube", "fat_tree")
# The `local` topology (fitted by `python -m mesh.bench --fit`) is found by a documented lookup:
# $SPMDTRAIN_LOCAL_TOPOLOGY when set, else this package's data file mesh/topologies/local.json.
# Any other file is named explicitly: --topology=PATH.json.
LOCAL_FILE = pathlib.Path(__file__).resolve().parent / "topologies" / "local.json"
LOCAL_ENV = "SPMDTRAIN_LOCAL_TOPOLOGY"


class TopologyError(UserError):
    """A topology preset, file or host count the user can fix; the message is one line naming it."""


def local_file() -> pathlib.Path:
    return pathlib.Path(os.environ[LOCAL_ENV]).expanduser() if os.environ.get(LOCAL_ENV) else LOCAL_FILE


@dataclasses.dataclass(frozen=True)
class Level:
    """One level of the interconnect.

    `bandwidth_gbps` is one link, one direction, in GB/s (bytes); `latency_us` is paid per algorithm
    step and `overhead_us` once per collective (launch and synchronisation). `links` counts links per device on the
    intra-host level (NVLink ports) and links per host on the inter-host level (NICs). `dims` is the
    ring or torus shape of a host's fast domain (torus/ring families). A fat tree with
    `oversubscription` r gives cross-leaf traffic 1/r of the host's NIC bandwidth; `hosts_per_leaf` = 0
    means every inter-host group pays it.
    """
    name: str
    family: str
    bandwidth_gbps: float
    latency_us: float
    links: int = 1
    overhead_us: float = 0.0
    dims: tuple[int, ...] = ()
    oversubscription: float = 1.0
    hosts_per_leaf: int = 0

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise TopologyError(f"level {self.name}: family={self.family!r} is unknown; "
                                f"use one of {', '.join(FAMILIES)}")
        if self.bandwidth_gbps <= 0 or self.latency_us < 0 or self.overhead_us < 0 or self.links < 1:
            raise TopologyError(f"level {self.name}: need bandwidth_gbps > 0, latency_us >= 0, overhead_us >= 0 "
                                f"and links >= 1")
        if self.oversubscription < 1:
            raise TopologyError(f"level {self.name}: oversubscription={self.oversubscription} must be >= 1 "
                                f"(1 = full bisection)")
        object.__setattr__(self, "dims", tuple(int(d) for d in self.dims))


@dataclasses.dataclass(frozen=True)
class Topology:
    """`hosts` fast domains of `devices_per_host` devices each (for TPUs a "host" is an ICI slice).

    `axes` optionally holds per-mesh-axis levels fitted by `python -m mesh.bench --fit`; they override
    the generic levels for collectives over exactly that axis. What planning needs besides the links:
    `device_memory_gb` per device (GB = 1e9 bytes), dense `peak_tflops` per dtype name, `storage_gbps`
    (one host's checkpoint write bandwidth, GB/s), and `matmul_efficiency` {dtype: [[dim, fraction of
    peak], ...]} measured by `python -m train.plan --calibrate` (0 / empty = unknown).
    """
    name: str
    hosts: int
    devices_per_host: int
    intra: Level
    inter: Level
    axes: Mapping[str, Level] = dataclasses.field(default_factory=dict)
    device_memory_gb: float = 0.0
    peak_tflops: Mapping[str, float] = dataclasses.field(default_factory=dict)
    storage_gbps: float = 0.0
    matmul_efficiency: Mapping[str, list] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.hosts < 1 or self.devices_per_host < 1:
            raise TopologyError(f"topology {self.name}: hosts and devices_per_host must be >= 1")
        if self.intra.dims and math.prod(self.intra.dims) != self.devices_per_host:
            raise TopologyError(f"topology {self.name}: intra dims {self.intra.dims} must multiply to "
                                f"devices_per_host={self.devices_per_host}")
        if self.device_memory_gb < 0 or self.storage_gbps < 0 or any(v <= 0 for v in self.peak_tflops.values()):
            raise TopologyError(f"topology {self.name}: device_memory_gb and storage_gbps must be >= 0 and every "
                                f"peak_tflops value > 0")

    @property
    def num_devices(self) -> int:
        return self.hosts * self.devices_per_host

    def with_hosts(self, hosts: int) -> "Topology":
        """The same cluster with another number of hosts (what `--hosts` sets)."""
        return dataclasses.replace(self, hosts=int(hosts))


# Presets. Bandwidths are per link and per direction. NCCL's ring latencies per step come from its
# tuning model (NCCL src/graph/tuning.cc, hwLat, Ring/LL128: NVLink 1.9 us, network 4.0 us).
NVLINK4 = Level("nvlink4", "switch",
                bandwidth_gbps=25.0,   # DGX H100 datasheet: 18 NVLink links per GPU, 900 GB/s bidirectional
                latency_us=1.9,        # NCCL tuning.cc hwLat NVLINK Ring LL128
                links=18)
NVLINK3 = Level("nvlink3", "switch",
                bandwidth_gbps=25.0,   # DGX A100 datasheet: 12 NVLink links per GPU, 600 GB/s bidirectional
                latency_us=1.9,        # NCCL tuning.cc hwLat NVLINK Ring LL128
                links=12)
IB_NDR = Level("infiniband-ndr", "fat_tree",
               bandwidth_gbps=50.0,    # DGX H100 datasheet: 8x single-port ConnectX-7, 400 Gb/s each
               latency_us=4.0,         # NCCL tuning.cc hwLat NET Ring LL128
               links=8)                # one NIC per GPU (rail-optimized), full-bisection SuperPOD fabric
IB_HDR = Level("infiniband-hdr", "fat_tree",
               bandwidth_gbps=25.0,    # DGX A100 datasheet: 8x single-port ConnectX-6, 200 Gb/s HDR each
               latency_us=4.0,         # NCCL tuning.cc hwLat NET Ring LL128
               links=8)


# Dense (no sparsity) peak TFLOP/s per dtype: mesh/chips.py, the project's one datasheet table; memory per
# device: NVIDIA H100 SXM5 80 GB, A100 SXM4 80 GB and 40 GB datasheets. Storage: each DGX has two storage/in-band network ports (DGX H100 datasheet: 2x dual-port
# ConnectX-7, 400 Gb/s; DGX A100 datasheet: 2x dual-port ConnectX-6, 200 Gb/s), one port of each card
# counted: 100 GB/s and 50 GB/s per host, an upper bound that a storage system may not sustain.
def _peaks(device_kind: str) -> dict[str, float]:
    chip = chips.chip_of(device_kind)
    return {dtype: chip.peak_tflops(dtype) for dtype in ("bfloat16", "float16", "float32")}


H100_PEAK = _peaks("NVIDIA H100 80GB HBM3")
A100_PEAK = _peaks("NVIDIA A100-SXM4-80GB")


def _dgx(name: str, nvlink: Level, ib: Level, hosts: int, memory_gb: float, peak: Mapping[str, float],
         storage_gbps: float) -> Topology:
    return Topology(name, hosts, 8, nvlink, ib,  # 8 GPUs per DGX node (both datasheets)
                    device_memory_gb=memory_gb, peak_tflops=dict(peak), storage_gbps=storage_gbps)


def _tpu_v5p(hosts: int) -> Topology:
    ici = Level("ici-v5p", "torus3d",
                # cloud.google.com/tpu/docs/v5p: 1200 GB/s bidirectional ICI per chip = 6 links x 2 x 100
                bandwidth_gbps=100.0,
                latency_us=1.0,        # assumed: not on the datasheet
                dims=(4, 4, 4))        # one cube, the smallest slice with full 3D wraparound (same page)
    dcn = Level("dcn-v5p", "switch",
                bandwidth_gbps=6.25,   # same page: 50 Gbps DCN bandwidth per chip
                latency_us=10.0,       # assumed: data-center network round trip, not on the datasheet
                links=64)              # one DCN share per chip of the 64-chip slice
    # same page: 95 GB HBM and 459 bf16 TFLOP/s per chip; storage bandwidth is not on it (0 = unknown)
    return Topology("tpu-v5p", hosts, 64, ici, dcn, device_memory_gb=95.0, peak_tflops=_peaks("TPU v5p"))


def _tpu_v5e(hosts: int) -> Topology:
    ici = Level("ici-v5e", "torus2d",
                bandwidth_gbps=50.0,   # cloud.google.com/tpu/docs/v5e: 400 GB/s bidirectional ICI per chip, 4 ports
                latency_us=1.0,        # assumed: not on the datasheet
                dims=(16, 16))         # same page: 256-chip pod, 2D torus
    dcn = Level("dcn-v5e", "switch",
                bandwidth_gbps=12.5,   # same page: per-host NIC configuration 2 x 100 Gbps, 8 chips per host
                latency_us=10.0,       # assumed: not on the datasheet
                links=64)              # 32 hosts per pod x 2 NICs
    # same page: 16 GB HBM and 197 bf16 TFLOP/s per chip
    return Topology("tpu-v5e", hosts, 256, ici, dcn, device_memory_gb=16.0, peak_tflops=_peaks("TPU v5 lite"))


PRESETS = {
    "dgx-h100": lambda hosts: _dgx("dgx-h100", NVLINK4, IB_NDR, hosts, 80.0, H100_PEAK, 100.0),
    "dgx-a100": lambda hosts: _dgx("dgx-a100", NVLINK3, IB_HDR, hosts, 80.0, A100_PEAK, 50.0),
    "dgx-a100-40gb": lambda hosts: _dgx("dgx-a100-40gb", NVLINK3, IB_HDR, hosts, 40.0, A100_PEAK, 50.0),
    "tpu-v5p": _tpu_v5p,
    "tpu-v5e": _tpu_v5e,
    "local": None,  # read from local_file(), written by `python -m mesh.bench --fit`
}


def get_topology(name: str, hosts: int | None = None) -> Topology:
    """A preset by name (`dgx-h100`, `dgx-a100`, `dgx-a100-40gb`, `tpu-v5p`, `tpu-v5e`, `local`) or a JSON
    file path."""
    if name == "local":
        topo = load_topology(local_file())
    elif name in PRESETS:
        topo = PRESETS[name](1)
    elif name.endswith(".json") or pathlib.Path(name).is_file():
        topo = load_topology(name)
    else:
        raise TopologyError(f"--topology={name}: unknown; use one of {', '.join(PRESETS)} or a path to a .json file")
    return topo.with_hosts(hosts) if hosts else topo


def topology_to_dict(topo: Topology) -> dict:
    out = dataclasses.asdict(topo)
    for level in [out["intra"], out["inter"], *out["axes"].values()]:
        level["dims"] = list(level["dims"])
    return out


def topology_from_dict(d: Mapping, source: str = "topology") -> Topology:
    """Inverse of `topology_to_dict`; unknown or missing keys are one-line errors naming the key."""
    def level(key, spec):
        if not isinstance(spec, Mapping):
            raise TopologyError(f"{source}: '{key}' must be an object with family, bandwidth_gbps, latency_us")
        fields = {f.name for f in dataclasses.fields(Level)}
        extra = sorted(set(spec) - fields)
        if extra:
            raise TopologyError(f"{source}: '{key}.{extra[0]}' is not a level setting; use {', '.join(sorted(fields))}")
        try:
            return Level(**{"name": key, **spec})
        except TypeError as e:
            raise TopologyError(f"{source}: '{key}' needs family, bandwidth_gbps and latency_us ({e})") from None
    for key in ("hosts", "devices_per_host", "intra", "inter"):
        if key not in d:
            raise TopologyError(f"{source}: missing '{key}'; a topology needs hosts, devices_per_host, intra, inter")
    try:
        planning = dict(device_memory_gb=float(d.get("device_memory_gb", 0.0)),
                        peak_tflops={str(k): float(v) for k, v in d.get("peak_tflops", {}).items()},
                        storage_gbps=float(d.get("storage_gbps", 0.0)),
                        matmul_efficiency={str(k): [[float(x), float(e)] for x, e in v]
                                           for k, v in d.get("matmul_efficiency", {}).items()})
    except (TypeError, ValueError, AttributeError):
        raise TopologyError(f"{source}: device_memory_gb and storage_gbps must be numbers, peak_tflops "
                            f"{{dtype: TFLOP/s}} and matmul_efficiency {{dtype: [[dim, fraction], ...]}}") from None
    return Topology(name=str(d.get("name", pathlib.Path(source).stem)), hosts=int(d["hosts"]),
                    devices_per_host=int(d["devices_per_host"]), intra=level("intra", d["intra"]),
                    inter=level("inter", d["inter"]),
                    axes={a: level(a, s) for a, s in d.get("axes", {}).items()}, **planning)


def load_topology(path: str | pathlib.Path) -> Topology:
    path = pathlib.Path(path)
    if not path.is_file():
        hint = " (run `python -m mesh.bench --fit` to create it)" if path == local_file() else ""
        raise TopologyError(f"--topology={path}: no such file{hint}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TopologyError(f"--topology={path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except OSError as e:
        raise TopologyError(f"--topology={path}: cannot read it ({e.strerror})") from None
    return topology_from_dict(data, str(path))


def save_topology(topo: Topology, path: str | pathlib.Path, provenance: Mapping | None = None) -> None:
    """Write `topo` as JSON; `provenance` (machine, date, command, fit error) is kept for readers only."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = topology_to_dict(topo)
    if provenance:
        data["provenance"] = dict(provenance)
    path.write_text(json.dumps(data, indent=2) + "\n")


# ----------------------------------------------------------------------------- placement

def _sizes_and_order(mesh_or_sizes, device_order):
    """({axis: size} in mesh order, physical device index of each mesh position)."""
    if isinstance(mesh_or_sizes, Mapping):
        sizes = {a: int(s) for a, s in mesh_or_sizes.items()}
        n = math.prod(sizes.values())
        order = np.arange(n) if device_order is None else np.asarray(device_order)
    else:  # a jax Mesh: physical index = rank of (process_index, id), i.e. process-major
        mesh = mesh_or_sizes
        from mesh.layout import axis_sizes  # here: mesh.layout imports this module
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
        raise ValueError(f"mesh of {n} devices does not fill whole hosts of {dph} on {where}; "
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
    """Devices in hybrid order, for `mesh.layout.make_mesh(sizes, devices=...)` (sizes in mesh order)."""
    import jax
    if devices is None:
        devices = jax.devices()
    physical = sorted(devices, key=lambda d: (d.process_index, d.id))
    order = hybrid_device_order(sizes, topology)
    if len(order) > len(physical):
        raise ValueError(f"mesh needs {len(order)} devices but {len(physical)} are available")
    return [physical[i] for i in order]
