"""Alpha-beta cost model of collectives on a topology: time = overhead + steps x alpha + bus bytes / bandwidth.

Sizes are the nccl-tests S (bytes of the full buffer; see `bus_factor`), group size n, and the link a
group's traffic crosses, with its bandwidth shared when several groups leave one host at once.
Audit part (what a collective costs on a topology); train/plan/audit.py maps the parts of `--audit`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping, Sequence

from mesh.layout import axis_sizes
from mesh.placement import Placement, placement
from mesh.topology import Level, Topology

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "permute")
ALGORITHMS = ("ring", "halving_doubling", "hierarchical")
_HLO_NAMES = {"collective_permute": "permute"}
# Fabrics on which recursive halving-doubling's pairings (distance 1, 2, 4, ...) never share a link.
FULL_BISECTION = ("hypercube", "switch", "fat_tree")


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests busbw / algbw: all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; permute 1.

    busbw = algbw x factor is the per-device link traffic rate, comparable across group sizes.
    """
    collective = _HLO_NAMES.get(collective, collective)
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective == "permute":
        return 1.0
    raise ValueError(f"collective={collective!r}: unknown; use one of {', '.join(COLLECTIVES)}")


def steps(collective: str, n: int, algorithm: str = "ring") -> int:
    """Latency steps: ring all-reduce 2(n-1), ring gather/scatter/all-to-all n-1, halving-doubling
    2 log2 n (all-reduce) or log2 n, permute 1."""
    collective = _HLO_NAMES.get(collective, collective)
    if n <= 1:
        return 0
    if collective == "permute":
        return 1
    if algorithm == "halving_doubling":
        if n & (n - 1):
            raise ValueError(f"algorithm=halving_doubling needs a power-of-two group, got n={n}; use ring")
        k = int(math.log2(n))
        return 2 * k if collective == "all_reduce" else k
    return 2 * (n - 1) if collective == "all_reduce" else n - 1


@dataclasses.dataclass(frozen=True)
class Link:
    """What one group sees: per-step latency, per-device bandwidth (GB/s) after sharing, and a fixed
    per-collective overhead (launch and synchronisation; 0 in the presets, fitted for `local`)."""
    alpha_us: float
    bandwidth_gbps: float
    level: str = ""
    overhead_us: float = 0.0


def time_us(collective: str, nbytes: float, n: int, link: Link, algorithm: str = "ring") -> float:
    """T = overhead + steps(c, n) * alpha + bus_factor(c, n) * S / B, in microseconds.

    Ring all-reduce: 2(n-1) a + 2(n-1)/n S/B. Ring all-gather / reduce-scatter: (n-1) a + (n-1)/n S/B.
    All-to-all (pairwise exchange on a switch): (n-1) a + (n-1)/n S/B. Permute: a + S/B.
    Recursive halving-doubling (power-of-two n): 2 log2(n) a + 2(n-1)/n S/B for all-reduce.
    """
    if n <= 1:
        return 0.0
    bus_bytes = bus_factor(collective, n) * nbytes
    return (link.overhead_us + steps(collective, n, algorithm) * link.alpha_us
            + bus_bytes / (link.bandwidth_gbps * 1e3))


def hierarchical_all_reduce_us(nbytes: float, n_inner: int, inner: Link, n_outer: int, outer: Link) -> float:
    """Reduce-scatter inside the host, all-reduce across hosts on S/n_inner, all-gather inside the host:

    T = 2 [(n_i-1) a_i + (n_i-1)/n_i S/B_i] + 2(n_o-1) a_o + 2(n_o-1)/n_o (S/n_i)/B_o,
    plus one overhead per phase.
    """
    rs = time_us("reduce_scatter", nbytes, n_inner, inner)
    return 2 * rs + time_us("all_reduce", nbytes / n_inner, n_outer, outer)


def _intra_bandwidth(level: Level, p: Placement) -> float:
    """Per-device bandwidth inside a host: a switch gives every port; a ring or torus runs bidirectional
    rings along each dimension the group spans (2 links per dimension); a hypercube uses one link per step."""
    if level.family in ("switch", "fat_tree"):
        return level.bandwidth_gbps * level.links
    if level.family == "ring":
        return 2 * level.bandwidth_gbps
    if level.family in ("torus2d", "torus3d"):
        return 2 * level.bandwidth_gbps * max(1, p.local_dims_spanned)
    return level.bandwidth_gbps  # hypercube


def _inter_bandwidth(level: Level, p: Placement, members_per_host: int, groups: int) -> float:
    """Per-group bandwidth across hosts, with contention:

    B = min(min(m, L) b, L b / (r G)), L links of b GB/s per host, m members of the group on the host
    (each can drive one NIC), G host-crossing groups sharing the host's NICs, r the fat-tree
    oversubscription (1 when the group's hosts share one leaf). So two groups through one link each get
    half of it, and 8 data-parallel groups leaving a DGX through its 8 NICs get one NIC each.
    """
    r = level.oversubscription
    if level.family == "fat_tree" and level.hosts_per_leaf and p.hosts <= level.hosts_per_leaf:
        r = 1.0
    if level.family not in ("switch", "fat_tree"):
        r = 1.0
    host_bw = level.links * level.bandwidth_gbps
    return min(min(members_per_host, level.links) * level.bandwidth_gbps, host_bw / (r * max(groups, 1)))


def links_for_intra(p: Placement, topo: Topology) -> Link:
    """The intra-host link of a group's members on one host (the inner phase of the hierarchical split)."""
    return Link(topo.intra.latency_us, _intra_bandwidth(topo.intra, p), topo.intra.name, topo.intra.overhead_us)


def links_for(p: Placement, topo: Topology) -> tuple[Link, Link | None]:
    """(the link a flat algorithm sees, the outer link of the hierarchical split or None if one host).

    A group inside one host uses the intra level. A group across hosts is bounded by the slower of the
    intra per-device bandwidth and its contended share of the NICs, at the inter-host latency.
    """
    if len(p.axes) == 1 and p.axes[0] in topo.axes:
        lv = topo.axes[p.axes[0]]  # fitted on this machine for exactly this axis
        return Link(lv.latency_us, lv.bandwidth_gbps * lv.links, lv.name, lv.overhead_us), None
    intra = links_for_intra(p, topo)
    if p.level == "intra":
        return intra, None
    flat_bw = min(intra.bandwidth_gbps if p.members_per_host > 1 else math.inf,
                  _inter_bandwidth(topo.inter, p, p.members_per_host, p.crossing_groups_per_host))
    overhead = max(topo.intra.overhead_us, topo.inter.overhead_us)
    flat = Link(max(topo.intra.latency_us, topo.inter.latency_us), flat_bw, topo.inter.name, overhead)
    # hierarchical: after the in-host reduce-scatter, m parallel outer groups of one member per host
    outer_bw = _inter_bandwidth(topo.inter, p, 1, p.crossing_groups_per_host * p.members_per_host)
    return flat, Link(topo.inter.latency_us, outer_bw, topo.inter.name, topo.inter.overhead_us)


def predict_us(collective: str, nbytes: float, axes: Sequence[str], mesh_or_sizes, topology: Topology,
               algorithm: str | None = None, device_order=None) -> float:
    """Predicted time of one collective over mesh `axes` on `topology`, S = `nbytes` (nccl-tests S).

    `algorithm` None picks the fastest that applies: ring; halving-doubling for a power-of-two group on
    a level where every pair of devices talks without contention (hypercube, switch, fat tree); for
    all-reduce across hosts, also the hierarchical split.
    """
    p = placement(mesh_or_sizes, tuple(axes), topology, device_order)
    return predict_placement_us(collective, nbytes, p, topology, algorithm)


def predict_placement_us(collective: str, nbytes: float, p: Placement, topology: Topology,
                         algorithm: str | None = None) -> float:
    n = p.group_size
    if n <= 1:
        return 0.0
    flat, outer = links_for(p, topology)
    pow2 = (n & (n - 1)) == 0
    if algorithm is not None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={algorithm!r}: unknown; use one of {', '.join(ALGORITHMS)}")
        if algorithm == "hierarchical":
            if outer is None or collective != "all_reduce" or p.members_per_host == 1:
                raise ValueError("algorithm=hierarchical needs an all_reduce whose groups span hosts with "
                                 "several members per host; use ring")
            return hierarchical_all_reduce_us(nbytes, p.members_per_host, links_for_intra(p, topology),
                                              p.hosts, outer)
        return time_us(collective, nbytes, n, flat, algorithm)
    level = topology.inter if p.level == "inter" else topology.intra
    best = time_us(collective, nbytes, n, flat, "ring")
    if pow2 and level.family in FULL_BISECTION:
        best = min(best, time_us(collective, nbytes, n, flat, "halving_doubling"))
    if collective == "all_reduce" and outer is not None and 1 < p.members_per_host < n and p.even:
        best = min(best, hierarchical_all_reduce_us(nbytes, p.members_per_host, links_for_intra(p, topology),
                                                    p.hosts, outer))
    return best


def record_us(record: Mapping, mesh_or_sizes, topology: Topology, device_order=None) -> float:
    """Predicted time per step of one `mesh.hlo.collectives` record: count x time of one execution."""
    if not record["axes"]:
        return 0.0
    one = predict_us(record["op"], record["bytes"], record["axes"], mesh_or_sizes, topology,
                     device_order=device_order)
    return record["count"] * one


def time_by_axes(records: Iterable[Mapping], mesh_or_sizes, topology: Topology) -> dict[str, float]:
    """{'data' | 'fsdp+tensor' | ...: predicted us per step} summed over the records of each axis set."""
    out: dict[str, float] = {}
    for r in records:
        if r["axes"]:
            key = "+".join(r["axes"])
            out[key] = out.get(key, 0.0) + record_us(r, mesh_or_sizes, topology)
    return out


def link_table(mesh_or_sizes: Mapping[str, int], topology: Topology) -> list[dict]:
    """Per axis: level, hosts spanned, contention and the link (alpha, GB/s) a ring over it sees."""
    rows = []
    sizes = mesh_or_sizes if isinstance(mesh_or_sizes, Mapping) else axis_sizes(mesh_or_sizes)
    for axis, size in sizes.items():
        if size > 1:
            p = placement(mesh_or_sizes, (axis,), topology)
            flat, _ = links_for(p, topology)
            rows.append({"axis": axis, "group_size": size, "level": p.level, "hosts": p.hosts,
                         "groups_per_host": p.crossing_groups_per_host, "alpha_us": flat.alpha_us,
                         "bandwidth_gbps": flat.bandwidth_gbps})
    return rows
