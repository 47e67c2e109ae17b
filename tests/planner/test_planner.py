"""The analytic planner against compiled memory, the audit's projection, the schedule tables, and the
Young/Daly closed form checked by a simulated Poisson failure process."""
import dataclasses
import json
import math
import shlex

import numpy as np
import pytest

import models
from checkpoint import cadence
from experiments.default import get_config as default_config
from experiments.tiny import get_config as tiny_experiment
from mesh import layout as L
from mesh import placement as PL
from mesh import topology as T
from sharding import schedules
from tests.helpers import run_cli, tiny_config
from train.config.experiment import pin_layout_if_mesh_given
from train.plan import audit as audit_lib
from train.plan import compile_report as report_lib
from train.plan import memory, search, timing
from train.plan.candidate import Candidate, mesh_of
from train.trainer import Trainer

LAYOUTS = {  # name: (config builder, mesh, pipeline (schedule, microbatches, virtual stages))
    "data": (tiny_config, dict(data=8), None),
    "fsdp": (tiny_config, dict(fsdp=8), None),
    "tensor": (tiny_config, dict(tensor=8), None),
    "2x2x2": (tiny_config, dict(data=2, fsdp=2, tensor=2), None),
    "1f1b m4": (tiny_config, dict(data=2, pipeline=4), ("1f1b", 4, 1)),
    "1f1b m8": (tiny_config, dict(data=2, pipeline=4), ("1f1b", 8, 1)),
    "default interleaved m4": (None, dict(data=2, pipeline=2, tensor=2), ("interleaved", 4, 2)),
    "default interleaved m8": (None, dict(data=2, pipeline=2, tensor=2), ("interleaved", 8, 2)),
}


def _config(name):
    build, mesh, pipe = LAYOUTS[name]
    config = tiny_config(**mesh) if build else default_config()
    config.data.source = "synthetic"
    config.mesh.update({"data": 1, "pipeline": 1, "fsdp": 1, "tensor": 1, **mesh})
    config.sharding.strategy = "fsdp_tensor"
    if pipe:
        config.pipeline.update(schedule=pipe[0], microbatches=pipe[1], virtual_stages=pipe[2])
    return config


def _candidate(trainer) -> Candidate:
    plan, pipe = trainer.plan, trainer.plan.pipeline
    return Candidate(mesh_of(plan.mesh_sizes), pipe.schedule if pipe else "none", pipe.microbatches if pipe else 1,
                     pipe.virtual_stages if pipe else 1, plan.model.remat, False, plan.grad_accum)


@pytest.fixture(scope="module")
def compiled():
    """{layout: (trainer, compile report)}: the 8 compiles this file makes."""
    out = {}
    for name in LAYOUTS:
        trainer = Trainer.build(_config(name))
        out[name] = (trainer, report_lib.build(trainer.plan, trainer.mesh, trainer.compile()))
    return out


# Layouts whose whole prediction (state, activations, temporaries) is held to the compiled arguments + outputs +
# temporaries; fsdp=8 and tensor=8 are not: there XLA's CPU program keeps more of each layer's intermediates (see
# docs/benchmarks.md, "Predicted against measured").
WHOLE = ("data", "2x2x2", "1f1b m4", "1f1b m8", "default interleaved m4", "default interleaved m8")


def compiled_bytes(report: dict) -> int:
    m = report["memory_per_device"]
    return m["argument_bytes"] + m["output_bytes"] + m["temp_bytes"]


def test_memory_prediction_matches_compiled_peak(compiled):
    """On CPU XLA's peak counts the step's arguments and outputs (the state twice, undonated, and the batch);
    its temporaries are reported with little reuse: the whole prediction is held to all three within 25%, and
    the temporaries of two schedules are compared with each other."""
    predicted = {}
    for name, (trainer, rep) in compiled.items():
        parts = memory.predict(trainer.plan.model, _candidate(trainer), trainer.plan.global_batch, donated=False)
        predicted[name] = parts
        peak = rep["memory_per_device"]["peak_bytes"]
        assert memory.resident(parts) == pytest.approx(peak, rel=0.15), name
        if name in WHOLE:
            assert parts["total"] == pytest.approx(compiled_bytes(rep), rel=0.25), name
    temps = {n: rep["memory_per_device"]["temp_bytes"] for n, (_, rep) in compiled.items()}
    for fewer, more in (("1f1b m8", "1f1b m4"), ("default interleaved m8", "default interleaved m4")):
        assert predicted[fewer]["activations"] < predicted[more]["activations"]
        assert temps[fewer] < temps[more]


def _bandwidth_only(tmp_path) -> str:
    """One host of 8 devices on a switch with no latency: time is bytes over bandwidth only."""
    level = {"family": "switch", "bandwidth_gbps": 10.0, "latency_us": 0.0, "links": 1}
    path = tmp_path / "bw.json"
    path.write_text(json.dumps({"name": "bw", "hosts": 1, "devices_per_host": 8, "intra": level, "inter": level,
                                "device_memory_gb": 80, "peak_tflops": {"float32": 1.0}}))
    return str(path)


def test_communication_equals_audit_projection(compiled, tmp_path):
    trainer, rep = compiled["data"]  # its audit rows read 1.00 (asserted below)
    plan = trainer.plan
    abstract, specs, rules = memory.layout_specs(plan.model, mesh_of(plan.mesh_sizes))
    from sharding.expected import expected_traffic
    rows = audit_lib.attribute(rep["collectives"], expected_traffic(plan.model, abstract, specs, rules,
                                                                     plan.mesh_sizes, plan.global_batch),
                               plan.mesh_sizes)
    assert all(abs(r["ratio"] - 1) < 0.01 for r in rows if r["ratio"] is not None), rows
    topo_file = _bandwidth_only(tmp_path)
    projected = audit_lib.project(rep["collectives"], plan.mesh_sizes, topo_file, 1, 1.0, 0.5)["comm_us"] * 1e-6
    planned = sum(r[3] for r in timing.communication(plan.model, _candidate(trainer), plan.global_batch,
                                                     T.get_topology(topo_file), counted=False))
    assert planned == pytest.approx(projected, rel=0.05)


def test_bubble_is_the_schedule_tables():
    cfg = models.from_dict({"preset": "gpt3-1.3b"})
    topo = T.get_topology("dgx-h100", hosts=1)
    for name, m, v in (("1f1b", 8, 1), ("gpipe", 4, 1), ("interleaved", 8, 2)):
        c = Candidate(mesh_of({"pipeline": 4, "tensor": 2}), name, m, v)
        f = schedules.bubble_fraction(schedules.build(name, 4, m, v))
        assert timing.bubble_fraction(c) == f
        pred = search.evaluate(cfg, c, 64, topo, donated=True)
        assert pred.bubble_s == pytest.approx((pred.compute_s + pred.memory_bound_s) * f / (1 - f))


def test_too_large_for_one_device_is_never_unsharded():
    cfg = models.from_dict({"preset": "7b"})
    ranked = search.search(cfg, 64, T.get_topology("dgx-h100", hosts=1), {})
    fitting = [p for p in ranked if p.fits]
    assert fitting and all(p.candidate.sizes["data"] < 8 for p in fitting)
    replicated = [p for p in ranked if p.candidate.sizes["data"] == 8]
    assert replicated and not any(p.fits for p in replicated)


def test_every_family_plans():
    """The planner reads a model only through the contract: a Llama preset (grouped-query attention, no
    mlp_ratio) is ranked like a GPT one, and tensor parallelism never splits its 8 kv heads unevenly."""
    cfg = models.from_dict({"preset": "llama3.1-8b"})
    ranked = search.search(cfg, 32, T.get_topology("dgx-h100", hosts=1), {})
    assert any(p.fits for p in ranked)
    assert all(cfg.n_kv_heads % p.candidate.sizes["tensor"] == 0 for p in ranked)
    assert all(p.memory["activations"] > 0 and p.step_time_s > 0 for p in ranked)


def test_slow_inter_host_link_keeps_tensor_in_a_host():
    cfg = models.from_dict({"preset": "7b"})
    topo = T.get_topology("dgx-h100", hosts=4)
    slow = dataclasses.replace(topo, inter=dataclasses.replace(topo.inter, bandwidth_gbps=0.1))
    best = [p for p in search.search(cfg, 128, slow, {"pipeline": 1, "fsdp": 1}) if p.fits][0]
    sizes = best.candidate.sizes
    assert sizes["tensor"] > 1
    p = PL.placement(sizes, ("tensor",), slow, device_order=L.hybrid_device_order(sizes, slow))
    assert p.level == "intra", sizes


def test_young_daly_closed_form_and_optimum():
    C, M = 60.0, 24 * 3600.0
    tau = cadence.optimal_interval_s(C, M)
    assert tau == pytest.approx(math.sqrt(2 * C * M), rel=0.03)  # Young's first order
    grid = np.linspace(0.3 * tau, 3 * tau, 4001)
    goodput = [cadence.expected_goodput(t, C, M, 600.0) for t in grid]
    assert grid[int(np.argmax(goodput))] == pytest.approx(tau, rel=0.02)


def _simulate(tau, C, M, R, failures, seed=0) -> float:
    """Useful seconds over wall seconds: segments of tau work then a save of C; a failure (Poisson, rate 1/M)
    loses the segment back to the last committed save and costs a restart of R, which failures can also
    interrupt (exponential draws are memoryless, so each attempt draws afresh)."""
    rng = np.random.default_rng(seed)
    wall = useful = 0.0
    seen = 0
    while seen < failures:
        x = rng.exponential(M)
        if x >= tau + C:
            wall += tau + C
            useful += tau
            continue
        wall += x
        seen += 1
        while (y := rng.exponential(M)) < R:
            wall += y
            seen += 1
        wall += R
    return useful / wall


def test_simulated_poisson_failures_match_predicted_goodput():
    M, C, R = 3600.0, 30.0, 120.0   # save cost under 1% of the MTBF
    tau = cadence.optimal_interval_s(C, M)
    simulated = _simulate(tau, C, M, R, failures=10_000)
    assert abs(simulated - cadence.expected_goodput(tau, C, M, R)) < 0.02


def test_plan_cli_run_it_line_trains_the_planned_layout(tmp_path):
    """The printed `run it:` line repeats the user's config file and overrides (here another model) and runs as
    printed: parsed and run for 2 steps, it trains the planned layout of that model."""
    out = tmp_path / "plan.json"
    done = run_cli("--config=experiments/tiny.py", "--config.model.preset=llama3-tiny",
                   "--config.data.source=synthetic", "--config.train.eval_every=0", "--topology=dgx-a100",
                   "--hosts=1", "--top=3", f"--json={out}", "--mtbf_hours=1000", module="train.plan")
    assert done.returncode == 0, done.stderr[-2000:]
    written = json.loads(out.read_text())
    ranked = written["candidates"]
    assert written["skipped"] == {"heads not divisible by tensor=8": 1}  # 4 kv heads
    assert ranked[0]["fits"] and ranked[0]["step_time_s"] <= ranked[-1]["step_time_s"]
    assert set(ranked[0]) >= {"mesh", "schedule", "microbatches", "virtual_stages", "remat", "shard_opt_state",
                              "grad_accum_steps", "memory_bytes_per_device", "tflops_per_device", "mfu",
                              "tokens_per_s", "breakdown"}
    assert ranked[0]["breakdown"]["memory_bound_s"] > 0
    assert "best interval (Young/Daly)" in done.stdout
    line = next(l for l in done.stdout.splitlines() if l.startswith("run it: "))
    words = shlex.split(line[len("run it: "):])
    assert words[:4] == ["python", "-m", "train", "--config=experiments/tiny.py"]
    assert "--config.model.preset=llama3-tiny" in words
    assert any(w.startswith("--workdir=runs/tiny-planned") for w in words)  # a fresh workdir, never make train's
    assert "peak float32: 19.5 TFLOP/s per device, from the dgx-a100 preset's datasheet figure" in done.stdout
    run = tmp_path / "run"
    trained = run_cli(*words[3:], f"--workdir={run}", "--config.train.steps=2", "--config.optimizer.warmup_steps=1")
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert json.loads((run / "compile_report.json").read_text())["mesh"] == ranked[0]["mesh"]
    written = json.loads((run / "config.json").read_text())
    assert written["config"]["model"]["preset"] == "llama3-tiny"
    assert written["peak"]["flops_per_device"] > 0 and written["peak"]["source"].startswith("measured")  # for MFU
    bad = run_cli("--config=experiments/default.py", "--topology=nvl72", module="train.plan")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--topology=nvl72" in bad.stderr


def test_bad_plan_input_is_a_user_error():
    with pytest.raises(search.PlanError, match="plan.fixed='sequence:2'"):
        search.parse_fixed("sequence:2", 8)
    with pytest.raises(search.PlanError, match="does not divide"):
        search.parse_fixed("tensor:3", 8)
    cfg = models.from_dict({"preset": "7b"})
    small = dataclasses.replace(T.get_topology("dgx-a100-40gb"), hosts=1, devices_per_host=1)
    with pytest.raises(search.PlanError, match="fits nowhere"):
        search.check_fits(search.search(cfg, 8, small, {}), small)


def test_a_mesh_override_pins_the_layout_unless_plan_auto_is_given():
    config = tiny_experiment()
    assert config.plan.auto
    pin_layout_if_mesh_given(config, {"train.steps": 3})
    assert config.plan.auto
    pin_layout_if_mesh_given(config, {"mesh.tensor": 2, "mesh.data": 4})
    assert not config.plan.auto
    config.plan.auto = True
    pin_layout_if_mesh_given(config, {"mesh.tensor": 2, "plan.auto": True})
    assert config.plan.auto


def test_mtbf_hours_sets_the_time_interval_capped_by_every_minutes():
    from checkpoint import SavePolicy
    policy = SavePolicy(every_minutes=600.0, mtbf_hours=10.0)
    assert policy.interval_s(None) == 600.0 * 60  # no save measured yet: every_minutes
    assert policy.interval_s(5.0) == pytest.approx(cadence.optimal_interval_s(5.0, 36000.0))
    assert policy.time_due(cadence.optimal_interval_s(5.0, 36000.0) + 1, 5.0)
    assert not policy.time_due(cadence.optimal_interval_s(5.0, 36000.0) - 1, 5.0)
    assert SavePolicy(every_minutes=1.0, mtbf_hours=10.0).interval_s(5.0) == 60.0  # the cap wins
    assert SavePolicy(every_minutes=10.0).interval_s(5.0) == 600.0  # mtbf_hours=0: unchanged
