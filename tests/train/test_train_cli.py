"""`python -m train` end to end: outputs, their schema, --compile_only, and learning on the stdlib corpus."""
import json
import math
import os

import pytest

from tests.helpers import ROOT, run_cli

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "mfu"}


def test_compile_only_writes_the_report_and_nothing_else(tmp_path):
    workdir = tmp_path / "run"
    result = run_cli("--config=experiments/tiny.py", f"--workdir={workdir}", "--compile_only",
                     "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((workdir / "compile_report.json").read_text())
    assert report["mesh"] == {"data": 2, "pipeline": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    assert report["param_bytes"] == 4 * report["param_count"] == 4 * 1_640_576
    assert report["flops_per_step"] > 6 * report["param_count"] * report["tokens_per_step"] * 0.9
    assert set(report["memory_per_device"]) == {"argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
                                                "peak_bytes"}
    ops = {c["op"] for c in report["collectives"]}
    assert {"all_reduce", "all_gather"} <= ops
    for record in report["collectives"]:
        assert set(record) >= {"op", "shape", "dtype", "bytes", "axes", "count"}
    assert not (workdir / "metrics.jsonl").exists() and not (workdir / "config.json").exists()


def test_training_run_learns_and_writes_its_outputs(tmp_path):
    """The shipped experiment as a user runs it: the planner lays it out (plan.auto), the run trains the printed
    choice and records it with the runner-up in config.json, learns, and writes every output."""
    workdir = tmp_path / "run"
    relative = os.path.relpath(workdir, ROOT)  # as `make train` passes it; Orbax itself wants absolute paths
    result = run_cli("--config=experiments/tiny.py", f"--workdir={relative}", "--config.train.steps=50",
                     "--config.model.d_model=64", "--config.model.n_layers=4",  # half the tiny model: twice as fast
                     "--config.train.log_every=10", "--config.train.eval_every=25",
                     "--config.train.profile_steps=3:4")
    assert result.returncode == 0, result.stderr[-2000:]
    chosen = next(l for l in result.stdout.splitlines() if l.startswith("plan.auto:"))
    assert any(l.startswith("plan.auto runner-up:") for l in result.stdout.splitlines())
    mesh = json.loads((workdir / "compile_report.json").read_text())["mesh"]
    assert chosen.split(": ", 1)[1].split(" | ")[0] == " x ".join(f"{a}={s}" for a, s in mesh.items() if s > 1)
    planned = json.loads((workdir / "config.json").read_text())["plan"]
    assert planned["devices"] == 8 and planned["chosen"]["mesh"] == mesh and planned["runner_up"]["fits"]
    # The run prints the planner's step time for its own layout beside the measured one: plan.auto's figure.
    predicted = json.loads((workdir / "compile_report.json").read_text())["predicted_step_s"]
    assert predicted == pytest.approx(planned["chosen"]["step_time_s"], rel=1e-6)
    assert f"the planner predicts {predicted:.3g} s/step" in result.stdout
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == [10, 20, 30, 40, 50]
    assert [r["step"] for r in evals] == [25, 50]
    assert all(METRIC_KEYS <= set(r) for r in train)
    assert all(0 < r["mfu"] < 1 and r["tokens_per_s"] > 0 for r in train)
    # Byte-level text: the loss falls at least 20% below ln(256) within 50 steps.
    assert train[-1]["loss"] < 0.8 * math.log(256), train
    config = json.loads((workdir / "config.json").read_text())
    assert config["versions"]["jax"] and config["config"]["train"]["steps"] == 50
    assert config["runtime_defaults"] == {}  # the GPU defaults (train/runtime/xla_env.py) stay off on CPU
    assert config["model"]["attention"] == "xla"  # auto, resolved for CPU
    assert list((workdir / "tensorboard").iterdir())
    assert list((workdir / "profile").rglob("*.xplane.pb"))
    assert "done: loss" in result.stdout
    assert (workdir / "checkpoints" / "50").is_dir()  # the final step is always saved
