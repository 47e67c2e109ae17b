"""Grouped-query attention's projections (Ainslie et al. 2023), shared by the families that use them (Llama, Qwen3,
Mixtral, Gemma 3): projections that read the same input are stored fused, so a tensor-parallel backward all-reduces
one input gradient per group rather than one per matrix (3 more all-reduces per layer when stored apart, measured by
the audit). wqkv [D, G, R+2, K] holds, for each of the G kv heads, its R = H/G query heads, then its key and its
value (query head g*R + r uses kv head g, as in transformers' repeat_kv); splitting G over `tensor` keeps whole
groups on a device. wo [H, K, D]. The attention between the projections is the caller's (a LayerSpec's kind)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models import lora
from models.contract import Hooks, Params
from models.layers import param, weight
from models.protocols import TransformerConfig

# The matrices' logical axes (after the leading `layers`), as declared and as the matmuls take them.
AXES = {"wqkv": ("embed", "heads", None, "kv"), "wo": ("heads", "kv", "embed")}
NAMES = ("batch", "seq", "heads", "kv")


def declare(layer: nnx.Module, cfg: TransformerConfig, rngs: nnx.Rngs, lead: tuple, out_std: float) -> None:
    """The projections of a stacked layer module, with the `lead` (sizes, logical axes) of its stack."""
    S, A = lead
    D, H, G, K = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    dt = jnp.dtype(cfg.param_dtype)
    layer.wqkv = param(rngs, (*S, D, G, H // G + 2, K), (*A, *AXES["wqkv"]), dt, 0.02)
    layer.wo = param(rngs, (*S, H, K, D), (*A, *AXES["wo"]), dt, out_std)


def project(p: Params, h_BxLxD: jax.Array, cfg: TransformerConfig, hooks: Hooks):
    """q [B, L, H, K] and k, v [B, L, G, K] of the normed input: the fused projection and the LoRA adapters."""
    # Pinned with its heads split, so sequence parallelism gathers the normed input rather than the weight.
    qkv_BxLxGxRxK = hooks(jnp.einsum("bld,dgrk->blgrk", h_BxLxD, weight(p, "wqkv", AXES, cfg.compute_dtype, hooks)),
                          ("batch", "seq", "heads", None, "kv"))
    B, L, G, R2, K = qkv_BxLxGxRxK.shape
    q_BxLxGxRxK = lora.add(qkv_BxLxGxRxK[:, :, :, :-2], p, "q", h_BxLxD, cfg)
    q = hooks(q_BxLxGxRxK.reshape(B, L, G * (R2 - 2), K), NAMES)
    k, v = (hooks(lora.add(qkv_BxLxGxRxK[:, :, :, i], p, t, h_BxLxD, cfg), NAMES) for i, t in ((-2, "k"), (-1, "v")))
    return q, k, v


def output(p: Params, o_BxLxHxK: jax.Array, cfg: TransformerConfig, hooks: Hooks) -> jax.Array:
    """The attention's output through wo (and its adapter)."""
    o = hooks(o_BxLxHxK, NAMES)
    out_BxLxD = lora.add(jnp.einsum("blhk,hkd->bld", o, weight(p, "wo", AXES, cfg.compute_dtype, hooks)), p, "o", o,
                         cfg)
    return hooks(out_BxLxD, ("batch", "seq", "embed"))


def projections(cfg: TransformerConfig) -> dict[str, lora.Projection]:
    """What each attention LoRA target adapts: q [D -> G, R, K], k and v [D -> G, K], the slices of the fused wqkv;
    o the output projection wo."""
    D, H, G, K = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    R = H // G
    return {"q": lora.Projection("wqkv", (slice(None), slice(None), slice(0, R)), (D,), ("embed",), (G, R, K),
                                 ("heads", None, "kv")),
            "k": lora.Projection("wqkv", (slice(None), slice(None), R), (D,), ("embed",), (G, K), ("heads", "kv")),
            "v": lora.Projection("wqkv", (slice(None), slice(None), R + 1), (D,), ("embed",), (G, K),
                                 ("heads", "kv")),
            "o": lora.Projection("wo", (), (H, K), ("heads", "kv"), (D,), ("embed",))}


def matmul_params(cfg: TransformerConfig) -> int:
    """One layer's projection weights: q and o (H K wide each), k and v (G K)."""
    D, H, G, K = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    return 2 * D * H * K + 2 * D * G * K


def saved_widths(cfg: TransformerConfig) -> tuple[int, int, int]:
    """(projected, rotated, attention output) activation widths per token: q, k, v ((H + 2G) K); rotary q and k
    ((H + G) K); the attention's output (H K) (the planner's layer bytes)."""
    H, G, K = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    return (H + 2 * G) * K, (H + G) * K, H * K
