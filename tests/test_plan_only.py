"""Below __main__ the settings come from the Plan: once the run is set up (resolved, compiled, resumed),
the loop, its actions, the saver and the trainer run with the raw config hidden."""
import json

import numpy as np
import pytest

from tests.helpers import run_steps, tiny_config
from train import loop
from train.trainer import Trainer


class HiddenConfig:
    """Stands in for trainer.config: any read fails the test, naming the setting."""

    def __getattr__(self, name):
        raise AssertionError(f"config.{name} was read after resolution; read trainer.plan instead")

    def __getitem__(self, name):
        raise AssertionError(f"config[{name!r}] was read after resolution; read trainer.plan instead")


def plan_only_config():
    config = tiny_config(data=8)
    config.model.update(d_model=32, n_layers=2, n_heads=2)
    config.train.update(steps=4, global_batch_size=8, log_every=2, eval_every=2, eval_batches=1)
    config.optimizer.warmup_steps = 1
    config.checkpoint.update(every_minutes=0.0, every_steps=2)
    return config


def test_the_loop_runs_on_the_plan_alone(tmp_path, monkeypatch):
    scheduler = loop.Scheduler

    def hide_config(services, begin, user_actions):
        services.trainer.config = HiddenConfig()
        return scheduler(services, begin, user_actions)

    monkeypatch.setattr(loop, "Scheduler", hide_config)
    loop.run(plan_only_config(), str(tmp_path / "run"))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(evals) == [2, 4] and all(np.isfinite(list(evals.values())))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
    reference, _ = run_steps(Trainer.build(plan_only_config()), 4)  # the same steps, config in sight
    assert [losses[2], losses[4]] == pytest.approx([reference[1], reference[3]], rel=1e-5)
