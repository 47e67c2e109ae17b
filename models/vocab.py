"""The two ends of a transformer that meet the vocabulary, shared by the families: the token embedding (with a learned
position table where the model has one, and a family's scale), and the output head with its loss, through a head of
its own or the embedding table tied to it."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from models import documents, lm_loss, lora
from models.contract import Hooks, Params, no_constraint
from models.protocols import ModelConfig


def embed(params: Params, tokens_BxL: jax.Array, cfg: ModelConfig, hooks: Hooks = no_constraint,
          positions: jax.Array | None = None, scale: float | None = None) -> jax.Array:
    """The token embeddings (times `scale` when given, Gemma's sqrt(d_model), in the table's dtype), plus the rows
    of a learned position table (a `positions` entry in `params`) at `positions` ([L] or [B, L]; by default each
    document's (models/documents.py) or the layout's order, else 0..L-1)."""
    params = lora.freeze(params, cfg)
    # Gather the table's `embed` dimension first (as FSDP does for any weight before use): XLA's
    # partitioner cannot look rows up in a table split along both dimensions without replicating it.
    table = hooks(params["embed"], ("vocab", None))
    x = jnp.take(table, tokens_BxL, axis=0)
    if scale is not None:
        x = x * jnp.asarray(scale, x.dtype)
    if "positions" in params:
        if positions is None:
            positions = documents.segments_and_positions(tokens_BxL, tokens_BxL.shape[1], cfg, hooks)[1]
        if positions is None:
            positions = jnp.arange(tokens_BxL.shape[1])
        x = x + jnp.take(hooks(params["positions"], (None, None)), positions, axis=0)
    x = x.astype(jnp.dtype(cfg.compute_dtype))
    # Looked up whole over `tensor` first: under sequence parallelism XLA would otherwise gather the table.
    x = hooks(x, ("batch", "seq_context", "embed"))
    return hooks(x, ("batch", "seq", "embed"))


def head_matrix(params: Params) -> jax.Array:
    """[D, V]: the head, or the embedding table transposed when tied (no `head` entry)."""
    return params["head"] if "head" in params else params["embed"].T


def head_logits(h_BxLxD: jax.Array, params: Params, compute_dtype: str) -> jax.Array:
    """The final-normed `h` through the head, in compute dtype. A tied table is read as [V, D]: head_matrix's
    transpose was a copy of the whole table in every decode step on XLA's CPU backend."""
    dtype = jnp.dtype(compute_dtype)
    if "head" not in params:
        return jnp.einsum("bld,vd->blv", h_BxLxD, params["embed"].astype(dtype))
    return jnp.einsum("bld,dv->blv", h_BxLxD, params["head"].astype(dtype))


def mean_head_loss(h_BxLxD: jax.Array, params: Params, targets_BxL: jax.Array, cfg: ModelConfig, hooks: Hooks,
                   loss_mask_BxL: jax.Array | None) -> jax.Array:
    """Mean cross entropy over the counted targets of the final-normed `h` through the head (in chunks of
    model.loss_chunk_size positions, models/lm_loss.py); a head wider than model.vocab_size (a padded table) leaves
    its padding columns out of the softmax."""
    head_DxV = hooks.weight(head_matrix(params), ("embed", "vocab"))
    total, count = lm_loss.head_loss(h_BxLxD, head_DxV.astype(jnp.dtype(cfg.compute_dtype)), targets_BxL,
                                     loss_mask_BxL, cfg.loss_chunk_size, hooks, cfg.vocab_size)
    return total / jnp.maximum(count, 1.0)
