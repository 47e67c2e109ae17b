"""The Llama-3 family (Grattafiori et al. 2024) in Flax NNX: pre-norm blocks of RMSNorm, grouped-query
attention with rotary positions (theta and Llama 3.1's frequency scaling), a SwiGLU MLP, optionally a head
tied to the embedding. Same stacked-layer layout and contract as models/gpt.py.

Projections that read the same input are stored fused, so a tensor-parallel backward all-reduces one input
gradient per group rather than one per matrix (3 more all-reduces per layer when stored apart, measured by the
audit): wqkv [D, G, R+2, K] holds, for each of the G kv heads, its R = H/G query heads, then its key and its
value (query head g*R + r uses kv head g, as in transformers' repeat_kv); splitting G over `tensor` keeps whole
groups on a device. w_in [D, 2, F] holds the SwiGLU gate and up projections; wo [H, K, D], w_down [F, D].
With `qk_norm` (Qwen3) each block also holds q_norm and k_norm [K], RMSNorm scales shared by every head.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import contract, gpt, llama_hf, lora, moe, paged
from models.attention import attend_cached
from models.contract import Constrain, Params, no_constraint
from models.layers import decode_with_cache, empty_kv_cache, logical_axes, param, param_dict, rms_norm, rotary
from models.llama_config import LLAMA_PRESETS, LlamaConfig
from models.stack import layer_aux, run_stack

# Each block matrix's logical axes (after the leading `layers`), as declared and as the matmuls take them.
AXES = {"wqkv": ("embed", "heads", None, "kv"), "wo": ("heads", "kv", "embed"), "w_in": ("embed", None, "mlp"),
        "w_down": ("mlp", "embed")}


class Layers(nnx.Module):
    """The stacked blocks (leading `layers`, or the `lead` dimensions given; as gpt.Layers)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, lead: tuple = (), with_mlp: bool = True):
        S, A = lead or ((cfg.n_layers,), ("layers",))
        D, H, G, K, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_mlp
        dt = jnp.dtype(cfg.param_dtype)
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        self.attn_norm = param(rngs, (*S, D), (*A, "embed"), dt, None)
        self.wqkv = param(rngs, (*S, D, G, H // G + 2, K), (*A, *AXES["wqkv"]), dt, 0.02)
        self.wo = param(rngs, (*S, H, K, D), (*A, *AXES["wo"]), dt, out_std)
        if cfg.qk_norm:  # ones, drawing nothing: the other weights stay those of the same seed without them
            self.q_norm = param(rngs, (*S, K), (*A, "kv"), dt, None)
            self.k_norm = param(rngs, (*S, K), (*A, "kv"), dt, None)
        self.mlp_norm = param(rngs, (*S, D), (*A, "embed"), dt, None)
        if with_mlp:
            self.w_in = param(rngs, (*S, D, 2, F), (*A, *AXES["w_in"]), dt, 0.02)
            self.w_down = param(rngs, (*S, F, D), (*A, *AXES["w_down"]), dt, out_std)


class Experts(nnx.Module):
    """G groups' SwiGLU experts: w_in [G, E, D, 2, F] (gate and up), w_down [G, E, F, D]."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, G: int):
        E, D, F, dt = cfg.n_experts, cfg.d_model, cfg.d_mlp, jnp.dtype(cfg.param_dtype)
        self.w_in = param(rngs, (G, E, D, 2, F), ("layers", "experts", "embed", None, "mlp"), dt, 0.02)
        self.w_down = param(rngs, (G, E, F, D), ("layers", "experts", "mlp", "embed"), dt,
                            0.02 / math.sqrt(2 * cfg.n_layers))


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.param_dtype)
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), dt, 0.02)
        self.layers = gpt.stack(cfg, rngs, Layers, Experts)
        self.final_norm = param(rngs, (cfg.d_model,), ("embed",), dt, None)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), dt, 0.02)
        if lora.enabled(cfg):  # drawn last, so the base weights are those of the same seed without adapters
            gpt.add_adapters(self.layers, cfg, projections(cfg), rngs)


def projections(cfg: LlamaConfig) -> dict[str, lora.Projection]:
    """What each LoRA target adapts: q [D -> G, R, K], k and v [D -> G, K], the slices of the fused wqkv; o the
    output projection wo; mlp both w_in (gate and up together, [D -> 2, F]) and w_down."""
    D, H, G, K, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_mlp
    R = H // G
    return {"q": lora.Projection("wqkv", (slice(None), slice(None), slice(0, R)), (D,), ("embed",), (G, R, K),
                                 ("heads", None, "kv")),
            "k": lora.Projection("wqkv", (slice(None), slice(None), R), (D,), ("embed",), (G, K), ("heads", "kv")),
            "v": lora.Projection("wqkv", (slice(None), slice(None), R + 1), (D,), ("embed",), (G, K),
                                 ("heads", "kv")),
            "o": lora.Projection("wo", (), (H, K), ("heads", "kv"), (D,), ("embed",)),
            "mlp_in": lora.Projection("w_in", (), (D,), ("embed",), (2, F), (None, "mlp")),
            "mlp_out": lora.Projection("w_down", (), (F,), ("mlp",), (D,), ("embed",))}


def init_params(cfg: LlamaConfig, seed: int) -> Params:
    return param_dict(Llama(cfg, rngs=nnx.Rngs(params=seed)))


def abstract_params(cfg: LlamaConfig) -> tuple[Params, dict]:
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(params=0)))
    return param_dict(model), logical_axes(model)


# ----------------------------------------------------------------------------- the forward pass

def rope_frequencies(cfg: LlamaConfig) -> jax.Array:
    """float32 [K/2]: theta^(-2i/K), with Llama 3.1's scaling when set: wavelengths above
    context/low_freq_factor are divided by `factor`, those below context/high_freq_factor kept, and the
    band between interpolated smoothly (the formula of transformers' `_compute_llama3_parameters`)."""
    K = cfg.head_dim
    freqs = 1.0 / (cfg.rope_theta ** (jnp.arange(0, K, 2, dtype=jnp.float32) / K))
    if cfg.rope_scaling is None:
        return freqs
    factor, low, high, context = cfg.rope_scaling
    wavelen = 2 * math.pi / freqs
    scaled = jnp.where(wavelen > context / low, freqs / factor, freqs)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return jnp.where(medium, smoothed, scaled)


def weight(p: Params, name: str, cfg: LlamaConfig, constrain: Constrain) -> jax.Array:
    return gpt.weight(p, name, cfg, constrain, AXES)


def project_qkv(p: Params, h_BxLxD: jax.Array, cfg: LlamaConfig, constrain: Constrain,
                positions_L: jax.Array | None = None):
    """q [B, L, H, K] and k, v [B, L, G, K] of the normed input: the fused projection, LoRA, Qwen3's per-head
    q/k norms when `qk_norm`, then the rotary embedding on q and k."""
    names = ("batch", "seq", "heads", "kv")
    # Pinned with its heads split, so sequence parallelism gathers the normed input rather than the weight.
    qkv_BxLxGxRxK = constrain(jnp.einsum("bld,dgrk->blgrk", h_BxLxD, weight(p, "wqkv", cfg, constrain)),
                              ("batch", "seq", "heads", None, "kv"))
    B, L, G, R2, K = qkv_BxLxGxRxK.shape
    q_BxLxGxRxK = lora.add(qkv_BxLxGxRxK[:, :, :, :-2], p, "q", h_BxLxD, cfg)
    q = constrain(q_BxLxGxRxK.reshape(B, L, G * (R2 - 2), K), names)
    k, v = (constrain(lora.add(qkv_BxLxGxRxK[:, :, :, i], p, t, h_BxLxD, cfg), names)
            for i, t in ((-2, "k"), (-1, "v")))
    if cfg.qk_norm:  # over each head's K, before the rotation (transformers' Qwen3Attention)
        q, k = rms_norm(q, p["q_norm"], cfg.norm_eps), rms_norm(k, p["k_norm"], cfg.norm_eps)
    freqs = rope_frequencies(cfg)
    return rotary(q, freqs, positions_L), rotary(k, freqs, positions_L), v


def attention(p: Params, h_BxLxD: jax.Array, cfg: LlamaConfig, constrain: Constrain,
              positions_L: jax.Array | None = None, cache: Any = None, segment_ids_BxL: jax.Array | None = None):
    """Grouped-query causal attention, within packed documents when `segment_ids_BxL` is given. With `cache` =
    (k, v, length) of [B, S, G, K] buffers, the new keys and values are written at `length` and attention runs
    over the cache (decoding); returns (out, new cache)."""
    names = ("batch", "seq", "heads", "kv")
    q, k, v = project_qkv(p, h_BxLxD, cfg, constrain, positions_L)
    if cache is None:
        o = constrain.causal_attention(q, k, v, getattr(cfg, "attention", "xla"), segment_ids_BxL)
    else:
        o, cache = cache(q, k, v) if callable(cache) else attend_cached(q, k, v, *cache)  # paged.py
    o = constrain(o, names)
    out_BxLxD = lora.add(jnp.einsum("blhk,hkd->bld", o, weight(p, "wo", cfg, constrain)), p, "o", o, cfg)
    return constrain(out_BxLxD, ("batch", "seq", "embed")), cache


def mlp(p: Params, h_BxLxD: jax.Array, cfg: LlamaConfig, constrain: Constrain) -> jax.Array:
    # [B, L, 2, F], the weight's own order of free dimensions: "tblf" made XLA's CPU backend transpose the whole
    # weight in every call, a copy that dominated a decode step.
    gate_up = jnp.einsum("bld,dtf->bltf", h_BxLxD, weight(p, "w_in", cfg, constrain))
    gate_up = constrain(lora.add(gate_up, p, "mlp_in", h_BxLxD, cfg), ("batch", "seq", None, "mlp"))
    u_BxLxF = constrain(jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], ("batch", "seq", "mlp"))
    return lora.add(jnp.einsum("blf,fd->bld", u_BxLxF, weight(p, "w_down", cfg, constrain)), p, "mlp_out", u_BxLxF, cfg)


def block(p: Params, x_BxLxD: jax.Array, cfg: LlamaConfig, constrain: Constrain = no_constraint,
          positions_L: jax.Array | None = None, cache: Any = None, segment_ids_BxL: jax.Array | None = None):
    """One layer on unstacked weights `p`; returns (x, new cache or None)."""
    a, cache = attention(p, rms_norm(x_BxLxD, p["attn_norm"], cfg.norm_eps), cfg, constrain, positions_L, cache,
                         segment_ids_BxL)
    x_BxLxD = x_BxLxD + a
    out = mlp(p, rms_norm(x_BxLxD, p["mlp_norm"], cfg.norm_eps), cfg, constrain)
    return constrain(x_BxLxD + out, ("batch", "seq", "embed")), cache


def layer_stats(layers: Params, x_BxLxD: jax.Array, inputs_BxL: jax.Array, cfg: LlamaConfig,
                constrain: Constrain = no_constraint):
    """The stack (or any contiguous slice of it) with Llama's blocks (models/stack.py); returns (x, statistics:
    None, or a mixture's router statistics, `topk_margin` among them)."""
    return run_stack(layers, x_BxLxD, inputs_BxL, cfg, constrain,
                     lambda p, x, segments, positions: block(p, x, cfg, constrain, positions, None, segments)[0],
                     lambda p, h, segments, positions: attention(p, h, cfg, constrain, positions, None, segments)[0],
                     expert_mlp)


def run_layers(layers: Params, x_BxLxD: jax.Array, inputs_BxL: jax.Array, cfg: LlamaConfig,
               constrain: Constrain = no_constraint):
    """The contract's run_layers: (x, (aux loss, metrics))."""
    return layer_aux(*layer_stats(layers, x_BxLxD, inputs_BxL, cfg, constrain))


def expert_mlp(w: Params, x_ExNxD: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """Each expert's SwiGLU MLP on its own rows."""
    cdt = jnp.dtype(cfg.compute_dtype)
    gate_up = jnp.einsum("end,edtf->entf", x_ExNxD, w["w_in"].astype(cdt))  # the weight's order, as in mlp
    return jnp.einsum("enf,efd->end", jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], w["w_down"].astype(cdt))


def logits(params: Params, x_BxLxD: jax.Array, cfg: LlamaConfig, constrain: Constrain = no_constraint):
    out = gpt.head_logits(rms_norm(x_BxLxD, params["final_norm"], cfg.norm_eps), params, cfg)
    return constrain(out.astype(jnp.float32), ("batch", "seq", "vocab"))


def head_loss(params: Params, x_BxLxD: jax.Array, targets_BxL: jax.Array, cfg: LlamaConfig,
              constrain: Constrain = no_constraint, loss_mask_BxL: jax.Array | None = None):
    """As gpt.head_loss, through the head or the tied embedding: (loss, no metrics)."""
    params = lora.freeze(params, cfg)
    h = rms_norm(x_BxLxD, params["final_norm"], cfg.norm_eps)
    return gpt.mean_head_loss(h, gpt.head_matrix(params, cfg), targets_BxL, cfg, constrain, loss_mask_BxL), {}


# ----------------------------------------------------------------------------- decoding with a KV cache

def init_cache(cfg: LlamaConfig, batch: int, max_len: int) -> dict[str, jax.Array]:
    return empty_kv_cache(cfg, cfg.n_kv_heads, batch, max_len)


def decode(params: Params, tokens_BxT: jax.Array, cache: dict, length: jax.Array, cfg: LlamaConfig,
           constrain: Constrain = no_constraint):
    """Prefill or one step over the KV cache (models/layers.decode_with_cache)."""
    def cached_block(p, x, positions, kv):
        return block(p, x, cfg, constrain, positions, kv)

    return decode_with_cache(params, tokens_BxT, cache, length, cfg, constrain, gpt.embed, cached_block, logits)


def decode_paged(weights: Params, batch: paged.Batch, pools: dict, cfg: LlamaConfig,
                 constrain: Constrain = no_constraint):
    """The contract's paged decoding (models/paged.py) with Llama's own blocks."""
    pieces = paged.Pieces(
        embed=lambda top, tokens, positions: gpt.embed(top, tokens, cfg, constrain),
        block=lambda p, x, positions, attend: block(p, x, cfg, constrain, positions, attend),
        attention=lambda p, h, positions, attend: attention(p, h, cfg, constrain, positions, attend),
        expert_fn=lambda w, x: expert_mlp(w, x, cfg),
        norm=lambda p, x, name: rms_norm(x, p[name], cfg.norm_eps),
        logits=lambda top, x: logits(top, x, cfg, constrain))
    return paged.decode(weights, batch, pools, cfg, constrain, pieces)


# ----------------------------------------------------------------------------- sizes

def matmul_params(cfg: LlamaConfig, active: bool = False) -> int:
    """As gpt.matmul_params: every expert, or the k a token runs through when `active`."""
    D, H, G, K, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_mlp
    per_layer = 2 * D * H * K + 2 * D * G * K
    return cfg.n_layers * per_layer + moe.mlp_matmul_params(cfg, 3 * D * F, active) + D * cfg.vocab_size


def param_count(cfg: LlamaConfig) -> int:
    norms = (2 * cfg.n_layers + 1) * cfg.d_model + (2 * cfg.n_layers * cfg.head_dim if cfg.qk_norm else 0)
    table = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model  # a tied head is the table itself
    return matmul_params(cfg) + table + norms


def flops_per_token(cfg: LlamaConfig) -> float:
    """6N for the matmul weights (a mixture's active experts; LoRA as GPT) plus attention (as GPT; remat not
    counted)."""
    matmuls = lora.matmul_flops(cfg, matmul_params(cfg, active=True), projections(cfg))
    return matmuls + contract.causal_attention_flops(cfg)


def layer_bytes_per_token(cfg: LlamaConfig, remat: str, tensor: int) -> float:
    """As gpt.layer_bytes_per_token for grouped-query attention (q, k, v: (H + 2G) K wide, its output H K) and
    SwiGLU (gate, up and their product, F wide each)."""
    d, f, t, a, s = cfg.d_model, cfg.d_mlp, tensor, cfg.n_heads, cfg.seq_len
    qkv, rotated = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim
    b = jnp.dtype(cfg.compute_dtype).itemsize
    if remat == "full":
        return b * d
    if remat == "save_dots":  # the projections' outputs (qkv, attention out, gate and up) and the layer input
        return b * (3 * d + (qkv + 2 * f) / t)
    return b * (4 * d + (qkv + rotated + a * cfg.head_dim + 3 * f) / t + 2 * a * s / t)


def divisibility(cfg: LlamaConfig) -> dict:
    return {"heads": (("model.n_heads", cfg.n_heads), ("model.n_kv_heads", cfg.n_kv_heads)),
            "mlp": (("model.d_mlp", cfg.d_mlp),), "vocab": (("model.vocab_size", cfg.vocab_size),),
            "embed": (("model.d_model", cfg.d_model),), **moe.divisibility(cfg)}


FAMILY = contract.register(contract.Family(
    name="llama", config_cls=LlamaConfig, presets=LLAMA_PRESETS,
    forward=contract.Forward(init_params=init_params, abstract_params=abstract_params, embed=gpt.embed,
                             run_layers=run_layers, head_loss=head_loss, logits=logits, lora_projections=projections),
    parallel=contract.Parallel(lookup_keys=lambda cfg: () if cfg.tie_embeddings else ("embed",),
                               divisibility=divisibility, kv_heads=lambda cfg: cfg.n_kv_heads,
                               expert_buffers=moe.expert_buffers),
    cost=contract.Cost(flops_per_token=flops_per_token, param_count=param_count,
                       layer_bytes_per_token=layer_bytes_per_token),
    decoding=contract.Decoding(init_cache=init_cache, decode=decode, paged=decode_paged), hf=llama_hf.ADAPTER))
