"""A tiny collective sweep on 8 virtual devices gives consistent records; the fit recovers known parameters."""
import json

import pytest

from mesh import bench, cost, topology
from mesh.layout import MeshConfigError, make_mesh
from tests.helpers import ROOT, run_cli


@pytest.fixture(scope="module")
def records():
    mesh = make_mesh({"data": 2, "tensor": 4})
    return bench.sweep(mesh, [1024, 4096], iters=2, warmup=1)


def test_records_are_consistent(records):
    assert len(records) == 2 * 5 * 2   # axes x collectives x sizes
    assert {(r["axis"], r["group_size"]) for r in records} == {("data", 2), ("tensor", 4)}
    for r in records:
        assert tuple(r) == bench.RECORD_KEYS
        assert r["bytes"] in (1024, 4096) and r["time_us"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e3))
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * cost.bus_factor(r["collective"], r["group_size"]))
    ar = next(r for r in records if r["collective"] == "all_reduce" and r["axis"] == "tensor")
    assert ar["busbw_gbps"] == pytest.approx(ar["algbw_gbps"] * 1.5)


def test_predictions_and_table(records):
    h100 = topology.get_topology("dgx-h100")
    sizes = {"data": 2, "pipeline": 1, "fsdp": 1, "tensor": 4}
    bench.predict(records, sizes, h100)
    for r in records:
        assert r["predicted_us"] == pytest.approx(
            cost.predict_us(r["collective"], r["bytes"], [r["axis"]], sizes, h100))
    text = bench.table(records)
    assert text.count("\n") == len(records) + 2 and "busbw" in text and "Avg bus bandwidth" in text


def test_fit_recovers_known_parameters():
    params = {"data": (20.0, 3.0, 2.0), "tensor": (50.0, 0.0, 8.0)}  # overhead us, alpha us, GB/s
    rows = []
    for axis, n in (("data", 2), ("tensor", 4)):
        o, a, b = params[axis]
        for c in bench.COLLECTIVES:
            for s in (1024, 8192, 65536, 1 << 20):
                t = cost.time_us(c, s, n, cost.Link(a, b, overhead_us=o))
                rows.append({"collective": c, "axis": axis, "group_size": n, "bytes": s, "time_us": t})
    topo, err = bench.fit(rows, 8)
    assert err < 1e-6
    for axis, (o, a, b) in params.items():
        lv = topo.axes[axis]
        assert (lv.overhead_us, lv.latency_us, lv.bandwidth_gbps) == pytest.approx((o, a, b), rel=1e-6, abs=1e-6)


def test_flag_errors():
    assert bench.parse_mesh("data:2,tensor:4") == {"data": 2, "tensor": 4}
    with pytest.raises(MeshConfigError, match="--mesh=data=2"):
        bench.parse_mesh("data=2")
    with pytest.raises(ValueError, match="--min_bytes=8 --max_bytes=4"):
        bench.byte_sizes(8, 4)
    assert bench.byte_sizes(1024, 8192) == [1024, 2048, 4096, 8192]
    with pytest.raises(ValueError, match="--collectives=broadcast"):
        bench.sweep(make_mesh({"data": 8}), [1024], ["broadcast"])


def test_command_line(tmp_path):
    out, fitted, png = tmp_path / "rows.jsonl", tmp_path / "local.json", tmp_path / "busbw.png"
    proc = run_cli("--num_cpu_devices=8", "--mesh=data:2,tensor:4", "--min_bytes=1024", "--max_bytes=2048",
                   "--collectives=all_reduce,permute", "--iters=2", f"--json={out}", "--fit",
                   f"--topology_out={fitted}", f"--plot={png}", module="mesh.bench", timeout=120,
                   env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fit median relative error" in proc.stdout and "busbw" in proc.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2 and all(tuple(r) == bench.RECORD_KEYS for r in rows)
    assert all(r["predicted_us"] > 0 for r in rows)
    assert set(topology.load_topology(fitted).axes) == {"data", "tensor"}
    assert png.stat().st_size > 1000
