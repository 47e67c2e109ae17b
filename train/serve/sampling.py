"""Per-request sampling inside the jitted step: temperature, top-k and top-p per row as arrays, a PRNG key per
request folded with the token's index (so a seed reproduces a request whatever else runs beside it), greedy
rows at temperature 0, and the top-N log-probabilities of every row."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0: greedy
    top_k: int = 0             # 0: off
    top_p: float = 1.0         # 1: off
    seed: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # strings that end the text (needs a tokenizer)
    logprobs: int = 0           # top-N log-probabilities per new token (0: none)
    prompt_logprobs: int | None = None  # top-N log-probabilities of each prompt token after the first (None: none)


def _drawn(logits_RxV, temperature_R, top_k_R, top_p_R, seeds_R, counters_R):
    """A token drawn for every row after temperature, top-k and top-p (rows at temperature 0 unscaled)."""
    scaled = logits_RxV / jnp.where(temperature_R > 0, temperature_R, 1.0)[:, None]
    V = scaled.shape[-1]
    ranked = jnp.sort(scaled, axis=-1)[:, ::-1]
    kth = jnp.take_along_axis(ranked, jnp.clip(top_k_R - 1, 0, V - 1)[:, None], axis=-1)
    kth = jnp.where(top_k_R[:, None] > 0, kth, -jnp.inf)
    ranked = jnp.where(ranked < kth, -jnp.inf, ranked)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above each one
    # The most likely token always stays: a top_p too small to keep any (1e-300 is 0 in float32) keeps it alone.
    kept = (before < top_p_R[:, None]) | (jnp.arange(V) == 0)[None, :]
    cutoff = jnp.min(jnp.where(kept, ranked, jnp.inf), axis=-1, keepdims=True)
    scaled = jnp.where((scaled < kth) | (scaled < cutoff), -jnp.inf, scaled)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds_R, counters_R)
    return jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, scaled).astype(jnp.int32)


def first_argmax(logits_RxV: jax.Array) -> jax.Array:
    """jnp.argmax (the first of equal maxima) as a max and a min over indices: XLA's CPU backend runs argmax's
    variadic reduce several times slower (5.6 ms against 1.6 ms over [64, 32768])."""
    top = jnp.max(logits_RxV, axis=-1, keepdims=True)
    V = logits_RxV.shape[-1]
    return jnp.min(jnp.where(logits_RxV == top, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def sample(logits_RxV: jax.Array, temperature_R: jax.Array, top_k_R: jax.Array, top_p_R: jax.Array,
           seeds_R: jax.Array, counters_R: jax.Array, n_logprobs: int, with_logprobs: jax.Array,
           targets_R: jax.Array):
    """(token [R], the log-probability of targets_R, or of the token where a target is -1 [R], top ids [R, n], top
    log-probabilities [R, n]); log-probabilities are the model's own (before temperature and filters), computed only
    when `with_logprobs` (a bool []: some row asks for them), else zeros."""
    greedy = first_argmax(logits_RxV)
    # The filters sort every row: skipped (one branch runs) when every row of the step is greedy.
    drawn = jax.lax.cond(jnp.any(temperature_R > 0), _drawn, lambda *_: greedy,
                         logits_RxV, temperature_R, top_k_R, top_p_R, seeds_R, counters_R)
    token = jnp.where(temperature_R > 0, drawn, greedy)

    def logprobs(logits_RxV, token):
        lp = jax.nn.log_softmax(logits_RxV, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, n_logprobs)
        which = jnp.where(targets_R >= 0, targets_R, token)
        return jnp.take_along_axis(lp, which[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    def none(logits_RxV, token):
        R = logits_RxV.shape[0]
        return (jnp.zeros((R,), jnp.float32), jnp.zeros((R, n_logprobs), jnp.int32),
                jnp.zeros((R, n_logprobs), jnp.float32))

    chosen, top_ids, top_lp = jax.lax.cond(with_logprobs, logprobs, none, logits_RxV, token)
    return token, chosen, top_ids, top_lp
