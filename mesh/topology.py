"""Interconnect topology as data: hosts x devices per host, a fast intra-host level and a slower inter-host
level, the cluster presets, and their JSON files (read, written, validated into one-line errors).
Where a mesh's collectives travel on a topology is mesh/placement.py; the device order, mesh/layout.py."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from typing import Mapping

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
    (one host's checkpoint write bandwidth, GB/s), `matmul_efficiency` {dtype: [[dim, fraction of
    peak], ...]} and `hbm_gbps` (one device's memory bandwidth, GB/s: a datasheet's, or measured by
    `python -m train.plan --calibrate`) (0 / empty = unknown). `step_overhead`: a measured step's time over
    the roofline's work for it (train/plan/reference_step.py; 1 = the roofline, where nothing was measured).
    `shared_host`: the devices are virtual devices of one machine (XLA's CPU devices) that share its cores and
    memory bus, so every device's work queues on the same compute and a device with nothing to do lends its
    cores to the others (see train/plan/timing.py).
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
    hbm_gbps: float = 0.0
    shared_host: bool = False
    step_overhead: float = 1.0

    def __post_init__(self):
        if self.hosts < 1 or self.devices_per_host < 1:
            raise TopologyError(f"topology {self.name}: hosts and devices_per_host must be >= 1")
        if self.intra.dims and math.prod(self.intra.dims) != self.devices_per_host:
            raise TopologyError(f"topology {self.name}: intra dims {self.intra.dims} must multiply to "
                                f"devices_per_host={self.devices_per_host}")
        if min(self.device_memory_gb, self.storage_gbps, self.hbm_gbps) < 0 or \
                any(v <= 0 for v in self.peak_tflops.values()) or not 0 < self.step_overhead < math.inf:
            raise TopologyError(f"topology {self.name}: device_memory_gb, storage_gbps and hbm_gbps must be >= 0, "
                                f"step_overhead and every peak_tflops value > 0 (and finite)")
        bad = [(k, x, e) for k, v in self.matmul_efficiency.items() for x, e in v if not (x > 0 and 0 < e <= 1)]
        if bad:
            k, x, e = bad[0]
            raise TopologyError(f"topology {self.name}: matmul_efficiency[{k!r}] has [{x:g}, {e:g}]; each point needs "
                                f"a dim > 0 and a fraction in (0, 1] (measure it again: python -m train.plan "
                                f"--calibrate=FILE)")

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


# Dense (no sparsity) peak TFLOP/s per dtype and memory bandwidth: mesh/chips.py, the project's one datasheet
# table; memory per device: NVIDIA H100 SXM5 80 GB, A100 SXM4 80 GB and 40 GB datasheets. Storage: each DGX has two
# storage/in-band network ports (DGX H100 datasheet: 2x dual-port ConnectX-7, 400 Gb/s; DGX A100 datasheet:
# 2x dual-port ConnectX-6, 200 Gb/s), one port of each card counted: 100 GB/s and 50 GB/s per host, an upper
# bound that a storage system may not sustain.
def _peaks(device_kind: str) -> dict[str, float]:
    chip = chips.chip_of(device_kind)
    return {dtype: chip.peak_tflops(dtype) for dtype in ("bfloat16", "float16", "float32")}


H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
A100_40GB = "NVIDIA A100-SXM4-40GB"


def _dgx(name: str, nvlink: Level, ib: Level, hosts: int, memory_gb: float, device_kind: str,
         storage_gbps: float) -> Topology:
    return Topology(name, hosts, 8, nvlink, ib,  # 8 GPUs per DGX node (both datasheets)
                    device_memory_gb=memory_gb, peak_tflops=_peaks(device_kind), storage_gbps=storage_gbps,
                    hbm_gbps=chips.memory_gbps(device_kind))


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
    return Topology("tpu-v5p", hosts, 64, ici, dcn, device_memory_gb=95.0, peak_tflops=_peaks("TPU v5p"),
                    hbm_gbps=chips.memory_gbps("TPU v5p"))


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
    return Topology("tpu-v5e", hosts, 256, ici, dcn, device_memory_gb=16.0, peak_tflops=_peaks("TPU v5 lite"),
                    hbm_gbps=chips.memory_gbps("TPU v5 lite"))


PRESETS = {
    "dgx-h100": lambda hosts: _dgx("dgx-h100", NVLINK4, IB_NDR, hosts, 80.0, H100, 100.0),
    "dgx-a100": lambda hosts: _dgx("dgx-a100", NVLINK3, IB_HDR, hosts, 80.0, A100, 50.0),
    "dgx-a100-40gb": lambda hosts: _dgx("dgx-a100-40gb", NVLINK3, IB_HDR, hosts, 40.0, A100_40GB, 50.0),
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
                        storage_gbps=float(d.get("storage_gbps", 0.0)), hbm_gbps=float(d.get("hbm_gbps", 0.0)),
                        matmul_efficiency={str(k): [[float(x), float(e)] for x, e in v]
                                           for k, v in d.get("matmul_efficiency", {}).items()},
                        shared_host=bool(d.get("shared_host", False)),
                        step_overhead=float(d.get("step_overhead", 1.0)))
    except (TypeError, ValueError, AttributeError):
        raise TopologyError(f"{source}: device_memory_gb, storage_gbps, hbm_gbps and step_overhead must be numbers, "
                            f"peak_tflops {{dtype: TFLOP/s}} and matmul_efficiency "
                            f"{{dtype: [[dim, fraction], ...]}}") from None
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
