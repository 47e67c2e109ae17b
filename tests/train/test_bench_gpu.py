"""experiments/bench_gpu.py: refuses cleanly without a GPU, and its --smoke mode runs every part on CPU."""
import json

import pytest

from experiments import bench_gpu


def test_refuses_without_a_gpu_and_smoke_runs_every_part(tmp_path, capsys):
    assert bench_gpu.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: experiments.bench_gpu needs an NVIDIA GPU") and "\n" not in err
    out = tmp_path / "rows.json"
    assert bench_gpu.main(["--smoke", "--steps=1", f"--json={out}", f"--save_dir={tmp_path / 'saves'}"]) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["workload"] == "tiny" and row["attention"] == "xla" and row["step_ms"] > 0
    assert row["peak_gib_per_device"] == row["compiled_peak_gib"] > 0  # CPU: the compiled estimate
    assert row["tokens_per_s"] == pytest.approx(8 * 32 / (row["step_ms"] / 1e3), rel=0.01)
    assert 0 < row["save_blocked_s"] <= row["save_total_s"] and row["state_gib"] > 0
    assert row["pinned_host_copy"] is False and row["orbax_copy_blocked_s"] > 0  # CPU: Orbax copies itself
    assert not (tmp_path / "saves" / "tiny").exists()  # the timed save is removed again
    # bf16 XLA attention against float32: small but nonzero differences, with and without segments.
    assert [(r["kernel"], r["segments"]) for r in result["attention"]] == [("xla", False), ("xla", True)]
    assert all(0 < r["out_max_abs"] < 0.1 and 0 < r["dv_max_abs"] < 0.1 for r in result["attention"])
