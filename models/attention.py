"""Causal attention behind one function, with the kernel chosen by name: XLA's (any platform and dtype; it
builds every L x L score matrix) or cuDNN's fused flash attention (NVIDIA GPUs, bf16/fp16), both taking
grouped-query K/V heads, a sliding window, and optional segment ids so packed documents do not attend across their
boundary; and the two pieces a ring attention is built from: one block's output with its log-sum-exp, and their
combine.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "xla", "cudnn")
CUDNN_DTYPES = ("bfloat16", "float16")
# cuDNN's flash kernel takes head dimensions up to 128 that are multiples of 8 (checked in
# jax._src.cudnn.fused_attention_stablehlo.check_is_flash_attention on the installed JAX).
CUDNN_MAX_HEAD_DIM = 128


def cudnn_unsupported(platform: str, compute_dtype: str, head_dim: int) -> str | None:
    """Why cuDNN's fused attention cannot run this model here, or None when it can."""
    if platform != "gpu":
        return f"it needs an NVIDIA GPU (this platform is {platform})"
    if compute_dtype not in CUDNN_DTYPES:
        return f"it needs model.compute_dtype bfloat16 or float16 (not {compute_dtype})"
    if head_dim > CUDNN_MAX_HEAD_DIM or head_dim % 8:
        return f"it needs a head dimension <= {CUDNN_MAX_HEAD_DIM} and a multiple of 8 (not {head_dim})"
    return None


def resolve(requested: str, platform: str, compute_dtype: str, head_dim: int) -> str:
    """The kernel a run uses: `auto` takes cuDNN wherever it can run, XLA elsewhere. Raises ValueError (one line,
    naming model.attention) for an unknown name or an explicit choice this platform or shape cannot run."""
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"model.attention={requested!r}: use one of {', '.join(IMPLEMENTATIONS)}")
    why = cudnn_unsupported(platform, compute_dtype, head_dim)
    if requested == "auto":
        return "xla" if why else "cudnn"
    if requested == "cudnn" and why:
        raise ValueError(f"model.attention=cudnn: {why}; use model.attention=auto or xla")
    return requested


def segment_offsets(segment_ids_BxL: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """cuDNN's packed-sequence description of each row: (lengths [B, M], offsets [B, M+1]) with M =
    `max_segments`, unused entries -1. Segment ids must be non-decreasing along a row (packing order)."""
    B, L = segment_ids_BxL.shape
    starts_BxL = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids_BxL[:, 1:] != segment_ids_BxL[:, :-1]], axis=1)
    index_BxL = jnp.cumsum(starts_BxL, axis=1) - 1  # which segment of its row each token is in
    lengths = jax.vmap(lambda i: jnp.bincount(i, length=max_segments))(index_BxL)
    offsets = jnp.concatenate([jnp.zeros((B, 1), lengths.dtype), jnp.cumsum(lengths, axis=1)], axis=1)
    present = jnp.arange(max_segments)[None, :] < index_BxL[:, -1:] + 1
    lengths = jnp.where(present, lengths, -1).astype(jnp.int32)
    offsets = jnp.where(jnp.concatenate([jnp.ones((B, 1), bool), present], axis=1), offsets, -1).astype(jnp.int32)
    return lengths, offsets


def attend(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array, implementation: str,
           segment_ids_BxL: jax.Array | None = None, max_segments: int = 64, window: int = 0) -> jax.Array:
    """Causal attention of a resolved `implementation` (`xla` or `cudnn`); G (K/V heads) divides H. A `window` > 0
    keeps each query to the `window` latest positions, its own included (a sliding layer): both kernels take it
    (cuDNN as its sliding window length).

    With segment ids, XLA masks the cross-document scores (a [B, 1, L, L] boolean mask: XLA materializes the
    scores anyway), while cuDNN takes each row's document offsets and lengths and never builds a mask; rows
    holding more than `max_segments` documents are cut to the first ones there, so keep it above the most
    documents a row can hold. `auto` (a model config used outside train/config/experiment.py's resolution) is resolved
    here for the default backend and the inputs' dtype."""
    local = {"local_window_size": (window - 1, 0)} if window else {}
    if implementation == "auto":
        implementation = resolve("auto", jax.default_backend(), q_BxLxHxK.dtype.name, q_BxLxHxK.shape[-1])
    if implementation == "cudnn":
        if segment_ids_BxL is None:
            return jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, is_causal=True,
                                                implementation="cudnn", **local)
        from jax._src.cudnn import fused_attention_stablehlo as cudnn  # packed segments: not in jax.nn
        lengths, offsets = segment_offsets(segment_ids_BxL, max_segments)
        scale = q_BxLxHxK.shape[-1] ** -0.5
        return cudnn.dot_product_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, q_seqlen=lengths, kv_seqlen=lengths,
                                           q_offsets=offsets, kv_offsets=offsets, scale=scale,
                                           mask_type=cudnn.MaskType.PADDING_CAUSAL,
                                           sliding_window_length=window or None)
    assert implementation == "xla", implementation
    mask = None
    if segment_ids_BxL is not None:
        mask = (segment_ids_BxL[:, None, :, None] == segment_ids_BxL[:, None, None, :])
    return jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask=mask, is_causal=True,
                                        implementation="xla", **local)


def attention_block(q_BxQxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array,
                    allowed_QxS: jax.Array | None = None, empty_rows: bool = False) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of a block of queries over a block of keys (no mask unless `allowed_QxS`, [Q, S] or
    per row [B, 1, 1, Q, S]), in float32: (out [B, Q, H, K], log-sum-exp of each query's scores [B, Q, H]), what
    an online-softmax combine needs (`merge_blocks`). Grouped-query heads: query head g*R + r reads K/V head g.
    Every query row must keep a key unless `empty_rows`: a row that keeps none (packed documents: a block of
    another document) then gets out 0 and log-sum-exp -inf, with finite gradients."""
    B, Q, H, K = q_BxQxHxK.shape
    G = k_BxSxGxK.shape[2]
    q = q_BxQxHxK.reshape(B, Q, G, H // G, K).astype(jnp.float32)
    scores = jnp.einsum("bqgrk,bsgk->bgrqs", q, k_BxSxGxK.astype(jnp.float32)) * K ** -0.5
    if allowed_QxS is not None:
        scores = jnp.where(allowed_QxS, scores, -jnp.inf)
    if empty_rows:
        probs, lse_BxGxRxQ = _probs_of_maybe_empty_rows(scores)
    else:
        lse_BxGxRxQ = jax.nn.logsumexp(scores, axis=-1)
        probs = jnp.exp(scores - lse_BxGxRxQ[..., None])
    out = jnp.einsum("bgrqs,bsgk->bqgrk", probs, v_BxSxGxK.astype(jnp.float32)).reshape(B, Q, H, K)
    return out, jnp.moveaxis(lse_BxGxRxQ, 3, 1).reshape(B, Q, H)


def _probs_of_maybe_empty_rows(scores: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax over the last axis and its log-sum-exp, where a row of only -inf gives probabilities 0 and -inf:
    the shift and the divisor are kept finite there, so no NaN reaches the values or the gradients."""
    top = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.exp(scores - top)
    total = jnp.sum(weights, axis=-1)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    return weights / safe[..., None], jnp.where(seen, jnp.log(safe) + top[..., 0], -jnp.inf)


def merge_blocks(out1_BxQxHxK: jax.Array, lse1_BxQxH: jax.Array, out2_BxQxHxK: jax.Array,
                 lse2_BxQxH: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Online-softmax combine of two attention blocks over disjoint keys (Milakov & Gimelshein 2018): the
    result is the attention over both. `lse1` must be finite; `lse2` may be -inf (a block the queries skip)."""
    top = jnp.maximum(lse1_BxQxH, lse2_BxQxH)
    w1, w2 = jnp.exp(lse1_BxQxH - top), jnp.exp(lse2_BxQxH - top)
    total = w1 + w2
    out = (out1_BxQxHxK * w1[..., None] + out2_BxQxHxK * w2[..., None]) / total[..., None]
    return out, top + jnp.log(total)
