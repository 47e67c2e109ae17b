"""Multi-head latent attention (MLA: DeepSeek-V2, Liu et al. 2024, section 2.1), DeepSeek's attention half.

Queries come through a low rank when `q_lora_rank` > 0 (wq_a [D, Rq], its RMSNorm q_norm, wq_b [Rq, H, Kn+Kr]), else
one projection wq [D, H, Kn+Kr]. Keys and values come from one latent per token: wkv_a [D, R+Kr] gives the latent
c (R = kv_lora_rank, RMS-normed by kv_norm) and one rotary key k_r [Kr] shared by every head; wkv_b [R, H, Kn+Kv]
expands c into each head's non-rotary key [Kn] and value [Kv]; wo [H, Kv, D]. Under `tensor` the heads split
(wq or wq_b, wkv_b, wo) and the two latent projections (wq_a, wkv_a, a few hundred columns shared by every head,
normed as a whole) stay whole, each device computing them; under `fsdp` every matrix is split along its `embed`
dimension as any weight. The softmax scale is (Kn+Kr)^-1/2 times YaRN's mscale(factor, mscale_all_dim)^2.

Training expands the keys and values and calls the runner's attention (the values zero-padded to the key width,
which the kernels require). Decoding from the latent cache (models/paged.py: a token caches c and k_r, R+Kr numbers)
absorbs the expansion instead: a head's score q_n . (W_k c) is (W_k^T q_n) . c, and its output W_v^T (sum p c), so
the attention runs over the cached latent itself and no per-head key or value is ever built."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.contract import Attend, Hooks, Params, Rotate
from models.layers import param, rms_norm, weight, yarn_mscale
from models.protocols import ModelConfig

AXES = {"wq": ("embed", "heads", "kv"), "wq_a": ("embed", None), "wq_b": (None, "heads", "kv"),
        "wkv_a": ("embed", None), "wkv_b": (None, "heads", "kv"), "wo": ("heads", "kv", "embed")}
NAMES = ("batch", "seq", "heads", "kv")


def declare(layer: nnx.Module, cfg: ModelConfig, rngs: nnx.Rngs, lead: tuple, out_std: float) -> None:
    """The projections and the two latent norms of a stacked layer module, with its stack's `lead`."""
    S, A = lead
    D, H, R, dt = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank, jnp.dtype(cfg.param_dtype)
    Kn, Kr, Kv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank:
        layer.wq_a = param(rngs, (*S, D, cfg.q_lora_rank), (*A, *AXES["wq_a"]), dt, 0.02)
        layer.q_norm = param(rngs, (*S, cfg.q_lora_rank), (*A, None), dt, None)
        layer.wq_b = param(rngs, (*S, cfg.q_lora_rank, H, Kn + Kr), (*A, *AXES["wq_b"]), dt, 0.02)
    else:
        layer.wq = param(rngs, (*S, D, H, Kn + Kr), (*A, *AXES["wq"]), dt, 0.02)
    layer.wkv_a = param(rngs, (*S, D, R + Kr), (*A, *AXES["wkv_a"]), dt, 0.02)
    layer.kv_norm = param(rngs, (*S, R), (*A, None), dt, None)
    layer.wkv_b = param(rngs, (*S, R, H, Kn + Kv), (*A, *AXES["wkv_b"]), dt, 0.02)
    layer.wo = param(rngs, (*S, H, Kv, D), (*A, *AXES["wo"]), dt, out_std)


def softmax_scale(cfg: ModelConfig) -> float:
    """(Kn+Kr)^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN (transformers' yarn_apply_mscale)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope_scaling is not None and cfg.rope_scaling[5]:
        scale *= yarn_mscale(cfg.rope_scaling[0], cfg.rope_scaling[5]) ** 2
    return scale


def _w(p: Params, name: str, cfg: ModelConfig, hooks: Hooks) -> jax.Array:
    return weight(p, name, AXES, cfg.compute_dtype, hooks)


def queries(p: Params, h_BxLxD: jax.Array, cfg: ModelConfig, hooks: Hooks) -> jax.Array:
    """q [B, L, H, Kn+Kr] of the normed input, through the low rank when the model has one."""
    if cfg.q_lora_rank:
        low = rms_norm(jnp.einsum("bld,dq->blq", h_BxLxD, _w(p, "wq_a", cfg, hooks)), p["q_norm"], cfg.norm_eps)
        q = jnp.einsum("blq,qhk->blhk", low, _w(p, "wq_b", cfg, hooks))
    else:
        q = jnp.einsum("bld,dhk->blhk", h_BxLxD, _w(p, "wq", cfg, hooks))
    return hooks(q, NAMES)


def latent(p: Params, h_BxLxD: jax.Array, cfg: ModelConfig, hooks: Hooks) -> tuple[jax.Array, jax.Array]:
    """(the normed latent c [B, L, R], the rotary key before rotation [B, L, 1, Kr]) of the normed input."""
    R = cfg.kv_lora_rank
    kv = hooks(jnp.einsum("bld,dr->blr", h_BxLxD, _w(p, "wkv_a", cfg, hooks)), ("batch", "seq", None))
    return rms_norm(kv[..., :R], p["kv_norm"], cfg.norm_eps), kv[..., None, R:]


def attention(p: Params, h_BxLxD: jax.Array, rotate: Rotate, attend: Attend, cfg: ModelConfig,
              hooks: Hooks) -> jax.Array:
    """What MLA adds to the residual stream for the normed input `h`: over a latent cache where the runner's
    `attend` offers one (`attend.latent`, the paged decode), else over expanded keys and values."""
    Kn = cfg.qk_nope_head_dim
    q = queries(p, h_BxLxD, cfg, hooks)
    c_BxLxR, k_rope = latent(p, h_BxLxD, cfg, hooks)
    q_rope, k_rope = rotate(q[..., Kn:], k_rope)
    wkv_b = _w(p, "wkv_b", cfg, hooks)
    if getattr(attend, "latent", None) is not None:
        q_latent = jnp.einsum("blhk,rhk->blhr", q[..., :Kn], wkv_b[..., :Kn])  # the key expansion, absorbed
        o_latent = attend.latent(q_latent, q_rope, c_BxLxR, k_rope[:, :, 0], softmax_scale(cfg))
        o = jnp.einsum("blhr,rhv->blhv", o_latent.astype(q.dtype), wkv_b[..., Kn:])  # and the value's
    else:
        o = _expanded(q[..., :Kn], q_rope, c_BxLxR, k_rope, wkv_b, attend, cfg, hooks)
    out = jnp.einsum("blhv,hvd->bld", hooks(o, NAMES), _w(p, "wo", cfg, hooks))
    return hooks(out, ("batch", "seq", "embed"))


def _expanded(q_nope, q_rope, c_BxLxR, k_rope_BxLx1xKr, wkv_b, attend: Attend, cfg: ModelConfig,
              hooks: Hooks) -> jax.Array:
    """Each head's keys and values rebuilt from the latent, the attention over them: o [B, L, H, Kv]. The kernels
    take one width for q, k and v and scale by its -1/2 power: the narrower side is zero-padded and q rescaled so
    the scores are softmax_scale's."""
    Kn, Kv = cfg.qk_nope_head_dim, cfg.v_head_dim
    kv = hooks(jnp.einsum("blr,rhk->blhk", c_BxLxR, wkv_b), NAMES)
    H = kv.shape[2]
    k = jnp.concatenate([kv[..., :Kn], jnp.broadcast_to(k_rope_BxLx1xKr, (*kv.shape[:2], H, q_rope.shape[-1]))], -1)
    q = jnp.concatenate([q_nope, q_rope], -1)
    width = max(q.shape[-1], Kv)
    pad = lambda x: jnp.pad(x, ((0, 0),) * 3 + ((0, width - x.shape[-1]),)) if x.shape[-1] < width else x  # noqa
    factor = softmax_scale(cfg) * width ** 0.5  # the kernel's width^-1/2 times this is softmax_scale
    if factor != 1.0:
        q = q * jnp.asarray(factor, q.dtype)
    o = attend(hooks(pad(q), NAMES), hooks(pad(k), NAMES), hooks(pad(kv[..., Kn:]), NAMES))
    return o[..., :Kv]


def matmul_params(cfg: ModelConfig) -> int:
    """One layer's projection weights."""
    D, H, R = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank
    Kn, Kr, Kv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q = (D * cfg.q_lora_rank + cfg.q_lora_rank * H * (Kn + Kr)) if cfg.q_lora_rank else D * H * (Kn + Kr)
    return q + D * (R + Kr) + R * H * (Kn + Kv) + H * Kv * D


def norm_params(cfg: ModelConfig) -> int:
    return cfg.q_lora_rank + cfg.kv_lora_rank


def attention_flops(cfg: ModelConfig, keys: float) -> float:
    """Scores and values per token, forward and backward (6 FLOPs per multiply-add): H (Kn+Kr) for q.k and H Kv for
    p.v over `keys` keys (seq_len for a causal layer, as contract.attention_flops counts it)."""
    H = cfg.n_heads
    return 6.0 * H * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * keys


def saved_widths(cfg: ModelConfig) -> tuple[int, int, int]:
    """(projected, rotated, attention output) widths per token, as models/gqa.saved_widths counts them: the
    queries, the latent and the expanded keys and values; the rotated parts; the output (H Kv)."""
    H, R = cfg.n_heads, cfg.kv_lora_rank
    Kn, Kr, Kv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    return H * (Kn + Kr) + cfg.q_lora_rank + R + Kr + H * (Kn + Kv), (H + 1) * Kr, H * Kv


def cache_width(cfg: ModelConfig) -> int:
    """Numbers one token caches per layer: the latent and the rotary key."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim
