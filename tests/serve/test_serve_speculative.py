"""Speculative decoding in the engine (train/serve/speculative.py, draft.py): over 32 requests of mixed lengths, some
sharing prefixes, greedy outputs with serve.speculative=ngram and =draft equal speculation off, on one device and on
two replicas of tensor=2, with guesses both accepted and rejected and no page left held; seeded samples are the
tokens speculation off draws, and follow the target's distribution (a chi-square test); prompt lookup, the guess
planner and the settings' one-line errors without a model."""
import dataclasses

import jax
import numpy as np
import pytest

import models
from tests.helpers import tiny_config
from train import placed as placed_lib
from train.exit_codes import ConfigError
from train.serve import replicas, speculative
from train.serve.engine import Engine, Settings
from train.serve.sampling import SamplingParams
from train.serve.scheduler import Sequence

# One step shape (16 tokens): every engine here compiles its step once.
OFF = Settings(page_size=4, max_num_seqs=4, max_batch_tokens=16, prefill_chunk=8, min_step_tokens=16)
NGRAM = dataclasses.replace(OFF, speculative="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)
DRAFT = dataclasses.replace(NGRAM, speculative="draft")
CONTEXT = 48
NEW = 12


def _prompts() -> list[list[int]]:
    """32 prompts of 1 to 24 tokens: a third share a 12-token prefix (prefix-cache hits), a third repeat a
    phrase (prompt lookup finds it), the rest random."""
    rng = np.random.default_rng(0)
    shared, out = rng.integers(0, 256, 12).tolist(), []
    for i in range(32):
        n = int(rng.integers(1, 13))
        tail = rng.integers(0, 256, n).tolist()
        out.append([shared + tail, (tail * 3)[:24], tail][i % 3])
    return out


def _placed(num_devices=1, **mesh):
    config = tiny_config(**mesh)
    config.model.preset = "llama3-tiny"
    config.model.update(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_mlp=128, seq_len=CONTEXT,
                        compute_dtype="float32", param_dtype="float32", vocab_size=256)
    placed = placed_lib.initialized(placed_lib.place(config, num_devices))
    # Weights tripled: the initialization's greedy outputs repeat one token, which every guess would get right.
    return dataclasses.replace(placed, params=jax.tree.map(lambda x: 3 * x if x.ndim >= 2 else x, placed.params))


def _draft_of(target):
    """The draft: the target's weights with noise, so its greedy guesses are often but not always right."""
    noisy = jax.tree.map(lambda x: x + 0.1 * x.std() * jax.random.normal(jax.random.key(1), x.shape, x.dtype),
                         target.params)
    return dataclasses.replace(target, params=noisy)


@pytest.fixture(scope="module")
def one_device():
    target = _placed()
    off = Engine.build(target, OFF, CONTEXT)
    return target, off, [o.token_ids for o in off.generate(_prompts(), SamplingParams(max_tokens=NEW))]


def _guessing(engine):
    """`engine` with every step as costly as any other: guesses always pay (a draft model as large as the target
    would otherwise never be worth running), whatever the machine's timings."""
    for e in getattr(engine, "engines", [engine]):
        e.speculator.cost = lambda tokens, depth: 1.0
    return engine


def _check_greedy(engine, want, engines):
    got = [o.token_ids for o in engine.generate(_prompts(), SamplingParams(max_tokens=NEW))]
    assert got == want
    stats = engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"], stats
    assert stats["prefix_hits"] > 0 and stats["pages_used"] == stats["running"] == 0
    assert stats["spec_mean_accepted_length"] == 1 + stats["spec_accepted_tokens"] / stats["spec_verify_steps"]
    drafts = [e.speculator.draft for e in engines if e.speculator.draft is not None]
    assert all(d.kv.used() == 0 and not d.computed for d in drafts)


def test_ngram_and_draft_greedy_equal_off_on_one_device(one_device):
    target, _, want = one_device
    _check_greedy(Engine.build(target, NGRAM, CONTEXT), want, [])
    drafted = _guessing(Engine.build(target, DRAFT, CONTEXT, draft=_draft_of(target)))
    _check_greedy(drafted, want, [drafted])


def test_ngram_and_draft_greedy_equal_off_on_two_replicas_of_tensor_2(one_device):
    _, _, want = one_device
    target = _placed(num_devices=4, data=2, tensor=2)
    for settings, draft in ((NGRAM, None), (DRAFT, _draft_of(target))):
        served = _guessing(replicas.build(target, settings, CONTEXT, draft=draft))
        assert served.replicas == 2 and served.engines[0].runner.pool["k"][0].sharding.spec[0] == "tensor"
        _check_greedy(served, want, served.engines)


def test_seeded_samples_are_speculation_offs_and_follow_the_target(one_device):
    """400 draws of three tokens (temperature 1, top_k 4) after one prompt, each its own seed: the draft guesses
    the second and third, and the tokens are speculation off's. Against the target's probabilities of the 16 pairs
    of the first two (from its forward pass) the chi-square statistic stays under 37.7, the 0.001 quantile with 15
    degrees of freedom."""
    target, off, _ = one_device
    prompt, draws = [7, 3, 9, 1, 4], 400
    params = [SamplingParams(temperature=1.0, top_k=4, seed=s, max_tokens=3) for s in range(draws)]
    drafted = _guessing(Engine.build(target, DRAFT, CONTEXT, draft=_draft_of(target)))
    drawn = [o.token_ids for o in drafted.generate([prompt] * draws, params)]
    assert drawn == [o.token_ids for o in off.generate([prompt] * draws, params)]
    stats = drafted.stats()
    assert stats["spec_verify_steps"] > draws // 2 and 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    pairs = [tuple(t[:2]) for t in drawn]
    forward = jax.jit(lambda p, t: models.forward(p, t, target.model))

    def top4(tokens):
        logits = np.asarray(forward(target.params, np.asarray([tokens], np.int32))[0, -1], np.float64)
        ids = np.argsort(logits)[::-1][:4]
        p = np.exp(logits[ids] - logits[ids].max())
        return dict(zip(ids.tolist(), p / p.sum()))
    first = top4(prompt)
    expected = {(a, b): pa * pb for a, pa in first.items() for b, pb in top4(prompt + [a]).items()}
    seen = {pair: pairs.count(pair) for pair in expected}
    assert sum(seen.values()) == draws
    chi2 = sum((seen[c] - draws * p) ** 2 / (draws * p) for c, p in expected.items())
    assert chi2 < 37.7, (chi2, seen)


def test_prompt_lookup_copies_after_the_longest_suffix_match():
    index = speculative.NgramIndex(1, 3)
    seq = Sequence("a", [5, 6, 7, 8, 1, 5, 6, 7], SamplingParams(), 0)
    assert index.propose(seq, 3) == [8, 1, 5]  # "5 6 7" occurred at 0..2
    seq.output += [9]
    assert index.propose(seq, 3) == []  # "9" never occurred before
    loop = Sequence("b", [1, 2, 1, 2, 1], SamplingParams(), 0)
    assert speculative.NgramIndex(2, 2).propose(loop, 5) == [2, 1, 2, 1, 2]  # a loop continues into its guess


def test_the_planner_guesses_while_they_pay():
    flat = lambda tokens, depth: 1.0  # noqa: E731  (a step costs the same at any size: every guess pays)
    assert speculative.plan_guesses(2, 2, [(3, 0.9), (2, 0.1)], 16, flat) == [3, 2]
    assert speculative.plan_guesses(15, 2, [(3, 0.9), (2, 0.1)], 16, flat) == [1, 0]  # one token left
    linear = lambda tokens, depth: float(tokens)  # noqa: E731  (a full batch: each token costs its share)
    assert speculative.plan_guesses(16, 16, [(3, 0.9)] * 16, 64, linear) == [0] * 16
    step = lambda tokens, depth: 1.0 if tokens <= 4 else 1.5  # noqa: E731
    assert speculative.plan_guesses(1, 1, [(7, 0.9)], 8, step) == [7]  # 5.7 tokens for 1.5 beats 3.4 for 1
    assert speculative.plan_guesses(1, 1, [(7, 0.5)], 8, step) == [3]  # 2.0 for 1.5 does not beat 1.9 for 1


@pytest.mark.parametrize("change, message", [
    ({"speculative": "mtp"}, "serve.speculative=mtp: needs a model with multi-token-prediction modules"),
    ({"speculative": "draft"}, "serve.draft='': give the draft model of serve.speculative=draft"),
    ({"speculative": "ngram", "ngram_min": 5}, "serve.ngram_min=5: must be <= serve.ngram_max=4"),
])
def test_speculation_settings_that_cannot_work_are_one_line(change, message):
    cfg = models.from_dict({"preset": "llama3-tiny"})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        speculative.check_settings(dataclasses.replace(Settings(), **change), cfg)
