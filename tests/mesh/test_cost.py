"""Alpha-beta closed forms, nccl-tests bus-bandwidth factors, contention and algorithm choice."""
import math

import pytest

from mesh import cost as K
from mesh import placement as PL
from mesh import topology as T


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_bus_factors(n):
    assert K.bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for c in ("all_gather", "reduce_scatter", "all_to_all"):
        assert K.bus_factor(c, n) == pytest.approx((n - 1) / n)
    assert K.bus_factor("permute", n) == K.bus_factor("collective_permute", n) == 1.0
    with pytest.raises(ValueError, match="collective='broadcast'"):
        K.bus_factor("broadcast", n)


def test_closed_forms():
    link = K.Link(alpha_us=1.0, bandwidth_gbps=1.0)   # 1 GB/s = 1000 bytes/us
    S = 8000
    assert K.time_us("all_reduce", S, 4, link) == pytest.approx(2 * 3 * 1 + 2 * 3 / 4 * 8)
    assert K.time_us("all_gather", S, 4, link) == pytest.approx(3 + 3 / 4 * 8)
    assert K.time_us("reduce_scatter", S, 8, link) == pytest.approx(7 + 7 / 8 * 8)
    assert K.time_us("all_to_all", S, 2, link) == pytest.approx(1 + 1 / 2 * 8)
    assert K.time_us("permute", S, 8, link) == pytest.approx(1 + 8)
    assert K.time_us("all_reduce", S, 8, link, "halving_doubling") == pytest.approx(2 * 3 + 2 * 7 / 8 * 8)
    assert K.time_us("all_reduce", S, 1, link) == 0.0
    inner, outer = K.Link(0.5, 10.0), K.Link(4.0, 2.0)
    want = 2 * (3 * 0.5 + 3 / 4 * S / 1e4) + 2 * 1 * 4.0 + 2 * 1 / 2 * (S / 4) / 2e3
    assert K.hierarchical_all_reduce_us(S, 4, inner, 2, outer) == pytest.approx(want)
    with pytest.raises(ValueError, match="power-of-two group, got n=6"):
        K.time_us("all_reduce", S, 6, link, "halving_doubling")


def _two_hosts(links):
    """2 hosts x 2 devices, free latency so time is pure bandwidth; `links` NICs of 10 GB/s per host."""
    intra = T.Level("fast", "switch", bandwidth_gbps=100.0, latency_us=0.0)
    inter = T.Level("nic", "switch", bandwidth_gbps=10.0, latency_us=0.0, links=links)
    return T.Topology("pair", 2, 2, intra, inter)


def test_contention_doubles_time_when_two_groups_share_one_link():
    sizes = {"data": 2, "tensor": 2}   # data groups (0,2) and (1,3): both leave each host at once
    shared = K.predict_us("all_reduce", 1 << 20, ["data"], sizes, _two_hosts(links=1))
    own = K.predict_us("all_reduce", 1 << 20, ["data"], sizes, _two_hosts(links=2))
    assert shared == pytest.approx(2 * own)
    assert own == pytest.approx(2 * 1 / 2 * (1 << 20) / 10e3)   # one NIC each at 10 GB/s


def test_eight_data_parallel_groups_leave_a_dgx_through_eight_nics():
    h100 = T.get_topology("dgx-h100", hosts=2)
    sizes = {"data": 2, "tensor": 8}
    p = PL.placement(sizes, ("data",), h100)
    flat, _ = K.links_for(p, h100)
    assert flat.bandwidth_gbps == pytest.approx(50.0)   # 400 GB/s of NICs shared by 8 groups
    one_nic = T.Topology("one-nic", 2, 8, h100.intra, T.Level("eth", "switch", 50.0, 4.0, links=1))
    flat1, _ = K.links_for(PL.placement(sizes, ("data",), one_nic), one_nic)
    assert flat1.bandwidth_gbps == pytest.approx(50.0 / 8)
    tensor = PL.placement(sizes, ("tensor",), h100)
    assert K.links_for(tensor, h100)[0].bandwidth_gbps == pytest.approx(450.0)


def test_oversubscribed_fat_tree_and_torus_dims():
    base = T.get_topology("dgx-h100", hosts=2)
    over = T.Topology("over", 2, 8, base.intra, T.Level("ib", "fat_tree", 50.0, 4.0, links=8, oversubscription=2))
    sizes = {"data": 2, "tensor": 8}
    a = K.predict_us("all_gather", 1 << 24, ["data"], sizes, base)
    b = K.predict_us("all_gather", 1 << 24, ["data"], sizes, over)
    lat = 4.0  # one step for n = 2
    assert (b - lat) == pytest.approx(2 * (a - lat))
    v5p = T.get_topology("tpu-v5p")
    cube = {"x": 4, "y": 4, "z": 4}
    one = PL.placement(cube, ("z",), v5p)
    two = PL.placement(cube, ("y", "z"), v5p)
    assert (one.local_dims_spanned, two.local_dims_spanned) == (1, 2)
    assert K.links_for(two, v5p)[0].bandwidth_gbps == pytest.approx(2 * K.links_for(one, v5p)[0].bandwidth_gbps)


def test_hierarchical_wins_only_when_the_nics_are_the_bottleneck():
    h100 = T.get_topology("dgx-h100", hosts=2)
    sizes, S = {"data": 16}, 1 << 28
    ring = K.predict_us("all_reduce", S, ["data"], sizes, h100, algorithm="ring")
    hier = K.predict_us("all_reduce", S, ["data"], sizes, h100, algorithm="hierarchical")
    # ring: 30 steps at the NIC latency, 2*15/16 S over the 400 GB/s of 8 NICs (8 channels)
    assert ring == pytest.approx(30 * 4.0 + 2 * 15 / 16 * S / 400e3)
    # hierarchical: in-host RS + AG at 450 GB/s, then 8 outer groups share the 8 NICs on S/8
    assert hier == pytest.approx(2 * (7 * 1.9 + 7 / 8 * S / 450e3) + 2 * 4.0 + (S / 8) / 50e3)
    # On a fat tree, halving-doubling pays 2 log2(16) = 8 latency steps instead of the ring's 30.
    hd = K.predict_us("all_reduce", S, ["data"], sizes, h100, algorithm="halving_doubling")
    assert hd == pytest.approx(ring - 22 * 4.0)
    assert K.predict_us("all_reduce", S, ["data"], sizes, h100) == pytest.approx(min(ring, hd, hier)) == hd
    one_nic = T.Topology("one-nic", 2, 8, h100.intra, T.Level("eth", "switch", 50.0, 4.0, links=1))
    ring1 = K.predict_us("all_reduce", S, ["data"], sizes, one_nic, algorithm="ring")
    hier1 = K.predict_us("all_reduce", S, ["data"], sizes, one_nic, algorithm="hierarchical")
    assert hier1 < ring1 and K.predict_us("all_reduce", S, ["data"], sizes, one_nic) == pytest.approx(hier1)
    with pytest.raises(ValueError, match="algorithm=hierarchical needs"):
        K.predict_us("all_reduce", S, ["data"], {"data": 8}, h100, algorithm="hierarchical")


def test_hypercube_prefers_halving_doubling():
    cube = T.Topology("cube", 1, 8, T.Level("hc", "hypercube", 10.0, 1.0, dims=(2, 2, 2)), T.IB_NDR)
    got = K.predict_us("all_reduce", 8000, ["data"], {"data": 8}, cube)
    assert got == pytest.approx(2 * 3 * 1.0 + 2 * 7 / 8 * 8000 / 10e3)


def test_record_time_and_per_axis_totals():
    h100 = T.get_topology("dgx-h100", hosts=2)
    sizes = {"data": 2, "fsdp": 1, "tensor": 8}
    recs = [{"op": "all_reduce", "bytes": 1 << 20, "axes": ["data"], "count": 3},
            {"op": "collective_permute", "bytes": 4096, "axes": ["tensor"], "count": 2},
            {"op": "all_reduce", "bytes": 4, "axes": [], "count": 1}]
    one = K.predict_us("all_reduce", 1 << 20, ["data"], sizes, h100)
    assert K.record_us(recs[0], sizes, h100) == pytest.approx(3 * one)
    totals = K.time_by_axes(recs, sizes, h100)
    assert set(totals) == {"data", "tensor"}
    assert totals["tensor"] == pytest.approx(2 * (1.9 + 4096 / 450e3))
    rows = K.link_table(sizes, h100)
    assert [(r["axis"], r["level"]) for r in rows] == [("data", "inter"), ("tensor", "intra")]
    assert math.isclose(rows[0]["bandwidth_gbps"], 50.0)
