"""The output head and next-token cross-entropy as one function, optionally over sequence chunks so that the
[batch, seq, vocab] float32 logits (and their gradient) never exist whole: each chunk's logits are made,
reduced to a loss and dropped, and recomputed in the backward pass (jax.checkpoint).

It returns the loss summed over counted targets and their count, so a caller can normalize over the global
batch whatever the accumulation or microbatching (targets a loss mask leaves out count for nothing).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mesh.numbers import ceil_div


def _no_constraint(x: jax.Array, names: tuple) -> jax.Array:
    return x


def used(logits_BxLxV: jax.Array, vocab_size: int = 0) -> jax.Array:
    """The logits with the columns past `vocab_size` (a padded table's unused rows) at -inf; 0: all in use."""
    if not vocab_size or vocab_size >= logits_BxLxV.shape[-1]:
        return logits_BxLxV
    return jnp.where(jnp.arange(logits_BxLxV.shape[-1]) < vocab_size, logits_BxLxV, -jnp.inf)


def _token_losses(h_BxCxD: jax.Array, head_DxV: jax.Array, targets_BxC: jax.Array, constrain=_no_constraint,
                  vocab_size: int = 0):
    """Per-token cross-entropy in float32 (logsumexp minus the target's logit)."""
    logits = constrain(jnp.einsum("bcd,dv->bcv", h_BxCxD, head_DxV).astype(jnp.float32), ("batch", "seq", "vocab"))
    logits = used(logits, vocab_size)
    target = jnp.take_along_axis(logits, targets_BxC[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - target


def head_loss(h_BxLxD: jax.Array, head_DxV: jax.Array, targets_BxL: jax.Array,
              mask_BxL: jax.Array | None = None, chunk_size: int = 0,
              constrain=_no_constraint, vocab_size: int = 0) -> tuple[jax.Array, jax.Array]:
    """(sum of per-token losses over counted targets, number of counted targets), both float32 scalars.

    `h` is the final-normed hidden state and `head` the output projection, both in the compute dtype.
    `chunk_size` 0 computes every logit at once; otherwise a scan over chunks of that many positions (the
    sequence is padded to a multiple, the padding counts for nothing). `constrain(x, logical_names)` annotates
    the [B, L or chunk, V] logits (the caller's sharding hook). `vocab_size` > 0 and narrower than the head: the
    head's columns past it are padding, left out of the softmax."""
    mask = jnp.ones(targets_BxL.shape, jnp.float32) if mask_BxL is None else mask_BxL.astype(jnp.float32)
    B, L, D = h_BxLxD.shape
    if not chunk_size or chunk_size >= L:
        return jnp.sum(_token_losses(h_BxLxD, head_DxV, targets_BxL, constrain, vocab_size) * mask), jnp.sum(mask)
    n = ceil_div(L, chunk_size)
    pad = n * chunk_size - L
    if pad:
        h_BxLxD = jnp.pad(h_BxLxD, ((0, 0), (0, pad), (0, 0)))
        targets_BxL = jnp.pad(targets_BxL, ((0, 0), (0, pad)))
        mask = jnp.pad(mask, ((0, 0), (0, pad)))

    def chunks(x):  # [B, n*c, ...] -> [n, B, c, ...]
        return jnp.moveaxis(x.reshape(B, n, chunk_size, *x.shape[2:]), 1, 0)

    @jax.checkpoint  # keep only each chunk's inputs; its logits are rebuilt in the backward pass
    def body(total, xs):
        h, targets, m = xs
        return total + jnp.sum(_token_losses(h, head_DxV, targets, constrain, vocab_size) * m), None

    # The carry starts as a 0 that varies over the same manual mesh axes as the chunks' losses (inside a
    # shard_map, e.g. a pipeline stage, scan needs the two to match): a sum of empty slices of every input.
    zero = sum(jnp.sum(x[:, :0]).astype(jnp.float32) for x in (h_BxLxD, head_DxV, targets_BxL, mask))
    total, _ = jax.lax.scan(body, zero, (chunks(h_BxLxD), chunks(targets_BxL), chunks(mask)))
    return total, jnp.sum(mask)
