"""LoRA fine-tuning of Hugging Face weights on data x tensor: adapters start as the identity, only they hold optimizer
state, the loss falls, checkpoints hold only the adapters (the base is read again from hf:), and the merged export
gives the adapted model's logits in transformers."""
import dataclasses
import functools
import json

import jax
import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the `hf` extra (transformers, torch) is not installed")

import checkpoint  # noqa: E402
import models  # noqa: E402
from models import lora  # noqa: E402
from tests.helpers import losses  # noqa: E402
from tests.hf_models import TOKENS, hf_logits, llama_import_config  # noqa: E402
from train.export_hf import command as export_hf  # noqa: E402
from train.hf import export as hf_export  # noqa: E402
from train.loop import runner as loop  # noqa: E402
from train.plan import candidate, memory  # noqa: E402
from train.trainer import Trainer  # noqa: E402

STEPS = 3


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@functools.partial(jax.jit, static_argnums=1)
def _logits(params, cfg):
    return models.forward(params, TOKENS, cfg)


def _config(hf_llama, **mesh):
    config = llama_import_config(**mesh)
    config.model.update(lora_rank=4, lora_alpha=8.0, lora_targets="q,k,v,o,mlp")
    config.checkpoint.restore_from = f"hf:{hf_llama}"
    config.data.source = "text"  # bytes of Python's own sources: the loss falls within a few steps
    config.train.update(steps=STEPS, global_batch_size=8, eval_batches=0, log_every=1, loggers="")
    config.optimizer.update(lr=3e-2, warmup_steps=1, decay_steps=50)
    return config


@pytest.fixture(scope="module")
def run(hf_llama, tmp_path_factory):
    """A LoRA run on data x tensor = 4 x 2 from the Hugging Face base: its workdir."""
    workdir = tmp_path_factory.mktemp("lora") / "run"
    loop.run(_config(hf_llama, data=4, tensor=2), str(workdir))
    return workdir


@pytest.fixture(scope="module")
def restored(run):
    """The run's newest checkpoint as export reads it: (model config, params: the base from hf:, the adapters)."""
    cfg, params, step = export_hf.restore_params(run, None)
    assert step == STEPS
    return cfg, params


def test_adapters_start_as_the_identity(restored):
    cfg, params = restored
    assert set(params["layers"][lora.KEY]) == {"q", "k", "v", "o", "mlp_in", "mlp_out"}
    zero_b = jax.tree_util.tree_map_with_path(lambda path, x: 0 * x if path[-1].key == "b" else x, params)
    base = {**params, "layers": {k: v for k, v in params["layers"].items() if k != lora.KEY}}
    np.testing.assert_array_equal(_logits(zero_b, cfg), _logits(base, dataclasses.replace(cfg, lora_rank=0)))


def test_training_lowers_the_loss_and_only_adapters_hold_optimizer_state(run, hf_llama):
    logged = list(losses(run).values())
    assert len(logged) == STEPS and logged[-1] < logged[0] - 0.1, logged
    config = _config(hf_llama, data=4, tensor=2)
    config.data.source = "synthetic"
    trainer = Trainer.build(config)  # shapes only: nothing compiled
    abstract = trainer.layout.abstract_state
    moments = [x for x in jax.tree.leaves(abstract["opt_state"]) if x.ndim]
    assert _nbytes(moments) == 2 * _nbytes(abstract["params"]["layers"][lora.KEY])  # Adam's mu and nu
    assert _nbytes(abstract["opt_state"]) - _nbytes(moments) <= 16  # the step counters
    one_device = candidate.mesh_of({a: 1 for a in trainer.plan.mesh_sizes})
    assert memory.state_bytes(trainer.plan.model, one_device, False)[1] == _nbytes(moments)  # the planner agrees


def test_checkpoint_holds_adapters_and_names_the_base(run, hf_llama):
    ckpts = checkpoint.Checkpoints(run / "checkpoints", read_only=True)
    meta = ckpts.read_meta(STEPS)
    params = [k for k in meta["arrays"] if k.startswith("params/")]
    assert params and all(k.startswith("params/layers/lora/") for k in params)
    assert meta["config"]["checkpoint"]["restore_from"] == f"hf:{hf_llama}"


def test_merged_export_gives_the_adapted_logits_in_transformers(run, restored, hf_llama, tmp_path):
    with pytest.raises(export_hf.ExportError, match="add --merge_lora"):
        export_hf._check_exportable(run, export_hf.run_model(run)[1], False)
    cfg, params = restored
    adapted = np.asarray(_logits(params, cfg))
    base_cfg, merged = hf_export.merged(cfg, params)
    hf_export.write(tmp_path / "out", base_cfg, merged, "float32", None)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_hidden_layers"] == cfg.n_layers
    assert np.abs(adapted - hf_logits(hf_llama)).max() > 1e-2  # the adapters changed the model
    np.testing.assert_allclose(hf_logits(tmp_path / "out"), adapted, atol=1e-4, rtol=0)
