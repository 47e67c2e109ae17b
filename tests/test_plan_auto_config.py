"""With plan.auto=True, the config a run writes to config.json carries the layout the planner chose, and the
tools that read config.json back (train.sample, train.export_hf) use that layout instead of planning again."""
import json

from experiments.tiny import get_config
from mesh.layout import axis_sizes
from train import config as run_config
from train.planner import auto as planner_auto
from train.trainer import Trainer


def test_config_json_of_an_auto_run_holds_the_mesh_it_used(tmp_path):
    config = get_config()
    config.data.source = "synthetic"
    config.plan.auto = True
    assert config.mesh.data == -1  # the user's mesh is not what runs
    trainer = Trainer.build(planner_auto.apply(config, 8), 8)  # as train/loop/runner.py does
    used = axis_sizes(trainer.mesh)
    assert trainer.config.mesh.to_dict() == used  # loop._compile writes trainer.config to config.json
    (tmp_path / "config.json").write_text(json.dumps({"config": trainer.config.to_dict()}))
    loaded = run_config.load_run_config(tmp_path)
    assert loaded.plan.auto is False and loaded.mesh.to_dict() == used
    again = Trainer.build(loaded, 8)
    assert axis_sizes(again.mesh) == used and again.plan.rules == trainer.plan.rules
