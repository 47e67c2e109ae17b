"""The serving engine (train/serve/): greedy outputs of prompts arriving at different steps, in chunks mixed with
decodes over small pages, equal each prompt decoded alone by the model's full forward pass; tensor=2 equals one
device, and data=2 serves as two replicas; a mixture of experts decodes what its forward predicts (its experts
split over `expert` too); prefix-cache hits, a pool too small for the load and sampling seeds and stop tokens
behave."""

import dataclasses

import jax
import numpy as np
import pytest

import models
from tests.helpers import tiny_config
from train import placed as placed_lib
from train.config import experiment as config_lib
from train.config.experiment import ConfigError
from train.serve import replicas
from train.serve.engine import Engine, Settings
from train.serve.sampling import SamplingParams

SMALL = Settings(page_size=4, max_num_seqs=4, max_batch_tokens=32, prefill_chunk=8)  # steps of 1, 2, 4, ... 32 tokens
FEW = dataclasses.replace(SMALL, min_step_tokens=8)  # three step shapes compiled (8, 16, 32)
ONE_STEP = dataclasses.replace(FEW, max_num_seqs=2, max_batch_tokens=8)  # one step shape compiled
PROMPTS = [[5, 9, 2, 7, 1, 3, 8, 4, 6, 11, 12], [3, 1, 4], [100, 50, 25, 12, 6, 3, 1, 99, 98, 97, 96, 95, 94, 93]]
NEW = 6


def _placed(num_devices=1, experts=0, gpt2=False, **mesh):
    config = tiny_config(**mesh)
    config.model.preset = "tiny" if gpt2 else "llama3-tiny"
    config.model.update(n_layers=2, d_model=64, n_heads=4, seq_len=32, compute_dtype="float32",
                        param_dtype="float32", vocab_size=256)
    if gpt2:  # GPT-2's learned positions, biases, LayerNorm and tied head
        config.model.update(positions="learned", bias=True, norm="layernorm", tie_embeddings=True)
    else:
        config.model.update(n_kv_heads=2, d_mlp=128)
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
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == 0 and stats["tokens_generated"] == NEW * len(PROMPTS)


def test_prefix_hit_skips_prefill_with_the_same_tokens(dense):
    _, engine = dense
    shared = list(range(20, 33))  # three full pages of 4, and one token more
    first = engine.generate([shared], SamplingParams(max_tokens=3))[0].token_ids
    before = engine.stats()
    again = engine.generate([shared], SamplingParams(max_tokens=3))[0].token_ids
    after = engine.stats()
    assert again == first
    assert after["prefix_hits"] - before["prefix_hits"] == 3
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(shared) - 12


def test_sampling_is_reproducible_and_stop_tokens_stop(dense):
    _, engine = dense
    hot = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=7, max_tokens=8, logprobs=2)
    a, b = engine.generate([PROMPTS[0], PROMPTS[0]], hot)
    c = engine.generate([PROMPTS[0]], hot)[0]
    assert a.token_ids == b.token_ids == c.token_ids and a.finish_reason == "length"
    assert len(a.logprobs) == 8 and all(len(row) >= 2 and t in row for row, t in zip(a.logprobs, a.token_ids))
    other = engine.generate([PROMPTS[0]], dataclasses.replace(hot, seed=8))[0]
    assert other.token_ids != a.token_ids
    greedy = _reference(dense[0], PROMPTS[1], 4)
    stopped = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=4, stop_token_ids=(greedy[1],)))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == greedy[:greedy.index(greedy[1]) + 1]
    with pytest.raises(ValueError, match="max_context"):
        engine.add("long", list(range(30)), SamplingParams(max_tokens=8))


def test_a_small_pool_completes_every_request(dense):
    placed, big = dense
    small = Engine.build(placed, dataclasses.replace(FEW, kv_pages=9, prefix_cache=False))
    assert small.max_context == 32
    want = big.generate(PROMPTS * 2, SamplingParams(max_tokens=NEW))
    got = small.generate(PROMPTS * 2, SamplingParams(max_tokens=NEW))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = small.stats()
    assert stats["preemptions"] > 0 and stats["pages_used"] == 0 and stats["pages_free"] == 8
    assert stats["running"] == stats["waiting"] == 0


def test_tensor_split_equals_one_device(dense):
    placed = _placed(num_devices=2, tensor=2)
    engine = Engine.build(placed, FEW)
    assert engine.runner.pool["k"][0].sharding.spec[0] == "tensor"
    got = [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_tokens=NEW))]
    assert got == [o.token_ids for o in dense[1].generate(PROMPTS, SamplingParams(max_tokens=NEW))]


def test_data_replicas_share_the_load_and_equal_one_device(dense):
    """data=2 serves as two engines on one device each (tensor=2 inside each: four devices), each with its own
    pages; requests go to the less loaded, and every output is the one-device engine's."""
    placed = _placed(num_devices=4, data=2, tensor=2)
    served = replicas.build(placed, ONE_STEP)
    assert served.replicas == 2 and [len(e.placed.mesh.devices.flat) for e in served.engines] == [2, 2]
    assert not set(served.engines[0].placed.mesh.devices.flat) & set(served.engines[1].placed.mesh.devices.flat)
    want = [o.token_ids for o in dense[1].generate(PROMPTS * 2, SamplingParams(max_tokens=NEW))]
    assert _staggered(served, PROMPTS * 2, NEW) == want
    each = [e.stats() for e in served.engines]
    assert [s["tokens_generated"] for s in each] == [NEW * len(PROMPTS)] * 2
    assert served.stats()["pages_used"] == 0 and not served.has_work()


def test_gpt2_options_decode_their_forward():
    placed = _placed(gpt2=True)
    engine = Engine.build(placed, FEW)
    assert engine.max_context == 32
    got = _staggered(engine, PROMPTS[:2], 4)
    assert got == [_reference(placed, p, 4) for p in PROMPTS[:2]]


def test_mixture_of_experts_decodes_its_forward():
    """On one device, and with its experts split over expert=2."""
    placed = _placed(experts=4)
    want = [_reference(placed, p, 4) for p in PROMPTS[:2]]
    assert _staggered(Engine.build(placed, FEW), PROMPTS[:2], 4) == want
    split = Engine.build(_placed(num_devices=2, experts=4, expert=2), ONE_STEP)
    assert split.runner.buckets == [8] and split.placed.mesh.shape["expert"] == 2
    assert _staggered(split, PROMPTS[:2], 4) == want


@pytest.mark.parametrize("key,value,message", [("page_size", 0, "serve.page_size=0: use a whole number >= 1"),
                                               ("kv_memory_fraction", 1.5, "serve.kv_memory_fraction=1.5: use a "
                                                                           "fraction in (0, 1]")])
def test_a_bad_serve_setting_is_one_line(key, value, message):
    config = tiny_config()
    config.serve[key] = value
    with pytest.raises(ConfigError) as raised:
        config_lib.resolve(config, 1)
    assert str(raised.value) == message


def test_abort_returns_the_pages_and_says_so(dense):
    _, engine = dense
    engine.add("gone", PROMPTS[2], SamplingParams(max_tokens=10))
    engine.step()
    assert engine.stats()["running"] == 1 and engine.stats()["pages_used"] > 0
    engine.abort("gone")
    [out] = engine.step()
    assert (out.request_id, out.finished, out.finish_reason) == ("gone", True, "abort")
    assert not engine.has_work() and engine.stats()["running"] == 0
    assert all(p.refs.count(0) == p.num_pages for p in engine.kv.groups)  # cached pages may stay, held by none
