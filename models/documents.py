"""Packed documents: a row of tokens may hold several documents, each ending with an end-of-document token.
With `cfg.document_eos_id` >= 0 the model keeps them apart, all derived from the input tokens alone (so batches
and pipeline messages stay plain token rows): attention stays within a document, rotary positions restart at
each one, and the target after an end-of-document input (the next document's first token) is not counted.
With `cfg.masked_targets` a row also carries a loss mask (supervised fine-tuning): a target that does not count
is stored as -(id+1), so the mask rides in the same int32 rows (`split_row` decodes it)."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from models.protocols import ModelConfig


def eos_id(cfg: ModelConfig) -> int | None:
    """The end-of-document id the model splits rows at, or None when rows are one stream."""
    value = getattr(cfg, "document_eos_id", -1)
    return None if value is None or value < 0 else int(value)


def segments(inputs_BxL: jax.Array, cfg: ModelConfig) -> tuple[jax.Array | None, jax.Array | None]:
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


def masked(cfg: ModelConfig) -> bool:
    """Whether rows encode a loss mask (a target that does not count stored as -(id+1))."""
    return bool(getattr(cfg, "masked_targets", False))


def split_row(tokens_BxL1: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(inputs_BxL, targets_BxL, counted_BxL or None) of rows of seq+1 tokens: the ids with any loss mask decoded,
    and the targets that count (a masked target, or the one after an end-of-document input, does not; None:
    all count). Keeping the mask inside the token rows rather than in an array beside them means batches,
    accumulation slices and pipeline messages need no second array: whatever already carries the tokens
    carries the mask, and every layout derives it where it takes inputs and targets."""
    if not masked(cfg):
        inputs, targets = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]
        return inputs, targets, loss_mask(inputs, cfg)
    ids_BxL1 = jnp.where(tokens_BxL1 < 0, -tokens_BxL1 - 1, tokens_BxL1)
    inputs, targets = ids_BxL1[:, :-1], ids_BxL1[:, 1:]
    counted = tokens_BxL1[:, 1:] >= 0
    document = loss_mask(inputs, cfg)
    return inputs, targets, counted if document is None else counted & document


def loss_mask(inputs_BxL: jax.Array, cfg: ModelConfig) -> jax.Array | None:
    """bool [B, L]: the targets that count (not the one after an end-of-document input); None counts all."""
    eos = eos_id(cfg)
    return None if eos is None else inputs_BxL != eos


def target_counter(cfg: ModelConfig) -> Callable[[jax.Array], jax.Array] | None:
    """tokens [B, seq+1] -> float32 number of counted targets, for normalizing a loss over a whole batch that
    is computed in parts (accumulation slices, pipeline microbatches); None when every target counts."""
    if eos_id(cfg) is None and not masked(cfg):
        return None
    return lambda tokens_BxL1: jnp.sum(split_row(tokens_BxL1, cfg)[2], dtype=jnp.float32)


def segments_and_positions(inputs_BxL: jax.Array, length: int, cfg: ModelConfig,
                           hooks: Any) -> tuple[jax.Array | None, jax.Array | None]:
    """Packed documents' (segment ids, positions) of the `length` positions a stack runs. A context-parallel
    layout's permuted sequence (`hooks.context_order`) keeps its global rotary positions; its documents are found in
    the global order (they run along it) and their ids and positions permuted like the inputs. `inputs_BxL` is the
    stack's own sequence (L = length), or, where it runs a slice of each row (a pipeline cell under context
    parallelism), the whole rows in order (L > length): the positions are then the slice's and the segment ids the
    whole rows' in order, for the layout's attention to read every block's ids."""
    order = hooks.context_order(length)
    if order is None:
        return segments(inputs_BxL, cfg)
    whole = inputs_BxL.shape[1] > length
    segment_ids, positions = segments(inputs_BxL if whole else jnp.take(inputs_BxL, jnp.argsort(order), axis=1), cfg)
    if segment_ids is None:
        return None, order
    return (segment_ids if whole else jnp.take(segment_ids, order, axis=1)), jnp.take(positions, order, axis=1)
