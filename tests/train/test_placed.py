"""A model placed on a mesh (train/placed.py): llama3.1-8b placed abstractly holds no arrays and builds no optimizer;
train.sample and train.eval lower no training step; a run's checkpoint, a LoRA run (adapters kept or merged) and an
hf: directory place as the arrays that were saved or written."""
import json

import jax
import numpy as np
import pytest

import checkpoint
import models
from checkpoint import format as ckpt_format
from models import lora
from tests.helpers import tiny_config
from train import placed as placed_lib
from train import state as state_lib
from train import step as step_lib
from train.eval import load as eval_load
from train.export_hf import command as export_hf
from train.hf import export as hf_export
from train.loop import resume, saver
from train.sample import command as sample_lib
from train.trainer import Trainer

LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # jax.monitoring: once per program lowered


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _assert_same(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(_host(got)), jax.tree.leaves(_host(want))):
        np.testing.assert_array_equal(a, b)


def _no_optimizer(monkeypatch):
    """Building an optimizer or a training step fails the test."""
    def refuse(*_, **__):
        raise AssertionError("an optimizer or a training step was built")
    for module, name in ((state_lib, "make_optimizer"), (step_lib, "make_train_step"), (state_lib, "plan_layout")):
        monkeypatch.setattr(module, name, refuse)


def _save_run(workdir, trainer, state):
    """A workdir as training leaves it: config.json and a checkpoint of step 2 holding `state`."""
    workdir.mkdir(exist_ok=True)
    ckpts = checkpoint.Checkpoints(workdir / "checkpoints")
    ckpts.save(2, ckpt_format.to_tree(trainer, state, ckpt_format.rng_of(0, trainer.mesh)),
               saver.describe_run(trainer))
    ckpts.wait()
    ckpts.close()
    (workdir / "config.json").write_text(json.dumps({"config": saver.recorded_config(trainer)}))


def _llama(**mesh):
    config = tiny_config(**mesh)
    config.model.update(preset="llama3-tiny", n_layers=2, tie_embeddings=False)
    config.train.loggers = ""
    return config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A llama3-tiny run on data x tensor = 2 x 2, its params perturbed from the initialization: (workdir,
    trainer, the saved params)."""
    workdir = tmp_path_factory.mktemp("placed") / "run"
    trainer = Trainer.build(_llama(data=2, tensor=2), num_devices=4)
    state = trainer.init_state()
    state["params"] = jax.tree.map(lambda x: x + 0.01, state["params"])
    _save_run(workdir, trainer, state)
    return workdir, trainer, _host(state["params"])


def test_llama8b_placed_abstractly_holds_no_arrays_and_no_optimizer(monkeypatch):
    _no_optimizer(monkeypatch)
    config = tiny_config(fsdp=4, tensor=2)
    config.model.preset = "llama3.1-8b"
    before = {id(a): a for a in jax.live_arrays()}  # held, so no id is reused; earlier tests' garbage may go meanwhile
    placed = placed_lib.place(config, num_devices=8)
    assert placed.params is None and [a for a in jax.live_arrays() if id(a) not in before] == []
    leaves = jax.tree.leaves(placed.abstract_params)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(x.size for x in leaves) == models.param_count(placed.model) > 8e9
    wqkv = placed.abstract_params["layers"]["wqkv"]
    assert wqkv.sharding.shard_shape(wqkv.shape)[0] == wqkv.shape[0]  # layers stay whole
    assert np.prod(wqkv.shape) // np.prod(wqkv.sharding.shard_shape(wqkv.shape)) == 8


def test_sample_and_eval_lower_no_training_step(run, monkeypatch):
    workdir, trainer, saved = run
    lowered = []

    def listen(event, _, **kw):
        if event == LOWERED:
            lowered.append(kw.get("fun_name"))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        trainer.train_step.lower(trainer.layout.abstract_state, trainer.abstract_batch())
        train_step = lowered[-1]  # the detector sees a training step when one is lowered
        del lowered[:]
        _no_optimizer(monkeypatch)
        request = sample_lib.Request(prompt_tokens="1,2,3", max_new=2, as_json=True)
        text = sample_lib.sample(workdir, None, request, mesh={"data": 4})
        scored = sample_lib.sample(workdir, 2, sample_lib.Request(eval_batches=1), mesh={"data": 4})
        loaded = eval_load.load_run(workdir, None, 2, {"data": 2}, num_devices=4)
        [(loglikelihood, _)] = loaded.scorer.loglikelihood([[1, 2, 3]], [4])
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert train_step == "jit(step)" and train_step not in lowered, sorted(set(lowered))
    sampled = json.loads(text)
    assert sampled["prompt_tokens"] == [1, 2, 3] and len(sampled["tokens"]) == 2, sampled
    assert scored.startswith("step 2: held-out loss"), scored
    assert loaded.step == 2 and np.isfinite(loglikelihood)


def test_a_run_places_as_saved(run):
    workdir, _, saved = run
    placed = placed_lib.from_run(workdir, mesh={"data": 1, "tensor": 2}, num_devices=2)
    assert placed.step == 2 and placed.mesh.shape["tensor"] == 2 and not placed.codec.from_run
    _assert_same(placed.params, saved)
    _, exported, step = export_hf.restore_params(workdir, 2)  # what train.export_hf reads, on one device
    assert step == 2
    _assert_same(exported, saved)


@pytest.fixture(scope="module")
def hf_dir(run, tmp_path_factory):
    """The run's saved params written as a Hugging Face directory by train.export_hf."""
    workdir, trainer, saved = run
    out = tmp_path_factory.mktemp("placed_hf") / "hf"
    hf_export.write(out, trainer.plan.model, saved, "float32")
    return out


def test_an_hf_directory_places_as_written(run, hf_dir):
    _, _, saved = run
    placed = placed_lib.from_hf(placed_lib.place(_llama(tensor=2), num_devices=2), f"hf:{hf_dir}")
    _assert_same(placed.params, saved)


def test_a_lora_run_places_with_adapters_kept_or_merged(run, hf_dir, tmp_path):
    _, _, saved = run
    config = _llama(data=2)
    config.model.update(lora_rank=2, lora_alpha=4.0)
    config.checkpoint.restore_from = f"hf:{hf_dir}"
    trainer = Trainer.build(config, num_devices=2)
    empty = checkpoint.Checkpoints(tmp_path / "none", read_only=True)
    state = resume.start(trainer, empty, lambda _: None).state  # as a LoRA run starts: the base from hf:
    adapters = state["params"]["layers"][lora.KEY]
    state["params"]["layers"][lora.KEY] = jax.tree.map(lambda x: x + 0.02, adapters)  # b starts at zero
    _save_run(tmp_path / "run", trainer, state)
    want = _host(state["params"])
    kept = placed_lib.from_run(tmp_path / "run", num_devices=2)
    _assert_same(kept.params, want)
    _assert_same({**want, "layers": {k: v for k, v in want["layers"].items() if k != lora.KEY}}, saved)  # hf: base
    merged = placed_lib.from_run(tmp_path / "run", lora="merge", num_devices=2)
    assert merged.model.lora_rank == 0 and lora.KEY not in merged.params["layers"]
    _assert_same(merged.params, lora.merge(want, trainer.plan.model,
                                           models.family_of(trainer.plan.model).forward.lora_projections(trainer.plan.model)))
