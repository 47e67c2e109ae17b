"""Packed documents (data.document_mask): attention, rotary positions and the loss stop at each EOS, a document
packed after another scores as it does alone, and every layout normalizes by the global batch's counted targets."""
import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest

import models
from models import documents
from tests.helpers import DOCUMENT_EOS, documents_config, documents_datadir, rel_norm, tiny_config
from train.config.experiment import ConfigError, resolve
from train.trainer import Trainer

EOS = DOCUMENT_EOS


def test_segments_and_positions_restart_after_each_eos():
    cfg = models.GPTConfig(document_eos_id=EOS)
    segment_ids, positions = documents.segments(np.array([[5, 7, EOS, 3, EOS, EOS, 9]]), cfg)
    np.testing.assert_array_equal(segment_ids, [[0, 0, 0, 1, 1, 2, 3]])
    np.testing.assert_array_equal(positions, [[0, 1, 2, 0, 1, 0, 0]])
    assert documents.segments(np.zeros((1, 3), int), models.GPTConfig()) == (None, None)


SMALL = {"gpt": models.GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4),
         "llama": models.LlamaConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                     d_mlp=64)}


@functools.lru_cache(maxsize=None)
def _token_losses(family: str, eos_id: int):
    """Per-token float32 losses [2, 16] of a row packing a 5-token document before a 12-token one, and of a
    row holding the 12-token document alone (then 5 tokens of another), and the model's mean loss."""
    cfg = dataclasses.replace(SMALL[family], document_eos_id=eos_id).validate()
    rng = np.random.default_rng(0)
    first, second, after = (rng.integers(1, 64, n) for n in (4, 12, 5))
    rows = np.stack([np.concatenate([first, [EOS], second]), np.concatenate([second, after])])
    params = models.init_params(cfg, 0)
    logits = models.forward(params, rows[:, :-1], cfg)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, rows[:, 1:])
    return rows, np.asarray(losses), float(models.loss(params, rows, cfg))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_packed_document_scores_as_it_does_alone(family):
    rows, losses, mean = _token_losses(family, EOS)
    np.testing.assert_allclose(losses[0, 5:], losses[1, :11], rtol=1e-5, atol=1e-5)
    counted = rows[:, :-1] != EOS  # the target after the EOS input (the second document's first token) is out
    assert counted.sum() == 2 * 16 - 1
    np.testing.assert_allclose(mean, losses[counted].mean(), rtol=1e-6)
    _, unmasked, _ = _token_losses(family, -1)
    assert np.abs(unmasked[0, 5:] - unmasked[1, :11]).max() > 1e-3


def _loss_and_grads(trainer: Trainer, batch):
    params = trainer.init_state()["params"]
    return jax.device_get(jax.jit(trainer.loss_and_grad)(params, batch))


def test_masked_loss_is_the_global_mean_in_every_layout(tmp_path):
    """Gradient accumulation on data x tensor and a pipeline (4 microbatches, data x tensor with sequence
    parallelism inside) give the single device's loss and gradients, though slices and microbatches hold different
    numbers of documents."""
    path = documents_datadir(tmp_path / "data")
    one = Trainer.build(documents_config(path), num_devices=1)
    assert one.plan.model.document_eos_id == EOS
    batch = np.asarray(one.batch(0))
    counts = (batch[:, :-1] != EOS).reshape(4, 4, -1).sum(axis=(1, 2))
    assert len(set(counts.tolist())) > 1  # unequal parts: an unweighted average would be off
    ref_loss, ref_grads = _loss_and_grads(one, one.batch(0))

    accum_config = documents_config(path, data=2, tensor=4)
    accum_config.train.grad_accum_steps = 2
    accum = Trainer.build(accum_config)
    loss, grads = _loss_and_grads(accum, accum.batch(0))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert rel_norm(grads, ref_grads) < 1e-5
    params = one.init_state()["params"]
    np.testing.assert_allclose(accum.eval_step(accum.init_state()["params"], accum.batch(0, "eval")),
                               one.eval_step(params, one.batch(0, "eval")), rtol=1e-5)

    piped_config = documents_config(path, pipeline=2, data=2, tensor=2)
    piped_config.pipeline.update(schedule="1f1b", microbatches=4)
    piped_config.sharding.sequence_parallel = True  # each document's tokens split over `tensor` between matmuls
    piped = Trainer.build(piped_config)
    loss, grads = _loss_and_grads(piped, piped.batch(0))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert rel_norm(grads, ref_grads) < 1e-5


def test_document_mask_needs_a_datadir_eos(tmp_path):
    config = tiny_config()
    config.data.document_mask = True
    with pytest.raises(ConfigError, match=r"^data.document_mask=True needs .*train.prepare"):
        resolve(config, 8)
    flat = tmp_path / "flat.bin"
    np.arange(4000, dtype=np.uint16).tofile(flat)
    config = tiny_config("tokens")
    config.data.update(path=str(flat), document_mask=True)
    with pytest.raises(ConfigError, match="data.document_mask"):
        resolve(config, 8)
