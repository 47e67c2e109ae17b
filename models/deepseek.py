"""The DeepSeek family (DeepSeek-V2/V3: Liu et al. 2024) in Flax NNX: pre-norm blocks of RMSNorm, multi-head latent
attention (models/deepseek_mla.py) with YaRN rotary scaling, `first_k_dense_replace` dense SwiGLU layers, then
mixture layers (models/moe.py) of fine-grained routed experts chosen by sigmoid scores in groups, shared experts and
the auxiliary-loss-free balancing bias; multi-token prediction modules after the last layer
(models/deepseek_mtp.py). transformers' DeepseekV3ForCausalLM is the reference for names and numerics
(models/deepseek_hf.py).

The dense prefix lives outside the layer stack (the top entry `prefix`, [k, ...] on an unsplit leading axis) and
runs right after the embedding (`embed`): the stack is the mixture layers alone, uniform, so a pipeline cuts it into
equal contiguous chunks (models.stack_length: n_layers - first_k_dense_replace) and the first stage runs the prefix
with the embedding. The paged decode hands `embed` the top parameters without `prefix` and runs those layers as its
first blocks (models/paged.unstack)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models import contract, deepseek_hf, deepseek_mla, deepseek_mtp, documents, glu, moe, stack, vocab
from models.contract import PREFIX, Block, Constrain, Hooks, Params, no_constraint
from models.deepseek_config import DEEPSEEK_PRESETS, DeepSeekConfig
from models.layer_spec import LayerSpec, Rope
from models.layers import logical_axes, param, param_dict, remat, rms_norm

AXES = {**deepseek_mla.AXES, **glu.AXES}


class Layers(nnx.Module):
    """Stacked blocks with the `lead` (sizes, logical axes) given: the norms and MLA, and a dense SwiGLU of width d_mlp
    unless `with_mlp` is False (a mixture layer's, whose MLP is the group's)."""

    def __init__(self, cfg: DeepSeekConfig, rngs: nnx.Rngs, lead: tuple, with_mlp: bool = True):
        S, A = lead
        dt = jnp.dtype(cfg.param_dtype)
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        self.attn_norm = param(rngs, (*S, cfg.d_model), (*A, "embed"), dt, None)
        deepseek_mla.declare(self, cfg, rngs, lead, out_std)
        self.mlp_norm = param(rngs, (*S, cfg.d_model), (*A, "embed"), dt, None)
        if with_mlp:
            glu.declare(self, cfg, rngs, lead, out_std)


class Shared(nnx.Module):
    """The shared experts of stacked mixture layers, one SwiGLU of width n_shared_experts x moe_d_mlp."""

    def __init__(self, cfg: DeepSeekConfig, rngs: nnx.Rngs, lead: tuple):
        glu.declare(self, cfg, rngs, lead, 0.02 / math.sqrt(2 * cfg.n_layers), moe.shared_width(cfg))


class DeepSeek(nnx.Module):
    def __init__(self, cfg: DeepSeekConfig, *, rngs: nnx.Rngs):
        dt, k = jnp.dtype(cfg.param_dtype), cfg.first_k_dense_replace
        shared = Shared if cfg.n_shared_experts else None
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), dt, 0.02)
        if k:
            setattr(self, PREFIX, Layers(cfg, rngs, ((k,), (None,))))
        self.layers = moe.Groups(cfg, rngs, lambda S, A, with_mlp: Layers(cfg, rngs, (S, A), with_mlp),
                                 lambda G: glu.Experts(cfg, rngs, G, cfg.moe_d_mlp),
                                 None if shared is None else lambda G: shared(cfg, rngs, ((G,), ("layers",))))
        self.final_norm = param(rngs, (cfg.d_model,), ("embed",), dt, None)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), dt, 0.02)
        if cfg.num_nextn_predict_layers:
            setattr(self, deepseek_mtp.KEY, deepseek_mtp.MTP(cfg, rngs, Layers, shared))


def init_params(cfg: DeepSeekConfig, seed: int) -> Params:
    return param_dict(DeepSeek(cfg, rngs=nnx.Rngs(params=seed)))


def abstract_params(cfg: DeepSeekConfig) -> tuple[Params, dict]:
    model = nnx.eval_shape(lambda: DeepSeek(cfg, rngs=nnx.Rngs(params=0)))
    return param_dict(model), logical_axes(model)


def rope(cfg: DeepSeekConfig) -> Rope:
    if cfg.rope_scaling is None:
        return Rope(cfg.rope_theta)
    factor, context, fast, slow, mscale, all_dim = cfg.rope_scaling
    return Rope(cfg.rope_theta, "yarn", factor, original_context=context, beta_fast=fast, beta_slow=slow,
                mscale=mscale, mscale_all_dim=all_dim)


def layer_specs(cfg: DeepSeekConfig) -> tuple[LayerSpec, ...]:
    """Every layer latent with the model's rotary embedding over qk_rope_head_dim; dense, then experts."""
    return tuple(LayerSpec("latent", latent_rank=cfg.kv_lora_rank, rope=rope(cfg), rope_dim=cfg.qk_rope_head_dim,
                           mlp=moe.mlp_kind(cfg, i)) for i in range(cfg.n_layers))


# ----------------------------------------------------------------------------- the forward pass

def block(cfg: DeepSeekConfig, hooks: Hooks) -> Block:
    """The contract's Block: pre-norm MLA and SwiGLU (the dense layers', the shared experts', each expert's)."""
    return Block(attention=lambda p, x, rotate, attend: deepseek_mla.attention(
                     p, rms_norm(x, p["attn_norm"], cfg.norm_eps), rotate, attend, cfg, hooks),
                 mlp_input=lambda p, x: rms_norm(x, p["mlp_norm"], cfg.norm_eps),
                 mlp=lambda p, h: glu.mlp(p, h, cfg, hooks, "silu"),
                 expert_mlp=lambda w, x: glu.expert_mlp(w, x, cfg, "silu"))


def embed(params: Params, tokens_BxL: jax.Array, cfg: DeepSeekConfig, hooks: Hooks = no_constraint,
          positions: jax.Array | None = None) -> jax.Array:
    """The token embeddings, then the dense prefix's layers where `params` holds them (module docstring)."""
    x = vocab.embed(params, tokens_BxL, cfg, hooks, positions)
    if PREFIX not in params:
        return x
    b = block(cfg, hooks)
    segment_ids, rows_positions = documents.segments_and_positions(tokens_BxL, x.shape[1], cfg, hooks)
    attention = stack.AttentionHalves(b, cfg, hooks, segment_ids, rows_positions)
    layer = remat(lambda p, x: stack.mlp_half(b, p, x + attention(p, x, None), hooks), cfg.remat)
    x, _ = jax.lax.scan(lambda x, p: (layer(p, x), None), x, params[PREFIX])
    return x


def logits(params: Params, x_BxLxD: jax.Array, cfg: DeepSeekConfig, constrain: Constrain = no_constraint):
    out = vocab.head_logits(rms_norm(x_BxLxD, params["final_norm"], cfg.norm_eps), params, cfg.compute_dtype)
    return constrain(out.astype(jnp.float32), ("batch", "seq", "vocab"))


def head_loss(params: Params, x_BxLxD: jax.Array, targets_BxL: jax.Array, cfg: DeepSeekConfig,
              constrain: Constrain = no_constraint, loss_mask_BxL: jax.Array | None = None):
    """Final norm, head and cross entropy (models/vocab.py); with MTP on, plus mtp_loss_weight times the MTP loss
    and the modules' router terms: (that objective, {"loss": the language-model loss alone, "mtp_loss"})."""
    lm = vocab.mean_head_loss(rms_norm(x_BxLxD, params["final_norm"], cfg.norm_eps), params, targets_BxL, cfg,
                              constrain, loss_mask_BxL)
    if not deepseek_mtp.active(cfg):
        return lm, {}
    mtp, aux = deepseek_mtp.loss(params, x_BxLxD, targets_BxL, loss_mask_BxL, cfg, constrain, block(cfg, constrain),
                                 layer_specs(cfg)[-1])
    return lm + cfg.mtp_loss_weight * mtp + aux, {"loss": lm, "mtp_loss": mtp}


# ----------------------------------------------------------------------------- sizes

def _mlp(cfg: DeepSeekConfig, width: int) -> int:
    return 3 * cfg.d_model * width


def _mixture(cfg: DeepSeekConfig, active: bool) -> int:
    """One mixture layer's MLP weights: the experts (all, or the k a token runs), the shared ones and the router."""
    experts = cfg.experts_per_token if active else cfg.n_experts
    return experts * _mlp(cfg, cfg.moe_d_mlp) + _mlp(cfg, moe.shared_width(cfg)) + cfg.d_model * cfg.n_experts


def matmul_params(cfg: DeepSeekConfig, active: bool = False, with_mtp: bool = True) -> int:
    """Parameters that take part in matmuls (the blocks, the MTP modules when `with_mtp`, the head; the embedding is
    a lookup): every expert, or the k a token runs through when `active`."""
    k = cfg.first_k_dense_replace
    layer = deepseek_mla.matmul_params(cfg)
    stack_ = cfg.n_layers * layer + k * _mlp(cfg, cfg.d_mlp) + (cfg.n_layers - k) * _mixture(cfg, active)
    mtp = deepseek_mtp.matmul_params(cfg, layer + _mixture(cfg, active)) if with_mtp else 0
    return stack_ + mtp + cfg.d_model * cfg.vocab_size


def param_count(cfg: DeepSeekConfig) -> int:
    M, D = cfg.num_nextn_predict_layers, cfg.d_model
    per_layer = 2 * D + deepseek_mla.norm_params(cfg)
    norms = (cfg.n_layers + M) * per_layer + D + 3 * M * D
    bias = (cfg.n_layers - cfg.first_k_dense_replace + M) * cfg.n_experts if moe.has_bias(cfg) else 0
    table = 0 if cfg.tie_embeddings else cfg.vocab_size * D
    return matmul_params(cfg) + table + norms + bias


def flops_per_token(cfg: DeepSeekConfig) -> float:
    """Training FLOPs per token: 6N for the active matmul weights (the MTP modules' only when their loss is on)
    plus MLA's scores and values over seq_len keys per layer (deepseek_mla.attention_flops)."""
    mtp = deepseek_mtp.active(cfg)
    layers = cfg.n_layers + (cfg.num_nextn_predict_layers if mtp else 0)
    heads = (cfg.num_nextn_predict_layers if mtp else 0) * cfg.d_model * cfg.vocab_size
    return 6.0 * (matmul_params(cfg, active=True, with_mtp=mtp) + heads) + attention_flops(cfg) * layers / cfg.n_layers


def attention_flops(cfg: DeepSeekConfig) -> float:
    return cfg.n_layers * deepseek_mla.attention_flops(cfg, cfg.seq_len)


def layer_bytes_per_token(cfg: DeepSeekConfig, remat: str, tensor: int) -> float:
    """Bytes one block keeps for its backward pass, per token of a microbatch on one device (`tensor` ways): MLA's
    projections (deepseek_mla.saved_widths), a SwiGLU of the active experts' and shared width, and the scores."""
    d, t, a, s = cfg.d_model, tensor, cfg.n_heads, cfg.seq_len
    projected, rotated, out = deepseek_mla.saved_widths(cfg)
    width = cfg.experts_per_token * cfg.moe_d_mlp + moe.shared_width(cfg)
    b = jnp.dtype(cfg.compute_dtype).itemsize
    if remat == "full":
        return b * d
    if remat == "save_dots":
        return b * (3 * d + (projected + 2 * width) / t)
    return b * (4 * d + (projected + rotated + out + 3 * width) / t + 2 * a * s / t)


def divisibility(cfg: DeepSeekConfig) -> dict:
    widths = [("model.d_mlp", cfg.d_mlp), ("model.moe_d_mlp", cfg.moe_d_mlp)]
    if cfg.n_shared_experts:
        widths.append(("model.n_shared_experts x model.moe_d_mlp", moe.shared_width(cfg)))
    return {"heads": (("model.n_heads", cfg.n_heads),), "mlp": tuple(widths),
            "vocab": (("model.vocab_size", cfg.vocab_size),), "embed": (("model.d_model", cfg.d_model),),
            **moe.divisibility(cfg)}


FAMILY = contract.register(contract.Family(
    name="deepseek", config_cls=DeepSeekConfig, presets=DEEPSEEK_PRESETS,
    forward=contract.Forward(init_params=init_params, abstract_params=abstract_params, embed=embed,
                             run_layers=stack.runner(block), head_loss=head_loss, logits=logits),
    parallel=contract.Parallel(lookup_keys=lambda cfg: () if cfg.tie_embeddings else ("embed",),
                               divisibility=divisibility, kv_heads=lambda cfg: cfg.n_heads,
                               expert_buffers=moe.expert_buffers),
    cost=contract.Cost(flops_per_token=flops_per_token, param_count=param_count,
                       attention_flops_per_token=attention_flops, layer_bytes_per_token=layer_bytes_per_token),
    layer_specs=layer_specs, block=block, hf=deepseek_hf.ADAPTER))
