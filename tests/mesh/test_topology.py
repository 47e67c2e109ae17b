"""Topology presets, file loading, which link each mesh axis crosses, warnings and the hybrid device order."""
import dataclasses
import json
import warnings

import jax
import numpy as np
import pytest

from mesh import layout as L
from mesh import placement as PL
from mesh import topology as T
from mesh.layout import make_mesh, resolve_axis_sizes


def test_presets_carry_datasheet_figures():
    h100 = T.get_topology("dgx-h100", hosts=16)
    assert (h100.hosts, h100.devices_per_host, h100.num_devices) == (16, 8, 128)
    assert h100.intra.bandwidth_gbps * h100.intra.links == 450          # 900 GB/s bidirectional NVLink
    assert h100.inter.bandwidth_gbps * h100.inter.links == 400          # 8 x 400 Gb/s
    a100 = T.get_topology("dgx-a100")
    assert a100.intra.bandwidth_gbps * a100.intra.links == 300 and a100.inter.bandwidth_gbps == 25
    v5p, v5e = T.get_topology("tpu-v5p", hosts=2), T.get_topology("tpu-v5e")
    assert (v5p.intra.family, v5p.intra.dims, v5p.intra.bandwidth_gbps * 6 * 2) == ("torus3d", (4, 4, 4), 1200)
    assert (v5e.intra.family, v5e.intra.dims, v5e.intra.bandwidth_gbps * 4 * 2) == ("torus2d", (16, 16), 400)


def test_local_topology_is_committed_and_fitted():
    local = T.get_topology("local")
    assert local.hosts == 1 and local.devices_per_host >= 8
    assert local.axes and all(lv.bandwidth_gbps > 0 for lv in local.axes.values())
    assert local.shared_host and not T.get_topology("dgx-h100").shared_host  # fitted on virtual CPU devices


def test_user_file_roundtrip_and_errors(tmp_path):
    spec = {"name": "lab", "hosts": 4, "devices_per_host": 4,
            "intra": {"family": "ring", "bandwidth_gbps": 32, "latency_us": 2, "dims": [4]},
            "inter": {"family": "fat_tree", "bandwidth_gbps": 12.5, "latency_us": 6, "links": 1,
                      "oversubscription": 2}}
    path = tmp_path / "lab.json"
    path.write_text(json.dumps(spec))
    topo = T.get_topology(str(path))
    assert (topo.name, topo.num_devices, topo.inter.oversubscription, topo.intra.dims) == ("lab", 16, 2, (4,))
    T.save_topology(topo, tmp_path / "copy.json")
    assert T.load_topology(tmp_path / "copy.json") == topo
    T.save_topology(dataclasses.replace(topo, shared_host=True), tmp_path / "shared.json")
    assert T.load_topology(tmp_path / "shared.json").shared_host
    for bad, fragment in [({**spec, "intra": {**spec["intra"], "family": "mesh"}}, "family='mesh' is unknown"),
                          ({k: v for k, v in spec.items() if k != "inter"}, "missing 'inter'"),
                          ({**spec, "inter": {**spec["inter"], "speed": 1}}, "'inter.speed' is not a level setting")]:
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=fragment) as info:
            T.get_topology(str(path))
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="--topology=nvl72: unknown"):
        T.get_topology("nvl72")


def test_axes_onto_links_on_two_dgx_hosts():
    topo = T.get_topology("dgx-h100", hosts=2)
    sizes = {"data": 2, "pipeline": 1, "fsdp": 2, "tensor": 4}  # 16 devices, process-major
    links = PL.axis_links(sizes, topo)
    assert set(links) == {"data", "fsdp", "tensor"}
    assert links["tensor"].level == links["fsdp"].level == "intra"
    d = links["data"]
    # 8 data-parallel groups of 2, one member on each host, all 8 leave each host at once
    assert (d.level, d.hosts, d.members_per_host, d.crossing_groups_per_host, d.num_groups) == ("inter", 2, 1, 8, 8)
    both = PL.placement(sizes, ("data", "fsdp", "tensor"), topo)
    assert (both.group_size, both.hosts, both.members_per_host, both.crossing_groups_per_host) == (16, 2, 8, 1)


def test_placement_of_a_jax_mesh_uses_process_major_ids():
    topo = T.Topology("pairs", 4, 2, T.NVLINK4, T.IB_NDR)
    mesh = make_mesh({"data": 4, "tensor": 2})
    assert PL.placement(mesh, ("tensor",), topo).level == "intra"
    flipped = make_mesh({"data": 4, "tensor": 2}, devices=[jax.devices()[i] for i in (0, 2, 1, 3, 4, 6, 5, 7)])
    assert PL.placement(flipped, ("tensor",), topo).level == "inter"


def test_warnings_for_tensor_across_hosts_and_uneven_axes():
    topo = T.get_topology("dgx-h100", hosts=2)
    with pytest.warns(UserWarning, match="mesh axis tensor crosses hosts"):
        PL.axis_links({"data": 1, "tensor": 16}, topo)
    four = T.Topology("four", 3, 4, T.NVLINK4, T.IB_NDR)
    sizes = {"data": 2, "fsdp": 3, "tensor": 2}   # 12 devices, hosts of 4
    lines = PL.placement_warnings(sizes, four)
    assert any("fsdp is split unevenly" in line for line in lines)
    assert all("\n" not in line for line in lines)
    order = L.hybrid_device_order(sizes, four)
    assert PL.placement_warnings(sizes, four, order) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PL.axis_links({"data": 2, "tensor": 8}, topo)  # a clean layout warns nothing


def test_hybrid_order_keeps_inner_factors_in_a_host():
    four = T.Topology("four", 3, 4, T.NVLINK4, T.IB_NDR)
    sizes = {"data": 2, "fsdp": 3, "tensor": 2}
    order = np.array(L.hybrid_device_order(sizes, four)).reshape(2, 3, 2)
    assert sorted(order.ravel().tolist()) == list(range(12))
    host = order // 4
    assert (host[:, :, 0] == host[:, :, 1]).all()          # tensor pairs share a host
    assert (host[0] == host[1]).all()                      # data pairs share a host
    assert all(len(set(host[d, :, t])) == 3 for d in range(2) for t in range(2))  # fsdp: one per host
    # powers of two: process-major order already is the hybrid order
    h100 = T.get_topology("dgx-h100", hosts=4)
    assert L.hybrid_device_order({"data": 4, "fsdp": 2, "tensor": 4}, h100) == list(range(32))
    with pytest.raises(ValueError, match="does not fill whole hosts"):
        L.hybrid_device_order({"data": 3, "tensor": 4}, h100)


def test_hybrid_devices_feed_make_mesh():
    topo = T.Topology("quads", 2, 4, T.NVLINK4, T.IB_NDR)
    sizes = resolve_axis_sizes({"data": 2, "tensor": 4}, 8)
    mesh = make_mesh(sizes, devices=L.hybrid_devices(sizes, topo))
    assert [d.id for d in mesh.devices.flat] == list(range(8))
    assert PL.axis_links(mesh, topo)["tensor"].level == "intra"


def test_mesh_larger_than_topology_is_a_one_line_error():
    with pytest.raises(ValueError, match="raise --hosts to 2"):
        PL.placement({"data": 16}, ("data",), T.get_topology("dgx-h100"))
