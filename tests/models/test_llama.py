"""The Llama-3 family: published preset sizes, layouts and a pipeline that train as one device does, the
audit's rows at 1.00, and grouped-query heads that a tensor split must divide."""
import functools

import numpy as np
import pytest

import models
from tests.helpers import compiled_step, grads_and_run, rel_norm, run_cli, tiny_config
from train.config import experiment as config_lib
from train.plan import audit as audit_lib
from train.plan import compile_report as report
from train.trainer import Trainer

STEPS = 3
PLAIN = (("data", 2), ("tensor", 4))
PIPELINED = (("pipeline", 2), ("data", 2), ("tensor", 2))


def _config(layout=()):
    config = tiny_config(**dict(layout))
    config.model.preset = "llama3-tiny"
    config.model.update(n_layers=4, seq_len=32)
    config.train.global_batch_size = 8
    return config


@functools.lru_cache(maxsize=None)
def _reference():
    trainer = Trainer.build(_config(), num_devices=1)
    grads, losses, _ = grads_and_run(trainer, STEPS)
    return losses, grads


@functools.lru_cache(maxsize=None)
def _trainer(layout) -> Trainer:
    return Trainer.build(_config(layout))


def test_presets_have_the_published_sizes():
    billions = {name: models.param_count(models.from_dict({"preset": name})) / 1e9
                for name in ("llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "llama3.1-70b")}
    # Model cards: 1.24B, 3.21B, 8.03B, 70.6B parameters.
    np.testing.assert_allclose(list(billions.values()), [1.236, 3.213, 8.030, 70.554], rtol=1e-3)
    tiny = models.from_dict({"preset": "llama3-tiny"})
    assert "head" not in models.init_params(tiny, 0) and tiny.norm_eps == 1e-5


@pytest.mark.parametrize("layout", [PLAIN, PIPELINED], ids=["data2_tensor4", "pipeline2_data2_tensor2"])
def test_layout_matches_single_device(layout):
    ref_losses, ref_grads = _reference()
    trainer = _trainer(layout)
    grads, losses, _ = grads_and_run(trainer, STEPS)
    assert rel_norm(grads, ref_grads) < 1e-5
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)


@pytest.mark.parametrize("layout", [PLAIN, PIPELINED], ids=["data2_tensor4", "pipeline2_data2_tensor2"])
def test_audit_rows_read_one(layout):
    trainer = _trainer(layout)  # the equivalence test's program (compiled_step)
    result = audit_lib.audit(trainer, report.build(trainer.plan, trainer.mesh, compiled_step(trainer)), "",
                             topology="dgx-h100", hosts=16, mfu=0.4)
    rows = [r for r in result["rows"] if r["purpose"] != "scalars (loss, norms)"]
    assert "activation all-reduce (Megatron)" in [r["purpose"] for r in rows]
    for row in rows:
        assert row["ratio"] is not None and abs(row["ratio"] - 1) <= 0.05, row


def test_tensor_split_must_divide_kv_heads():
    config = _config((("data", 1), ("tensor", 8)))
    with pytest.raises(config_lib.ConfigError, match=r"^model.n_kv_heads=4 is not divisible by mesh axes tensor=8"):
        config_lib.resolve(config, 8)


def test_sample_and_export_name_a_bad_workdir_in_one_line(tmp_path):
    for module, extra in (("train.sample", ["--prompt=hi"]), ("train.export_hf", [f"--out={tmp_path / 'out'}"])):
        out = run_cli(f"--workdir={tmp_path}", *extra, module=module, timeout=120)
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().splitlines() == [f"error: --workdir={tmp_path}: no config.json there; give the "
                                                   f"directory of a training run"], out.stderr
    assert list(tmp_path.iterdir()) == []
