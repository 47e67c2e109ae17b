"""GPT-style decoder in Flax NNX: pre-norm blocks (RMSNorm, causal multi-head attention with rotary
positions, GELU MLP), untied output head, no biases; or, by its options (models/gpt_config.py), GPT-2's
architecture: LayerNorm, learned absolute positions, a bias in every projection, a head tied to the embedding.

The layer stack is stored as stacked parameters with a leading `layers` axis and run by `lax.scan`,
so one compiled block serves every layer and a pipeline stage is just a contiguous slice of the stack.
The NNX module owns parameter creation and the logical axis names of every weight; the forward pass
is a set of pure functions of a plain parameter dict, which is what jit, pipelines and Orbax consume.
Activations are annotated through a `constrain(x, logical_names)` hook that the caller supplies:
this package knows no mesh.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models import contract, gpt_hf, lm_loss, lora, moe, stack, vocab
from models.contract import Block, Constrain, Hooks, Params, no_constraint
from models.gpt_config import GPT_PRESETS, GPTConfig
from models.layer_spec import LayerSpec, Rope
from models.layers import layer_norm, logical_axes, param, param_dict, rms_norm, weight, zeros

# Each block matrix's logical axes (after the leading `layers`), as declared and as the matmuls take them.
AXES = {"wqkv": ("embed", None, "heads", "kv"), "wo": ("heads", "kv", "embed"), "w_in": ("embed", "mlp"),
        "w_out": ("mlp", "embed")}


class Layers(nnx.Module):
    """The stacked transformer blocks: every weight has a leading `layers` dimension (or the `lead` dimensions
    and their logical axes given, and no MLP matrices without `with_mlp`: a mixture-of-experts group's)."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs, lead: tuple = (), with_mlp: bool = True):
        S, A = lead or ((cfg.n_layers,), ("layers",))
        D, H, K, F = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_mlp
        dt = jnp.dtype(cfg.param_dtype)
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2: residual projections scaled by depth
        self.attn_norm = param(rngs, (*S, D), (*A, "embed"), dt, None)
        self.wqkv = param(rngs, (*S, D, 3, H, K), (*A, *AXES["wqkv"]), dt, 0.02)
        self.wo = param(rngs, (*S, H, K, D), (*A, *AXES["wo"]), dt, out_std)
        self.mlp_norm = param(rngs, (*S, D), (*A, "embed"), dt, None)
        if with_mlp:
            self.w_in = param(rngs, (*S, D, F), (*A, *AXES["w_in"]), dt, 0.02)
            self.w_out = param(rngs, (*S, F, D), (*A, *AXES["w_out"]), dt, out_std)
        for name, shape, axes in options_params(cfg, with_mlp):  # zeros: drawing nothing, they move no weight
            setattr(self, name, zeros((*S, *shape), (*A, *axes), dt))


def options_params(cfg: GPTConfig, with_mlp: bool = True) -> list[tuple[str, tuple, tuple]]:
    """(name, shape, logical axes) of one layer's biases that model.bias and model.norm=layernorm add."""
    D, H, K, F = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_mlp
    out = []
    if cfg.norm == "layernorm":
        out += [("attn_norm_bias", (D,), ("embed",)), ("mlp_norm_bias", (D,), ("embed",))]
    if cfg.bias:
        out += [("wqkv_bias", (3, H, K), (None, "heads", "kv")), ("wo_bias", (D,), ("embed",))]
        out += [("w_in_bias", (F,), ("mlp",)), ("w_out_bias", (D,), ("embed",))] if with_mlp else []
    return out


class Experts(nnx.Module):
    """G groups' experts, each a GELU MLP of the dense shape: w_in [G, E, D, F], w_out [G, E, F, D]."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs, G: int):
        E, D, F, dt = cfg.n_experts, cfg.d_model, cfg.d_mlp, jnp.dtype(cfg.param_dtype)
        self.w_in = param(rngs, (G, E, D, F), ("layers", "experts", "embed", "mlp"), dt, 0.02)
        self.w_out = param(rngs, (G, E, F, D), ("layers", "experts", "mlp", "embed"), dt,
                           0.02 / math.sqrt(2 * cfg.n_layers))


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = jnp.dtype(cfg.param_dtype)
        self.embed = param(rngs, (cfg.vocab_rows, cfg.d_model), ("vocab", "embed"), dt, 0.02)
        self.layers = stack.build(cfg, rngs, Layers, Experts)
        self.final_norm = param(rngs, (cfg.d_model,), ("embed",), dt, None)
        if cfg.norm == "layernorm":
            self.final_norm_bias = zeros((cfg.d_model,), ("embed",), dt)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.vocab_rows), ("embed", "vocab"), dt, 0.02)
        if cfg.positions == "learned":  # drawn after the others, so they are those of the same seed with rotary
            self.positions = param(rngs, (cfg.position_rows, cfg.d_model), (None, "embed"), dt, 0.02)
        if lora.enabled(cfg):  # drawn last, so the base weights are those of the same seed without adapters
            stack.add_adapters(self.layers, cfg, projections(cfg), rngs)

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        return contract.forward(param_dict(self), tokens_BxL, self.cfg)


def projections(cfg: GPTConfig) -> dict[str, lora.Projection]:
    """What each LoRA target adapts: q, k and v the three slices of the fused wqkv, o the output projection wo,
    mlp both MLP matrices (adapters `mlp_in` on w_in, `mlp_out` on w_out)."""
    D, H, K, F = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_mlp
    qkv = {t: lora.Projection("wqkv", (slice(None), i), (D,), ("embed",), (H, K), ("heads", "kv"))
           for i, t in enumerate("qkv")}
    return {**qkv, "o": lora.Projection("wo", (), (H, K), ("heads", "kv"), (D,), ("embed",)),
            "mlp_in": lora.Projection("w_in", (), (D,), ("embed",), (F,), ("mlp",)),
            "mlp_out": lora.Projection("w_out", (), (F,), ("mlp",), (D,), ("embed",))}


def init_params(cfg: GPTConfig, seed: int) -> Params:
    return param_dict(GPT(cfg, rngs=nnx.Rngs(params=seed)))


def abstract_params(cfg: GPTConfig) -> tuple[Params, dict]:
    """Shapes and logical axes of every parameter, without allocating any of them."""
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(params=0)))
    return param_dict(model), logical_axes(model)


# ----------------------------------------------------------------------------- the forward pass

def layer_specs(cfg: GPTConfig) -> tuple[LayerSpec, ...]:
    """Every layer causal: rotary at base 10,000, or none under learned positions; a mixture's every moe_every-th
    MLP of experts."""
    rope = Rope() if cfg.positions == "rotary" else None
    return tuple(LayerSpec(rope=rope, mlp=moe.mlp_kind(cfg, i)) for i in range(cfg.n_layers))


def biased(y: jax.Array, p: Params, name: str) -> jax.Array:
    """`y` plus the bias `name` (broadcast over its leading dimensions) when the layer has one."""
    return y + p[name].astype(y.dtype) if name in p else y


def norm(x: jax.Array, p: Params, name: str, cfg: GPTConfig) -> jax.Array:
    """The norm `name` of `x`: RMSNorm, or LayerNorm (with its `<name>_bias`) under model.norm=layernorm."""
    if cfg.norm == "layernorm":
        return layer_norm(x, p[name], p[name + "_bias"], cfg.norm_eps)
    return rms_norm(x, p[name], cfg.norm_eps)


def gelu(x: jax.Array, cfg: GPTConfig) -> jax.Array:
    """GELU, tanh-approximated (GPT-2's gelu_new) unless model.activation=gelu."""
    return jax.nn.gelu(x, approximate=cfg.activation != "gelu")


def attention(p: Params, x_BxLxD: jax.Array, rotate: contract.Rotate, attend: contract.Attend, cfg: GPTConfig,
              constrain: Constrain) -> jax.Array:
    """Causal multi-head attention of the normed input through `attend`, rotary unless positions are learned (the
    runner's `rotate` does nothing then: layer_specs)."""
    h_BxLxD = norm(x_BxLxD, p, "attn_norm", cfg)
    # Pinning the projection's output (heads split) makes sequence parallelism gather the normed input, not the weight.
    qkv = jnp.einsum("bld,dthk->tblhk", h_BxLxD, weight(p, "wqkv", AXES, cfg.compute_dtype, constrain))
    if "wqkv_bias" in p:
        qkv = qkv + p["wqkv_bias"].astype(qkv.dtype)[:, None, None]
    qkv = constrain(qkv, (None, "batch", "seq", "heads", "kv"))
    q, k, v = (constrain(lora.add(t, p, name, h_BxLxD, cfg), ("batch", "seq", "heads", "kv"))
               for t, name in zip((qkv[0], qkv[1], qkv[2]), "qkv"))
    q, k = rotate(q, k)
    o_BxLxHxK = constrain(attend(q, k, v), ("batch", "seq", "heads", "kv"))
    projected = jnp.einsum("blhk,hkd->bld", o_BxLxHxK, weight(p, "wo", AXES, cfg.compute_dtype, constrain))
    out_BxLxD = lora.add(biased(projected, p, "wo_bias"), p, "o", o_BxLxHxK, cfg)
    return constrain(out_BxLxD, ("batch", "seq", "embed"))


def mlp(p: Params, h_BxLxD: jax.Array, cfg: GPTConfig, constrain: Constrain) -> jax.Array:
    w_in, w_out = (weight(p, name, AXES, cfg.compute_dtype, constrain) for name in ("w_in", "w_out"))
    pre_BxLxF = biased(jnp.einsum("bld,df->blf", h_BxLxD, w_in), p, "w_in_bias")
    pre_BxLxF = lora.add(pre_BxLxF, p, "mlp_in", h_BxLxD, cfg)
    u_BxLxF = constrain(gelu(pre_BxLxF, cfg), ("batch", "seq", "mlp"))
    out_BxLxD = biased(jnp.einsum("blf,fd->bld", u_BxLxF, w_out), p, "w_out_bias")
    return lora.add(out_BxLxD, p, "mlp_out", u_BxLxF, cfg)


def expert_mlp(w: Params, x_ExNxD: jax.Array, cfg: GPTConfig) -> jax.Array:
    """Each expert's GELU MLP on its own rows."""
    cdt = jnp.dtype(cfg.compute_dtype)
    u_ExNxF = gelu(jnp.einsum("end,edf->enf", x_ExNxD, w["w_in"].astype(cdt)), cfg)
    return jnp.einsum("enf,efd->end", u_ExNxF, w["w_out"].astype(cdt))


def block(cfg: GPTConfig, hooks: Hooks) -> Block:
    """The contract's Block: pre-norm attention and GELU MLP."""
    return Block(attention=lambda p, x, rotate, attend: attention(p, x, rotate, attend, cfg, hooks),
                 mlp_input=lambda p, x: norm(x, p, "mlp_norm", cfg), mlp=lambda p, h: mlp(p, h, cfg, hooks),
                 expert_mlp=lambda w, x: expert_mlp(w, x, cfg))


def logits(params: Params, x_BxLxD: jax.Array, cfg: GPTConfig, constrain: Constrain = no_constraint):
    out = vocab.head_logits(norm(x_BxLxD, params, "final_norm", cfg), params, cfg.compute_dtype)
    return lm_loss.used(constrain(out.astype(jnp.float32), ("batch", "seq", "vocab")), cfg.vocab_size)


def head_loss(params: Params, x_BxLxD: jax.Array, targets_BxL: jax.Array, cfg: GPTConfig,
              constrain: Constrain = no_constraint, loss_mask_BxL: jax.Array | None = None):
    """Final norm, head and cross entropy: the one function the plain step, eval and the last pipeline
    cell call (in chunks of model.loss_chunk_size positions, see models/lm_loss.py). Returns (loss, no metrics)."""
    params = lora.freeze(params, cfg)
    return vocab.mean_head_loss(norm(x_BxLxD, params, "final_norm", cfg), params, targets_BxL, cfg, constrain,
                                loss_mask_BxL), {}


# ----------------------------------------------------------------------------- sizes

def matmul_params(cfg: GPTConfig, active: bool = False) -> int:
    """Parameters that take part in matmuls (the blocks and the head; the embedding is a lookup); with experts,
    all of them, or only the k a token runs through when `active`."""
    attention = 4 * cfg.d_model * cfg.d_model
    mlp = moe.mlp_matmul_params(cfg, 2 * cfg.d_model * cfg.d_mlp, active)
    return cfg.n_layers * attention + mlp + cfg.d_model * cfg.vocab_rows


def param_count(cfg: GPTConfig) -> int:
    """Every parameter (all experts of a mixture): a tied head is the table itself; the position table and the
    biases of GPT-2's options count too."""
    norms = (2 * cfg.n_layers + 1) * cfg.d_model * (2 if cfg.norm == "layernorm" else 1)
    table = 0 if cfg.tie_embeddings else cfg.vocab_rows * cfg.d_model
    positions = cfg.position_rows * cfg.d_model if cfg.positions == "learned" else 0
    biases = cfg.n_layers * sum(math.prod(shape) for name, shape, _ in options_params(cfg) if "norm" not in name)
    return matmul_params(cfg) + table + norms + positions + biases


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token: 6N for the matmul weights (forward 2N, backward 4N) plus the
    attention scores and values, 12 * layers * d_model * seq_len (Chowdhery et al. 2022, PaLM, App. B).
    Rematerialization is not counted: MFU measures useful model FLOPs; a mixture counts the k experts a token
    runs through (and the router), not all of them; with LoRA, 4N for the frozen weights and 6 per adapter weight."""
    matmuls = lora.matmul_flops(cfg, matmul_params(cfg, active=True), projections(cfg))
    return matmuls + contract.attention_flops(cfg)


def layer_bytes_per_token(cfg: GPTConfig, remat: str, tensor: int) -> float:
    """Bytes one block keeps for its backward pass, per token of a microbatch on one device (`tensor` ways)."""
    d, f, t, a, s = cfg.d_model, cfg.d_mlp, tensor, cfg.n_heads, cfg.seq_len
    b = jnp.dtype(cfg.compute_dtype).itemsize
    if remat == "full":
        return b * d  # the layer's input (the scan carry)
    if remat == "save_dots":  # the four projections' outputs and the layer input
        return b * (3 * d + (3 * d + f) / t)
    # x, the two norm outputs, the residual after attention (4d); q, k, v, rotary q, k, attention out,
    # MLP pre- and post-activation ((6d + 2f) / t); the attention scores and probabilities (2 a s / t)
    return b * (4 * d + (6 * d + 2 * f) / t + 2 * a * s / t)


def lookup_keys(cfg: GPTConfig) -> tuple[str, ...]:
    """The tables only looked up: the embedding unless it is the head too, and a learned position table."""
    return (() if cfg.tie_embeddings else ("embed",)) + (("positions",) if cfg.positions == "learned" else ())


def divisibility(cfg: GPTConfig) -> dict:
    padded = cfg.vocab_rows != cfg.vocab_size
    vocab = "model.vocab_size rounded up to model.vocab_multiple" if padded else "model.vocab_size"
    return {"heads": (("model.n_heads", cfg.n_heads),), "mlp": (("model.d_mlp", cfg.d_mlp),),
            "vocab": ((vocab, cfg.vocab_rows),), "embed": (("model.d_model", cfg.d_model),), **moe.divisibility(cfg)}


FAMILY = contract.register(contract.Family(
    name="gpt", config_cls=GPTConfig, presets=GPT_PRESETS,
    forward=contract.Forward(init_params=init_params, abstract_params=abstract_params, embed=vocab.embed,
                             run_layers=stack.runner(block), head_loss=head_loss, logits=logits,
                             lora_projections=projections),
    parallel=contract.Parallel(lookup_keys=lookup_keys, divisibility=divisibility, expert_buffers=moe.expert_buffers),
    cost=contract.Cost(flops_per_token=flops_per_token, param_count=param_count,
                       layer_bytes_per_token=layer_bytes_per_token),
    layer_specs=layer_specs, block=block, hf=gpt_hf.ADAPTER))
