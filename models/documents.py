"""Packed documents: a row of tokens may hold several documents, each ending with an end-of-document token.
With `cfg.document_eos_id` >= 0 the model keeps them apart, all derived from the input tokens alone (so batches
and pipeline messages stay plain token rows): attention stays within a document, rotary positions restart at
each one, and the target after an end-of-document input (the next document's first token) is not counted."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


def eos_id(cfg: Any) -> int | None:
    """The end-of-document id the model splits rows at, or None when rows are one stream."""
    value = getattr(cfg, "document_eos_id", -1)
    return None if value is None or value < 0 else int(value)


def segments(inputs_BxL: jax.Array, cfg: Any) -> tuple[jax.Array | None, jax.Array | None]:
    """(segment ids, positions), both int32 [B, L], or (None, None) without documents. An end-of-document
    token belongs to the document it ends; segment ids count the documents begun before a token (so they
    never decrease along a row), positions count from each document's first token."""
    eos = eos_id(cfg)
    if eos is None:
        return None, None
    ends_BxL = (inputs_BxL == eos).astype(jnp.int32)
    segment_BxL = jnp.cumsum(ends_BxL, axis=1) - ends_BxL
    index_L = jnp.arange(inputs_BxL.shape[1], dtype=jnp.int32)
    starts_BxL = jnp.concatenate([jnp.ones_like(segment_BxL[:, :1], bool),
                                  segment_BxL[:, 1:] != segment_BxL[:, :-1]], axis=1)
    start_BxL = jax.lax.cummax(jnp.where(starts_BxL, index_L[None, :], 0), axis=1)
    return segment_BxL, index_L[None, :] - start_BxL


def loss_mask(inputs_BxL: jax.Array, cfg: Any) -> jax.Array | None:
    """bool [B, L]: the targets that count (not the one after an end-of-document input); None counts all."""
    eos = eos_id(cfg)
    return None if eos is None else inputs_BxL != eos


def target_counter(cfg: Any) -> Callable[[jax.Array], jax.Array] | None:
    """tokens [B, seq+1] -> float32 number of counted targets, for normalizing a loss over a whole batch that
    is computed in parts (accumulation slices, pipeline microbatches); None when every target counts."""
    if eos_id(cfg) is None:
        return None
    return lambda tokens_BxL1: jnp.sum(loss_mask(tokens_BxL1[:, :-1], cfg), dtype=jnp.float32)
