"""The serving engine (train/serve/): greedy outputs of prompts arriving at different steps, in chunks mixed with
decodes over small pages, equal each prompt decoded alone by the model's full forward pass; tensor=2 equals one
device; a mixture of experts decodes what its forward predicts; prefix-cache hits, a pool too small for the load
and sampling seeds and stop tokens behave."""

import jax
import numpy as np
import pytest

import models
from tests.helpers import tiny_config
from train import placed as placed_lib
from train.serve.engine import Engine, Settings
from train.serve.sampling import SamplingParams

SMALL = Settings(page_size=4, max_num_seqs=4, max_batch_tokens=32, prefill_chunk=8)
PROMPTS = [[5, 9, 2, 7, 1, 3, 8, 4, 6, 11, 12], [3, 1, 4], [100, 50, 25, 12, 6, 3, 1, 99, 98, 97, 96, 95, 94, 93]]
NEW = 6


def _placed(num_devices=1, experts=0, **mesh):
    config = tiny_config(**mesh)
    config.model.preset = "llama3-tiny"
    config.model.update(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_mlp=128, seq_len=32,
                        compute_dtype="float32", param_dtype="float32")
    if experts:
        config.model.update(n_experts=experts, experts_per_token=2, moe_every=1, capacity_factor=0.0)
    return placed_lib.initialized(placed_lib.place(config, num_devices))


def _reference(placed, prompt, new):
    """Greedy tokens of the full forward pass, re-run on the whole sequence for each token."""
    params = jax.device_get(placed.params)
    forward = jax.jit(lambda p, t: models.forward(p, t, placed.model))
    tokens = list(prompt)
    for _ in range(new):
        logits = forward(params, np.asarray([tokens], np.int32))
        tokens.append(int(np.argmax(logits[0, -1])))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def dense():
    placed = _placed()
    return placed, Engine.build(placed, SMALL)


def _staggered(engine, prompts, new):
    """Add one prompt per step, then run to completion; final token ids by request."""
    done, pending = {}, list(enumerate(prompts))
    while pending or engine.has_work():
        if pending:
            i, prompt = pending.pop(0)
            engine.add(f"r{i}", prompt, SamplingParams(max_tokens=new))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"].token_ids for i in range(len(prompts))]


def test_greedy_equals_full_forward(dense):
    placed, engine = dense
    got = _staggered(engine, PROMPTS, NEW)
    assert got == [_reference(placed, p, NEW) for p in PROMPTS]
    assert engine.stats()["pages_used"] == 0 or engine.settings.prefix_cache
