"""The Gemma 3 family (Gemma Team 2025), text model, in Flax NNX: five sliding-window layers to one global layer
(`layer_specs`), each kind with its own rotary base, grouped-query attention (models/gqa.py) with per-head q/k
RMSNorm, a GeGLU MLP (models/glu.py), an RMSNorm before and after both halves of every block, all of them
x (1 + w) with w stored zero-centred as transformers' Gemma3RMSNorm, the embedding scaled by sqrt(d_model), and the
head tied to it. transformers' Gemma3ForCausalLM is the reference for names and numerics (models/gemma3_hf.py)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models import contract, gemma3_hf, glu, gqa, lora, stack, vocab
from models.contract import Block, Constrain, Hooks, Params, no_constraint
from models.gemma3_config import GEMMA3_PRESETS, Gemma3Config
from models.layer_spec import LayerSpec, Rope
from models.layers import logical_axes, param, param_dict, rms_norm, zeros

NORMS = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")  # [D] each, zero-centred


class Layers(nnx.Module):
    """The stacked blocks: every weight has a leading `layers` dimension."""

    def __init__(self, cfg: Gemma3Config, rngs: nnx.Rngs, lead: tuple = (), with_mlp: bool = True):
        S, A = lead = lead or ((cfg.n_layers,), ("layers",))
        D, K, dt = cfg.d_model, cfg.head_dim, jnp.dtype(cfg.param_dtype)
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        for name in NORMS:
            setattr(self, name, zeros((*S, D), (*A, "embed"), dt))
        self.q_norm = zeros((*S, K), (*A, "kv"), dt)
        self.k_norm = zeros((*S, K), (*A, "kv"), dt)
        gqa.declare(self, cfg, rngs, lead, out_std)
        glu.declare(self, cfg, rngs, lead, out_std)


class Gemma3(nnx.Module):
    def __init__(self, cfg: Gemma3Config, *, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.param_dtype)
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), dt, 0.02)
        self.layers = Layers(cfg, rngs)
        self.final_norm = zeros((cfg.d_model,), ("embed",), dt)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), dt, 0.02)
        if lora.enabled(cfg):  # drawn last, so the base weights are those of the same seed without adapters
            stack.add_adapters(self.layers, cfg, projections(cfg), rngs)


def projections(cfg: Gemma3Config) -> dict[str, lora.Projection]:
    """What each LoRA target adapts (models/gqa.py, models/glu.py)."""
    return {**gqa.projections(cfg), **glu.projections(cfg)}


def init_params(cfg: Gemma3Config, seed: int) -> Params:
    return param_dict(Gemma3(cfg, rngs=nnx.Rngs(params=seed)))


def abstract_params(cfg: Gemma3Config) -> tuple[Params, dict]:
    model = nnx.eval_shape(lambda: Gemma3(cfg, rngs=nnx.Rngs(params=0)))
    return param_dict(model), logical_axes(model)


def layer_specs(cfg: Gemma3Config) -> tuple[LayerSpec, ...]:
    """Global layers causal with rotary base rope_theta (linearly scaled by rope_linear_factor), the others sliding over
    sliding_window positions with base rope_local_theta."""
    scaled = cfg.rope_linear_factor != 1.0
    global_rope = Rope(cfg.rope_theta, "linear" if scaled else "none", cfg.rope_linear_factor if scaled else 1.0)
    sliding = LayerSpec("sliding", window=cfg.sliding_window, rope=Rope(cfg.rope_local_theta))
    return tuple(LayerSpec(rope=global_rope) if cfg.global_layer(i) else sliding for i in range(cfg.n_layers))


# ----------------------------------------------------------------------------- the forward pass

def norm(x: jax.Array, w: jax.Array, cfg: Gemma3Config) -> jax.Array:
    """Gemma's RMSNorm: x / rms(x) * (1 + w), in float32."""
    return rms_norm(x, 1.0 + w.astype(jnp.float32), cfg.norm_eps)


def attention(p: Params, x_BxLxD: jax.Array, rotate: contract.Rotate, attend: contract.Attend, cfg: Gemma3Config,
              hooks: Hooks) -> jax.Array:
    """The attention half: pre-norm, grouped-query projections, q/k norms, the layer's rotary embedding, queries
    scaled so the kernel's head_dim^-1/2 makes query_pre_attn_scalar^-1/2, `attend`, the output projection and its
    post-norm."""
    q, k, v = gqa.project(p, norm(x_BxLxD, p["attn_norm"], cfg), cfg, hooks)
    q, k = norm(q, p["q_norm"], cfg), norm(k, p["k_norm"], cfg)
    q, k = rotate(q, k)
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    if scalar != cfg.head_dim:
        q = q * jnp.asarray(math.sqrt(cfg.head_dim / scalar), q.dtype)
    return norm(gqa.output(p, attend(q, k, v), cfg, hooks), p["post_attn_norm"], cfg)


def block(cfg: Gemma3Config, hooks: Hooks) -> Block:
    """The contract's Block: both halves normed before and after."""
    return Block(attention=lambda p, x, rotate, attend: attention(p, x, rotate, attend, cfg, hooks),
                 mlp_input=lambda p, x: norm(x, p["mlp_norm"], cfg),
                 mlp=lambda p, h: glu.mlp(p, h, cfg, hooks, cfg.activation),
                 mlp_output=lambda p, y: norm(y, p["post_mlp_norm"], cfg))


def embed(params: Params, tokens_BxL: jax.Array, cfg: Gemma3Config, hooks: Hooks = no_constraint,
          positions: jax.Array | None = None) -> jax.Array:
    """The token embeddings times sqrt(d_model) (in the table's dtype, as transformers)."""
    return vocab.embed(params, tokens_BxL, cfg, hooks, positions, scale=math.sqrt(cfg.d_model))


def logits(params: Params, x_BxLxD: jax.Array, cfg: Gemma3Config, constrain: Constrain = no_constraint):
    out = vocab.head_logits(norm(x_BxLxD, params["final_norm"], cfg), params, cfg.compute_dtype)
    return constrain(out.astype(jnp.float32), ("batch", "seq", "vocab"))


def head_loss(params: Params, x_BxLxD: jax.Array, targets_BxL: jax.Array, cfg: Gemma3Config,
              constrain: Constrain = no_constraint, loss_mask_BxL: jax.Array | None = None):
    """Final norm, the tied head and cross entropy (models/vocab.py): (loss, no metrics)."""
    params = lora.freeze(params, cfg)
    h = norm(x_BxLxD, params["final_norm"], cfg)
    return vocab.mean_head_loss(h, params, targets_BxL, cfg, constrain, loss_mask_BxL), {}


# ----------------------------------------------------------------------------- sizes

def matmul_params(cfg: Gemma3Config) -> int:
    """Parameters that take part in matmuls: the blocks' projections and MLPs, and the head (the tied table)."""
    return cfg.n_layers * (gqa.matmul_params(cfg) + 3 * cfg.d_model * cfg.d_mlp) + cfg.d_model * cfg.vocab_size


def param_count(cfg: Gemma3Config) -> int:
    norms = cfg.n_layers * (len(NORMS) * cfg.d_model + 2 * cfg.head_dim) + cfg.d_model
    table = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model  # a tied head is the table itself
    return matmul_params(cfg) + table + norms


def flops_per_token(cfg: Gemma3Config) -> float:
    """Training FLOPs per token: 6N for the matmul weights (LoRA: 4N and 6 per adapter weight) plus attention,
    each sliding layer counted over its window (models/contract.attention_flops)."""
    return lora.matmul_flops(cfg, matmul_params(cfg), projections(cfg)) + contract.attention_flops(cfg)


def layer_bytes_per_token(cfg: Gemma3Config, remat: str, tensor: int) -> float:
    """Bytes one block keeps for its backward pass per token of a microbatch on one device (`tensor` ways), as
    llama.layer_bytes_per_token plus the two post-norms' outputs; the attention scores are XLA's whole L x L
    matrices in a sliding layer too (its window is a mask)."""
    d, t, a, s = cfg.d_model, tensor, cfg.n_heads, cfg.seq_len
    qkv, rotated, out = gqa.saved_widths(cfg)
    b = jnp.dtype(cfg.compute_dtype).itemsize
    if remat == "full":
        return b * d
    if remat == "save_dots":
        return b * (3 * d + (qkv + 2 * cfg.d_mlp) / t)
    return b * (6 * d + (qkv + rotated + out + glu.saved_width(cfg)) / t + 2 * a * s / t)


def divisibility(cfg: Gemma3Config) -> dict:
    return {"heads": (("model.n_heads", cfg.n_heads), ("model.n_kv_heads", cfg.n_kv_heads)),
            "mlp": (("model.d_mlp", cfg.d_mlp),), "vocab": (("model.vocab_size", cfg.vocab_size),),
            "embed": (("model.d_model", cfg.d_model),)}


FAMILY = contract.register(contract.Family(
    name="gemma3", config_cls=Gemma3Config, presets=GEMMA3_PRESETS,
    forward=contract.Forward(init_params=init_params, abstract_params=abstract_params, embed=embed,
                             run_layers=stack.runner(block), head_loss=head_loss, logits=logits,
                             lora_projections=projections),
    parallel=contract.Parallel(lookup_keys=lambda cfg: () if cfg.tie_embeddings else ("embed",),
                               divisibility=divisibility, kv_heads=lambda cfg: cfg.n_kv_heads),
    cost=contract.Cost(flops_per_token=flops_per_token, param_count=param_count,
                       layer_bytes_per_token=layer_bytes_per_token),
    layer_specs=layer_specs, block=block, hf=gemma3_hf.ADAPTER))
