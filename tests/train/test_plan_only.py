"""Below __main__ the settings come from the Plan: once Trainer.build has resolved the config, the trainer,
resume (restore_from included), the loop, its actions and the saver run with the raw config hidden; only
its whole record (to_dict) is read, for config.json and checkpoint meta."""
import json

import numpy as np
import pytest

from tests.helpers import run_steps, tiny_config
from train.loop import runner as loop
from train.trainer import Trainer


class HiddenConfig:
    """Stands in for trainer.config: any read of a setting fails the test, naming it; the whole record
    (to_dict, what config.json and checkpoint meta write) is the one thing allowed."""

    def __init__(self, config):
        self._record = config.to_dict()

    def to_dict(self):
        return self._record

    def __getattr__(self, name):
        raise AssertionError(f"config.{name} was read after resolution; read trainer.plan instead")

    def __getitem__(self, name):
        raise AssertionError(f"config[{name!r}] was read after resolution; read trainer.plan instead")


def plan_only_config():
    config = tiny_config(data=8)
    config.model.update(d_model=32, n_layers=2, n_heads=2)
    config.train.update(steps=4, global_batch_size=8, log_every=1, eval_every=2, eval_batches=1)
    config.optimizer.warmup_steps = 1
    config.checkpoint.update(every_minutes=0.0, every_steps=2)
    return config


@pytest.fixture
def hidden_after_build(monkeypatch):
    """Trainer.build resolves the config, then hides it from everything after."""
    build = Trainer.build.__func__

    def build_then_hide(cls, config, num_devices=None):
        trainer = build(cls, config, num_devices)
        trainer.config = HiddenConfig(trainer.config)
        return trainer

    monkeypatch.setattr(Trainer, "build", classmethod(build_then_hide))


def losses_of(workdir):
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return ({r["step"]: r["loss"] for r in records if "loss" in r},
            {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r})


def test_the_loop_runs_on_the_plan_alone(tmp_path, hidden_after_build):
    loop.run(plan_only_config(), str(tmp_path / "run"))
    losses, evals = losses_of(tmp_path / "run")
    assert sorted(evals) == [2, 4] and all(np.isfinite(list(evals.values())))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
    reference, _ = run_steps(Trainer.build(plan_only_config()), 4)  # the same steps, built the same way
    assert [losses[2], losses[4]] == pytest.approx([reference[1], reference[3]], rel=1e-5)
    # checkpoint.restore_from, read from the plan: another run starts from step 2 and replays steps 3 and 4.
    config = plan_only_config()
    config.checkpoint.restore_from = f"{tmp_path / 'run'}:2"
    loop.run(config, str(tmp_path / "restored"))
    restored, _ = losses_of(tmp_path / "restored")
    assert sorted(restored) == [3, 4] and [restored[3], restored[4]] == [losses[3], losses[4]]
    meta = json.loads((tmp_path / "restored" / "checkpoints" / "4" / "meta" / "metadata").read_text())
    assert meta["config"]["checkpoint"]["restore_from"] == config.checkpoint.restore_from
