"""The shipped GPU workloads compile on CPU: each experiment file, shrunk to a few layers of its own family, is
planned for the 8 virtual devices (plan.auto, as on a GPU machine) and compiled (`--compile_only`)."""
from __future__ import annotations

import importlib
import json
import math

import pytest

from train.loop import runner as loop

SMALL = dict(d_model=64, n_layers=2, n_heads=4, seq_len=32, vocab_size=256)
LLAMA = dict(SMALL, n_kv_heads=2, d_mlp=128)
WORKLOADS = {"gpt2_124m": SMALL, "llama3_2_1b": LLAMA, "llama3_1_8b": LLAMA, "llama3_1_70b": LLAMA}


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_compiles_on_its_planned_layout(name, tmp_path):
    config = importlib.import_module(f"experiments.{name}").get_config()
    assert config.plan.auto, "a workload leaves the layout to the planner"
    config.model.update(WORKLOADS[name])
    config.data.update(source="synthetic", document_mask=False)  # no prepared corpus here
    config.checkpoint.restore_from = ""  # nor Meta's weights
    loop.run(config, str(tmp_path / "run"), compile_only=True)
    report = json.loads((tmp_path / "run" / "compile_report.json").read_text())
    assert report["memory_per_device"]["peak_bytes"] > 0
    assert math.prod(report["mesh"].values()) == 8  # every device, in the planner's layout
    assert not (tmp_path / "run" / "config.json").exists()  # a what-if compile leaves no run behind
