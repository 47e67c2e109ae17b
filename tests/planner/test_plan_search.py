"""The planner's search space: every microbatch count the schedules allow, the expert and context axes where they
apply, layouts the model cannot divide skipped and counted, and plan.fixed pinning any searched dimension.
Nothing is compiled: each planned layout is checked against the run's own validation
(train.config.experiment.resolve)."""
import dataclasses

import pytest

import models
from mesh import topology as T
from tests.helpers import tiny_config
from train.config import experiment as run_config
from train.plan import fixed as fixed_lib
from train.plan import search

CPU8 = dataclasses.replace(T.get_topology("dgx-h100"), hosts=1, devices_per_host=8)


def _model(preset: str, **fields) -> models.ModelConfig:
    return models.from_dict({"preset": preset, **fields})


def test_every_microbatch_count_the_schedule_allows():
    """16 stages and 144 rows per replica: 1F1B takes every divisor from 16 up, microbatch size 1 included."""
    options = search.pipeline_options(16, 32, 144)
    one_f_one_b = sorted(m for name, m, _ in options if name == "1f1b")
    assert one_f_one_b == [16, 18, 24, 36, 48, 72, 144]
    assert sorted(m for name, m, v in options if name == "interleaved" and v == 2) == [16, 48, 144]
    assert {m for name, m, _ in options if name == "gpipe"} == {d for d in range(1, 145) if 144 % d == 0}
    ranked = search.search(_model("tiny"), 16, CPU8, {"pipeline": 4, "data": 2})
    assert {p.candidate.microbatches for p in ranked if p.candidate.schedule == "1f1b"} == {4, 8}
    assert any(p.candidate.microbatches == 8 and p.candidate.grad_accum_steps == 1 for p in ranked)  # 1 row each


def test_impossible_layouts_are_skipped_and_counted():
    ranked, skipped = search.explore(_model("llama3-tiny"), 16, CPU8, {})
    assert skipped == {"heads not divisible by tensor=8": 1}
    assert ranked[0].fits and all(p.candidate.sizes["tensor"] < 8 for p in ranked)
    ranked, skipped = search.explore(_model("moe-tiny"), 16, CPU8, {})
    assert set(skipped) == {"layers not divisible by pipeline=4", "layers not divisible by pipeline=8"}  # 2 groups
    assert any(p.fits and p.candidate.sizes["pipeline"] > 1 and p.candidate.sizes["expert"] > 1
               for p in ranked)  # expert parallelism inside pipelines
    assert any(p.fits and p.candidate.sizes["expert"] > 1 for p in ranked)  # experts are searched
    assert any(p.candidate.sizes["expert"] > 1 and p.candidate.sizes["fsdp"] > 1 for p in ranked)  # with fsdp
    with pytest.raises(search.PlanError, match=r"skipped: layers not divisible by pipeline=4\); change"):
        search.explore(_model("moe-tiny"), 16, CPU8, {"pipeline": 4})


@pytest.mark.parametrize("preset,fixed", [("llama3-tiny", {}), ("moe-tiny", {}), ("moe-tiny", {"context": 2})])
def test_every_planned_layout_passes_the_runs_validation(preset, fixed):
    """The skip rules mirror train.config: each searched layout resolves as a run would (one per pipeline shape);
    a mixture under context splits each microbatch's rows over it, in a pipeline too."""
    config = tiny_config()
    config.model.preset = preset
    ranked = search.search(models.from_dict(config.model.to_dict()), 16, CPU8, fixed)
    shapes = {(p.candidate.mesh, p.candidate.schedule, p.candidate.microbatches, p.candidate.virtual_stages,
               p.candidate.grad_accum_steps): p.candidate for p in ranked}
    for c in shapes.values():
        run = tiny_config()
        run.model.preset = preset
        run.mesh.update(c.sizes)
        run.sharding.strategy = "fsdp_tensor"
        run.train.grad_accum_steps = c.grad_accum_steps
        run.pipeline.update(schedule=c.schedule if c.schedule != "none" else "1f1b", microbatches=c.microbatches,
                            virtual_stages=c.virtual_stages)
        run_config.resolve(run, 8, "cpu")


def test_context_is_searched_for_long_sequences_or_when_pinned():
    short, long = _model("llama3-tiny"), _model("llama3-tiny", seq_len=4096)
    assert "context" not in search.searched_axes(short) and "context" in search.searched_axes(long)
    ranked = search.search(long, 8, CPU8, {})
    assert any(p.fits and p.candidate.sizes["context"] > 1 for p in ranked)
    assert any(p.fits and p.candidate.sizes["context"] > 1 and p.candidate.sizes["pipeline"] > 1 for p in ranked)
    pinned = search.search(short, 16, CPU8, {"context": 2})
    assert pinned and all(p.candidate.sizes["context"] == 2 for p in pinned)


def test_plan_fixed_pins_every_searched_dimension():
    text = ("tensor:2,pipeline:2,remat:full,schedule:interleaved,virtual_stages:2,microbatch_size:1,"
            "shard_opt_state:true,grad_accum_steps:2")
    fixed = fixed_lib.parse(text, 8)
    assert fixed == {"tensor": 2, "pipeline": 2, "remat": "full", "schedule": "interleaved", "virtual_stages": 2,
                     "microbatch_size": 1, "shard_opt_state": True, "grad_accum_steps": 2}
    ranked = search.search(_model("tiny"), 16, CPU8, fixed)
    assert ranked
    for p in ranked:
        c = p.candidate
        assert (c.sizes["tensor"], c.sizes["pipeline"], c.remat, c.schedule, c.virtual_stages) == \
            (2, 2, "full", "interleaved", 2)
        assert c.shard_opt_state and c.grad_accum_steps == 2 and c.sizes["data"] == 2
        assert c.microbatches == 16 // (2 * 2)  # one row per microbatch: 16 rows over data x accumulation
    assert {p.candidate.microbatches for p in search.search(_model("tiny"), 16, CPU8, {"microbatches": 8})} == {8}


@pytest.mark.parametrize("text, message", [
    ("sequence:2", "'sequence' is not a searched dimension"),
    ("remat:some", "remat:some is not one of none|save_dots|full"),
    ("schedule:zb", "schedule:zb is not one of none|gpipe|1f1b|interleaved"),
    ("shard_opt_state:maybe", "shard_opt_state:maybe is not one of true|false"),
    ("microbatch_size:0", "microbatch_size:0 is not a positive integer"),
    ("tensor", "'tensor' is not NAME:VALUE"),
    ("tensor:3", "tensor=3 does not divide the 8 devices"),
])
def test_plan_fixed_bad_names_and_values_are_one_line(text, message):
    with pytest.raises(search.PlanError, match=message) as e:
        fixed_lib.parse(text, 8)
    assert f"plan.fixed={text!r}" in str(e.value) and "\n" not in str(e.value)
