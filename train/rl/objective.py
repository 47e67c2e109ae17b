"""The GRPO objective on rows of prompt + completion tokens: each target token's log-probability under the policy
(one forward pass of the model's own embed, layers and head), the clipped importance ratio against the log-probabilities
that sampled it, the group-relative advantage and, with a reference, the KL penalty (Shao et al. 2024, DeepSeekMath,
eq. 3 and its k3 estimator of the KL). Rows carry which targets count (the completion's) in the training loss-mask
encoding: a target that does not count is stored as -(id+1) (models/documents.py)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import models


def split_rows(tokens_BxL1: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(inputs, targets, counted) [B, L] of rows of L+1 tokens in the loss-mask encoding."""
    ids = jnp.where(tokens_BxL1 < 0, -tokens_BxL1 - 1, tokens_BxL1)
    return ids[:, :-1], ids[:, 1:], tokens_BxL1[:, 1:] >= 0


def encode_row(prompt: list[int], completion: list[int], length: int) -> np.ndarray:
    """int32 [length]: the prompt and completion, the completion's tokens counted as targets, padding after them
    (id 0, not counted)."""
    row = np.full(length, -1, np.int32)
    row[:len(prompt)] = -np.asarray(prompt, np.int32) - 1
    row[len(prompt):len(prompt) + len(completion)] = completion
    return row


def token_logprobs(params, tokens_BxL1: jax.Array, cfg: models.ModelConfig, hooks, temperature: float):
    """(log-probabilities of each target over logits / temperature, the same at temperature 1 (the model's own, what
    the engine reports; the first array when temperature is 1), counted, the layers' auxiliary loss), all [B, L] in
    float32 but the loss. Under context parallelism every [B, L] array is in the layout's sequence order."""
    fam = models.family_of(cfg)
    inputs, targets, counted = split_rows(tokens_BxL1)
    order = hooks.context_order(inputs.shape[1])
    if order is not None:
        inputs, targets, counted = (jnp.take(a, order, axis=1) for a in (inputs, targets, counted))
    top = models.top_params(params)
    x = fam.forward.embed(top, inputs, cfg, hooks)
    x, (aux, _) = fam.forward.run_layers(params[models.LAYERS], x, inputs, cfg, hooks)
    logits = fam.forward.logits(top, x, cfg, hooks).astype(jnp.float32)
    own = _picked(logits, targets)
    scaled = own if temperature == 1.0 else _picked(logits / temperature, targets)
    return scaled, jax.lax.stop_gradient(own), counted, aux


def _picked(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    picked = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits_BxLxV, axis=-1)


def in_layout_order(x_BxL: jax.Array, hooks) -> jax.Array:
    """A [B, L] side input (per target token) permuted as token_logprobs' outputs are."""
    order = hooks.context_order(x_BxL.shape[1])
    return x_BxL if order is None else jnp.take(x_BxL, order, axis=1)


@dataclasses.dataclass(frozen=True)
class Clip:
    low: float      # the ratio's floor is 1 - low
    high: float     # its ceiling 1 + high
    kl_coef: float
    per_sequence: bool  # loss_agg=seq_mean


def token_weights(counted_BxL: jax.Array, per_sequence: bool, rows: int, tokens: jax.Array) -> jax.Array:
    """float32 [B, L]: what each counted token's term is weighted by so that the sum is the step's loss: 1 / every
    counted token of the step (`tokens`), or 1 / (its completion's length x the step's `rows`)."""
    counted = counted_BxL.astype(jnp.float32)
    if per_sequence:
        return counted / (jnp.maximum(counted.sum(axis=1, keepdims=True), 1.0) * rows)
    return counted / jnp.maximum(tokens, 1.0)


def grpo_terms(logp: jax.Array, old: jax.Array, advantage_B: jax.Array, weights: jax.Array, clip: Clip,
               reference: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(the loss as a weighted sum over tokens, its sums: clipped tokens and KL, weighted alike)."""
    ratio = jnp.exp(logp - old)
    advantage = advantage_B[:, None]
    unclipped = ratio * advantage
    clipped = jnp.clip(ratio, 1.0 - clip.low, 1.0 + clip.high) * advantage
    per_token = -jnp.minimum(unclipped, clipped)
    sums = {"clip_fraction": jnp.sum((clipped < unclipped).astype(jnp.float32) * weights)}
    if reference is not None:
        log_ratio = reference - logp
        kl = jnp.exp(log_ratio) - log_ratio - 1.0  # k3: unbiased, never negative
        per_token = per_token + clip.kl_coef * kl
        sums["kl"] = jnp.sum(jax.lax.stop_gradient(kl) * weights)
    return jnp.sum(per_token * weights), sums


def group_advantages(rewards_PxG: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Each completion's reward against its group's: (r - mean) / (std + eps), float32 [P, G]; a group whose rewards
    are all equal teaches nothing (zeros)."""
    r = np.asarray(rewards_PxG, np.float64)
    return ((r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + eps)).astype(np.float32)
