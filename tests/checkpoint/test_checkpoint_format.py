"""Checkpoints written before the checkpoint format moved into checkpoint/format.py still restore:
the fixture was written by commit 604b7c2 (tests/fixtures/checkpoint_604b7c2/README.md)."""
import shutil

import jax
import numpy as np

import checkpoint
from checkpoint import format as ckpt_format
from checkpoint import plain
from experiments.tiny import get_config
from tests.helpers import ROOT
from train.loop import resume
from train.trainer import Trainer

FIXTURE = ROOT / "tests" / "fixtures" / "checkpoint_604b7c2"


def fixture_config():
    """The settings of the run that wrote the fixture (its README has the command)."""
    config = get_config()
    config.model.update(d_model=16, n_layers=2, n_heads=2)
    config.train.update(steps=3, global_batch_size=8, eval_every=0, log_every=1)
    config.data.source = "synthetic"
    config.checkpoint.every_steps = 3
    return config


def test_a_checkpoint_from_before_the_change_resumes_bit_for_bit(tmp_path):
    shutil.copytree(FIXTURE / "checkpoints", tmp_path / "checkpoints")
    config = fixture_config()
    config.train.steps = 4  # the run continues past its saved step
    trainer = Trainer.build(config)
    begin = resume.start(trainer, checkpoint.Checkpoints(tmp_path / "checkpoints"), print)
    assert begin.resumed and begin.step == 3
    expected = np.load(FIXTURE / "expected_arrays.npz")
    saved = plain.flatten(ckpt_format.to_tree(trainer, begin.state, begin.rng))
    assert sorted(saved) == sorted(expected.files)
    for name, value in saved.items():
        np.testing.assert_array_equal(np.asarray(jax.device_get(value)), expected[name], err_msg=name)
    assert int(begin.state["step"]) == 3
