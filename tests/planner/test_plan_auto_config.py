"""With plan.auto=True, the config a run writes to config.json carries the layout the planner chose, and the
tools that read config.json back (train.sample, train.export_hf) use that layout instead of planning again."""
import json

import numpy as np
import pytest

from experiments.tiny import get_config
from mesh.layout import axis_sizes
from tests.helpers import run_steps
from train.config import experiment as run_config
from train.plan import auto as planner_auto
from train.trainer import Trainer


def test_config_json_of_an_auto_run_holds_the_mesh_it_used(tmp_path):
    config = get_config()
    config.data.source = "synthetic"
    config.plan.auto = True
    assert config.mesh.data == -1  # the user's mesh is not what runs
    trainer = Trainer.build(planner_auto.apply(config, 8)[0], 8)  # as train/loop/runner.py does
    used = axis_sizes(trainer.mesh)
    assert trainer.config.mesh.to_dict() == used  # loop._compile writes trainer.config to config.json
    (tmp_path / "config.json").write_text(json.dumps({"config": trainer.config.to_dict()}))
    loaded = run_config.load_run_config(tmp_path)
    assert loaded.plan.auto is False and loaded.mesh.to_dict() == used
    again = Trainer.build(loaded, 8)
    assert axis_sizes(again.mesh) == used and again.plan.rules == trainer.plan.rules


def test_a_continued_run_keeps_the_layout_it_chose(monkeypatch):
    config = get_config()
    record = {"devices": 8, "fixed": "", "chosen": {"mesh": dict(data=2, pipeline=2, fsdp=1, expert=1, context=1,
                                                                   tensor=2),
                                                    "schedule": "1f1b", "microbatches": 4, "virtual_stages": 1,
                                                    "remat": "full", "shard_opt_state": True, "grad_accum_steps": 2}}
    monkeypatch.setattr(planner_auto, "choose", lambda *a: pytest.fail("planned again"))
    kept, again = planner_auto.apply(config, 8, {"plan": record})
    assert again is record and kept.mesh.to_dict() == record["chosen"]["mesh"]
    assert (kept.model.remat, kept.train.grad_accum_steps, kept.pipeline.microbatches) == ("full", 2, 4)
    monkeypatch.undo()
    for other in ({**record, "devices": 4}, {**record, "fixed": "tensor:2"}):  # another cluster or request: plan
        assert planner_auto.apply(config, 8, {"plan": other})[1] is not other


@pytest.mark.parametrize("preset,counts", [("llama3-tiny", (2, 4, 8)), ("moe-tiny", (8,))])
def test_plan_auto_trains_on_one_two_four_and_eight_devices(preset, counts):
    """The planner lays the model out on each device count a user may have (here the first n of the 8 virtual
    devices, as `python -m train` does with the devices it finds) and every layout trains like one device
    (moe-tiny on 8 only: the planner gives this shrunk mixture data parallelism on 2, 4 and 8 alike)."""
    config = get_config()
    config.data.source = "synthetic"
    config.plan.auto = True
    config.model.update(preset=preset, d_model=32, n_layers=2, seq_len=16)
    config.train.global_batch_size = 8
    losses = {}
    for n in (1, *counts):
        planned, record = planner_auto.apply(config, n)
        trainer = Trainer.build(planned, n)
        assert axis_sizes(trainer.mesh) == record["chosen"]["mesh"]
        losses[n], _ = run_steps(trainer, 2)
    assert np.isfinite(losses[1]).all()
    for n in counts:
        np.testing.assert_allclose(losses[n], losses[1], rtol=1e-4, err_msg=f"{n} devices")
