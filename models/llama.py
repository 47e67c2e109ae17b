"""The Llama-3 family (Grattafiori et al. 2024) in Flax NNX: pre-norm blocks of RMSNorm, grouped-query attention
(models/gqa.py) with rotary positions (theta and Llama 3.1's frequency scaling), a SwiGLU MLP (models/glu.py),
optionally a head tied to the embedding; with `qk_norm` (Qwen3) each block also holds q_norm and k_norm [K], RMSNorm
scales shared by every head; with `n_experts` a mixture (Mixtral, Qwen3-MoE; models/moe.py). Every layer is causal
with the same rotary embedding (`layer_specs`)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models import contract, glu, gqa, llama_hf, lora, moe, stack, vocab
from models.contract import Block, Constrain, Hooks, Params, no_constraint
from models.layer_spec import LayerSpec, Rope
from models.layers import logical_axes, param, param_dict, rms_norm
from models.llama_config import LLAMA_PRESETS, LlamaConfig

AXES = {**gqa.AXES, **glu.AXES}  # each block matrix's logical axes (after the leading `layers`)


class Layers(nnx.Module):
    """The stacked blocks: every weight has a leading `layers` dimension (or the `lead` dimensions and their logical
    axes given, and no MLP matrices without `with_mlp`: a mixture-of-experts group's)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, lead: tuple = (), with_mlp: bool = True):
        S, A = lead = lead or ((cfg.n_layers,), ("layers",))
        D, K, dt = cfg.d_model, cfg.head_dim, jnp.dtype(cfg.param_dtype)
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        self.attn_norm = param(rngs, (*S, D), (*A, "embed"), dt, None)
        gqa.declare(self, cfg, rngs, lead, out_std)
        if cfg.qk_norm:  # ones, drawing nothing: the other weights stay those of the same seed without them
            self.q_norm = param(rngs, (*S, K), (*A, "kv"), dt, None)
            self.k_norm = param(rngs, (*S, K), (*A, "kv"), dt, None)
        self.mlp_norm = param(rngs, (*S, D), (*A, "embed"), dt, None)
        if with_mlp:
            glu.declare(self, cfg, rngs, lead, out_std)


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.param_dtype)
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), dt, 0.02)
        self.layers = stack.build(cfg, rngs, Layers, glu.Experts)
        self.final_norm = param(rngs, (cfg.d_model,), ("embed",), dt, None)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), dt, 0.02)
        if lora.enabled(cfg):  # drawn last, so the base weights are those of the same seed without adapters
            stack.add_adapters(self.layers, cfg, projections(cfg), rngs)


def projections(cfg: LlamaConfig) -> dict[str, lora.Projection]:
    """What each LoRA target adapts (models/gqa.py, models/glu.py)."""
    return {**gqa.projections(cfg), **glu.projections(cfg)}


def init_params(cfg: LlamaConfig, seed: int) -> Params:
    return param_dict(Llama(cfg, rngs=nnx.Rngs(params=seed)))


def abstract_params(cfg: LlamaConfig) -> tuple[Params, dict]:
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(params=0)))
    return param_dict(model), logical_axes(model)


def layer_specs(cfg: LlamaConfig) -> tuple[LayerSpec, ...]:
    """Every layer causal, with the model's rotary embedding; a mixture's every moe_every-th MLP of experts."""
    rope = Rope(cfg.rope_theta)
    if cfg.rope_scaling is not None:
        factor, low, high, context = cfg.rope_scaling
        rope = Rope(cfg.rope_theta, "llama3", factor, low, high, context)
    return tuple(LayerSpec(rope=rope, mlp=moe.mlp_kind(cfg, i)) for i in range(cfg.n_layers))


# ----------------------------------------------------------------------------- the forward pass

def attention(p: Params, x_BxLxD: jax.Array, rotate: contract.Rotate, attend: contract.Attend, cfg: LlamaConfig,
              hooks: Hooks) -> jax.Array:
    """Grouped-query attention of the normed input, Qwen3's per-head q/k norms (over each head's K, before the
    rotation, as transformers' Qwen3Attention) when `qk_norm`."""
    q, k, v = gqa.project(p, rms_norm(x_BxLxD, p["attn_norm"], cfg.norm_eps), cfg, hooks)
    if cfg.qk_norm:
        q, k = rms_norm(q, p["q_norm"], cfg.norm_eps), rms_norm(k, p["k_norm"], cfg.norm_eps)
    q, k = rotate(q, k)
    return gqa.output(p, attend(q, k, v), cfg, hooks)


def block(cfg: LlamaConfig, hooks: Hooks) -> Block:
    """The contract's Block: pre-norm attention and SwiGLU MLP, RMSNorm before each."""
    return Block(attention=lambda p, x, rotate, attend: attention(p, x, rotate, attend, cfg, hooks),
                 mlp_input=lambda p, x: rms_norm(x, p["mlp_norm"], cfg.norm_eps),
                 mlp=lambda p, h: glu.mlp(p, h, cfg, hooks, "silu"),
                 expert_mlp=lambda w, x: glu.expert_mlp(w, x, cfg, "silu"))


def logits(params: Params, x_BxLxD: jax.Array, cfg: LlamaConfig, constrain: Constrain = no_constraint):
    out = vocab.head_logits(rms_norm(x_BxLxD, params["final_norm"], cfg.norm_eps), params, cfg.compute_dtype)
    return constrain(out.astype(jnp.float32), ("batch", "seq", "vocab"))


def head_loss(params: Params, x_BxLxD: jax.Array, targets_BxL: jax.Array, cfg: LlamaConfig,
              constrain: Constrain = no_constraint, loss_mask_BxL: jax.Array | None = None):
    """Final norm, head (or the tied embedding) and cross entropy (models/vocab.py): (loss, no metrics)."""
    params = lora.freeze(params, cfg)
    h = rms_norm(x_BxLxD, params["final_norm"], cfg.norm_eps)
    return vocab.mean_head_loss(h, params, targets_BxL, cfg, constrain, loss_mask_BxL), {}


# ----------------------------------------------------------------------------- sizes

def matmul_params(cfg: LlamaConfig, active: bool = False) -> int:
    """Parameters that take part in matmuls (the blocks and the head; the embedding is a lookup): every expert, or
    the k a token runs through when `active`."""
    mlp = moe.mlp_matmul_params(cfg, 3 * cfg.d_model * cfg.d_mlp, active)
    return cfg.n_layers * gqa.matmul_params(cfg) + mlp + cfg.d_model * cfg.vocab_size


def param_count(cfg: LlamaConfig) -> int:
    norms = (2 * cfg.n_layers + 1) * cfg.d_model + (2 * cfg.n_layers * cfg.head_dim if cfg.qk_norm else 0)
    table = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model  # a tied head is the table itself
    return matmul_params(cfg) + table + norms


def flops_per_token(cfg: LlamaConfig) -> float:
    """Training FLOPs per token: 6N for the matmul weights (forward 2N, backward 4N; a mixture's active experts; with
    LoRA 4N for the frozen weights and 6 per adapter weight) plus attention (models/contract.attention_flops).
    Rematerialization is not counted: MFU measures useful model FLOPs."""
    matmuls = lora.matmul_flops(cfg, matmul_params(cfg, active=True), projections(cfg))
    return matmuls + contract.attention_flops(cfg)


def layer_bytes_per_token(cfg: LlamaConfig, remat: str, tensor: int) -> float:
    """Bytes one block keeps for its backward pass, per token of a microbatch on one device (`tensor` ways), under
    remat none | save_dots | full: grouped-query attention (q, k, v: (H + 2G) K wide, its output H K), SwiGLU (gate,
    up and their product, F wide each) and the attention scores and probabilities."""
    d, t, a, s = cfg.d_model, tensor, cfg.n_heads, cfg.seq_len
    qkv, rotated, out = gqa.saved_widths(cfg)
    b = jnp.dtype(cfg.compute_dtype).itemsize
    if remat == "full":
        return b * d  # the layer's input (the scan carry)
    if remat == "save_dots":  # the projections' outputs (qkv, attention out, gate and up) and the layer input
        return b * (3 * d + (qkv + 2 * cfg.d_mlp) / t)
    return b * (4 * d + (qkv + rotated + out + glu.saved_width(cfg)) / t + 2 * a * s / t)


def divisibility(cfg: LlamaConfig) -> dict:
    return {"heads": (("model.n_heads", cfg.n_heads), ("model.n_kv_heads", cfg.n_kv_heads)),
            "mlp": (("model.d_mlp", cfg.d_mlp),), "vocab": (("model.vocab_size", cfg.vocab_size),),
            "embed": (("model.d_model", cfg.d_model),), **moe.divisibility(cfg)}


FAMILY = contract.register(contract.Family(
    name="llama", config_cls=LlamaConfig, presets=LLAMA_PRESETS,
    forward=contract.Forward(init_params=init_params, abstract_params=abstract_params, embed=vocab.embed,
                             run_layers=stack.runner(block), head_loss=head_loss, logits=logits,
                             lora_projections=projections),
    parallel=contract.Parallel(lookup_keys=lambda cfg: () if cfg.tie_embeddings else ("embed",),
                               divisibility=divisibility, kv_heads=lambda cfg: cfg.n_kv_heads,
                               expert_buffers=moe.expert_buffers),
    cost=contract.Cost(flops_per_token=flops_per_token, param_count=param_count,
                       layer_bytes_per_token=layer_bytes_per_token),
    layer_specs=layer_specs, block=block, hf=llama_hf.ADAPTER))
