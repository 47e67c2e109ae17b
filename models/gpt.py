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
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import contract, gpt_hf, lm_loss, lora, moe, paged
from models.attention import attend_cached
from models.config import ModelConfigError, SharedFields
from models.contract import Constrain, Params, no_constraint
from models.gpt_config import GPT_PRESETS, GPTConfig
from models.layers import (
    decode_with_cache,
    empty_kv_cache,
    layer_norm,
    logical_axes,
    param,
    param_dict,
    rms_norm,
    rotary,
    zeros,
)
from models.stack import layer_aux, run_stack, segments_and_positions

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
    if getattr(cfg, "norm", "rmsnorm") == "layernorm":
        out += [("attn_norm_bias", (D,), ("embed",)), ("mlp_norm_bias", (D,), ("embed",))]
    if getattr(cfg, "bias", False):
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


def stack(cfg: GPTConfig, rngs: nnx.Rngs, layers_cls=Layers, experts_cls=Experts) -> nnx.Module:
    """The layer stack of a family: dense blocks, or mixture-of-experts groups (models/moe.py)."""
    if not moe.is_moe(cfg):
        return layers_cls(cfg, rngs)
    return moe.Groups(cfg, rngs, lambda shape, axes, with_mlp: layers_cls(cfg, rngs, (shape, axes), with_mlp),
                      lambda G: experts_cls(cfg, rngs, G))


def add_adapters(layers: nnx.Module, cfg: GPTConfig, projections: dict[str, lora.Projection],
                 rngs: nnx.Rngs) -> None:
    """The LoRA adapters of a stack: beside the blocks' weights, so each block finds its own under `lora`; a
    mixture's in its `dense` stack and `moe` blocks (the attention projections: config.check_lora refuses `mlp`)."""
    if not moe.is_moe(cfg):
        layers.lora = lora.Adapters(cfg, projections, rngs)
        return
    G, k = moe.groups(cfg), cfg.moe_every
    if k > 1:
        layers.dense.lora = lora.Adapters(cfg, projections, rngs, ((G, k - 1), ("layers", None)))
    layers.moe.lora = lora.Adapters(cfg, projections, rngs, ((G,), ("layers",)))


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = jnp.dtype(cfg.param_dtype)
        self.embed = param(rngs, (cfg.vocab_rows, cfg.d_model), ("vocab", "embed"), dt, 0.02)
        self.layers = stack(cfg, rngs)
        self.final_norm = param(rngs, (cfg.d_model,), ("embed",), dt, None)
        if cfg.norm == "layernorm":
            self.final_norm_bias = zeros((cfg.d_model,), ("embed",), dt)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.vocab_rows), ("embed", "vocab"), dt, 0.02)
        if cfg.positions == "learned":  # drawn after the others, so they are those of the same seed with rotary
            self.positions = param(rngs, (cfg.position_rows, cfg.d_model), (None, "embed"), dt, 0.02)
        if lora.enabled(cfg):  # drawn last, so the base weights are those of the same seed without adapters
            add_adapters(self.layers, cfg, projections(cfg), rngs)

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

def weight(p: Params, name: str, cfg: SharedFields, constrain: Constrain, axes: dict | None = None) -> jax.Array:
    """One layer's matrix `name` in the compute dtype, as the layout's hooks hand it to its matmul."""
    return constrain.weight(p[name], (axes or AXES)[name]).astype(jnp.dtype(cfg.compute_dtype))


def biased(y: jax.Array, p: Params, name: str, cfg: GPTConfig) -> jax.Array:
    """`y` plus the bias `name` (broadcast over its leading dimensions) when the layer has one."""
    return y + p[name].astype(y.dtype) if name in p else y


def norm(x: jax.Array, p: Params, name: str, cfg: GPTConfig) -> jax.Array:
    """The norm `name` of `x`: RMSNorm, or LayerNorm (with its `<name>_bias`) under model.norm=layernorm."""
    if getattr(cfg, "norm", "rmsnorm") == "layernorm":
        return layer_norm(x, p[name], p[name + "_bias"], cfg.norm_eps)
    return rms_norm(x, p[name], cfg.norm_eps)


def gelu(x: jax.Array, cfg: GPTConfig) -> jax.Array:
    """GELU, tanh-approximated (GPT-2's gelu_new) unless model.activation=gelu."""
    return jax.nn.gelu(x, approximate=getattr(cfg, "activation", "gelu_tanh") != "gelu")


def attention(p: Params, h_BxLxD: jax.Array, cfg: GPTConfig, constrain: Constrain,
              segment_ids_BxL: jax.Array | None = None, positions: jax.Array | None = None, cache: Any = None):
    """Causal multi-head attention of the normed input; with `cache` = (k, v, length) it decodes over the KV
    cache (models/attention.attend_cached). Returns (the output projection, the new cache or None)."""
    # Pinning the projection's output (heads split) makes sequence parallelism gather the normed input, not the weight.
    qkv = jnp.einsum("bld,dthk->tblhk", h_BxLxD, weight(p, "wqkv", cfg, constrain))
    if "wqkv_bias" in p:
        qkv = qkv + p["wqkv_bias"].astype(qkv.dtype)[:, None, None]
    qkv = constrain(qkv, (None, "batch", "seq", "heads", "kv"))
    q, k, v = (constrain(lora.add(t, p, name, h_BxLxD, cfg), ("batch", "seq", "heads", "kv"))
               for t, name in zip((qkv[0], qkv[1], qkv[2]), "qkv"))
    if getattr(cfg, "positions", "rotary") == "rotary":
        q, k = rotary(q, positions_L=positions), rotary(k, positions_L=positions)
    if cache is None:
        o_BxLxHxK = constrain.causal_attention(q, k, v, getattr(cfg, "attention", "xla"), segment_ids_BxL)
    else:
        o_BxLxHxK, cache = cache(q, k, v) if callable(cache) else attend_cached(q, k, v, *cache)  # paged.py
    o_BxLxHxK = constrain(o_BxLxHxK, ("batch", "seq", "heads", "kv"))
    projected = jnp.einsum("blhk,hkd->bld", o_BxLxHxK, weight(p, "wo", cfg, constrain))
    out_BxLxD = lora.add(biased(projected, p, "wo_bias", cfg), p, "o", o_BxLxHxK, cfg)
    return constrain(out_BxLxD, ("batch", "seq", "embed")), cache


def mlp(p: Params, h_BxLxD: jax.Array, cfg: GPTConfig, constrain: Constrain) -> jax.Array:
    pre_BxLxF = biased(jnp.einsum("bld,df->blf", h_BxLxD, weight(p, "w_in", cfg, constrain)), p, "w_in_bias", cfg)
    pre_BxLxF = lora.add(pre_BxLxF, p, "mlp_in", h_BxLxD, cfg)
    u_BxLxF = constrain(gelu(pre_BxLxF, cfg), ("batch", "seq", "mlp"))
    out_BxLxD = biased(jnp.einsum("blf,fd->bld", u_BxLxF, weight(p, "w_out", cfg, constrain)), p, "w_out_bias", cfg)
    return lora.add(out_BxLxD, p, "mlp_out", u_BxLxF, cfg)


def block(p: Params, x_BxLxD: jax.Array, cfg: GPTConfig, constrain: Constrain = no_constraint,
          segment_ids_BxL: jax.Array | None = None, positions_BxL: jax.Array | None = None,
          cache: Any = None) -> jax.Array | tuple[jax.Array, Any]:
    """One pre-norm transformer block on unstacked weights `p` (one layer's slice); packed documents'
    segment ids and positions (models/documents.py) when given. With a KV `cache`, returns (x, new cache)."""
    a, new_cache = attention(p, norm(x_BxLxD, p, "attn_norm", cfg), cfg, constrain, segment_ids_BxL, positions_BxL,
                             cache)
    x_BxLxD = x_BxLxD + a
    out = mlp(p, norm(x_BxLxD, p, "mlp_norm", cfg), cfg, constrain)
    x_BxLxD = constrain(x_BxLxD + out, ("batch", "seq", "embed"))
    return x_BxLxD if cache is None else (x_BxLxD, new_cache)


def layer_stats(layers: Params, x_BxLxD: jax.Array, inputs_BxL: jax.Array, cfg: GPTConfig,
                constrain: Constrain = no_constraint):
    """The stack (or any contiguous slice of it) with GPT's blocks (models/stack.py); returns (x, statistics:
    None, or a mixture's router statistics, `topk_margin` among them)."""
    return run_stack(layers, x_BxLxD, inputs_BxL, cfg, constrain,
                     lambda p, x, segments, positions: block(p, x, cfg, constrain, segments, positions),
                     lambda p, h, segments, positions: attention(p, h, cfg, constrain, segments, positions)[0],
                     expert_mlp)


def run_layers(layers: Params, x_BxLxD: jax.Array, inputs_BxL: jax.Array, cfg: GPTConfig,
               constrain: Constrain = no_constraint):
    """The contract's run_layers: (x, (aux loss, metrics))."""
    return layer_aux(*layer_stats(layers, x_BxLxD, inputs_BxL, cfg, constrain))


def expert_mlp(w: Params, x_ExNxD: jax.Array, cfg: GPTConfig) -> jax.Array:
    """Each expert's GELU MLP on its own rows."""
    cdt = jnp.dtype(cfg.compute_dtype)
    u_ExNxF = gelu(jnp.einsum("end,edf->enf", x_ExNxD, w["w_in"].astype(cdt)), cfg)
    return jnp.einsum("enf,efd->end", u_ExNxF, w["w_out"].astype(cdt))


def embed(params: Params, tokens_BxL: jax.Array, cfg: GPTConfig, constrain: Constrain = no_constraint,
          positions: jax.Array | None = None):
    """The token embeddings, plus under model.positions=learned the position table's rows at `positions` ([L] or
    [B, L]; by default each document's (models/documents.py) or the layout's order, else 0..L-1)."""
    params = lora.freeze(params, cfg)
    # Gather the table's `embed` dimension first (as FSDP does for any weight before use): XLA's
    # partitioner cannot look rows up in a table split along both dimensions without replicating it.
    table = constrain(params["embed"], ("vocab", None))
    x = jnp.take(table, tokens_BxL, axis=0)
    if getattr(cfg, "positions", "rotary") == "learned":
        if positions is None:
            positions = segments_and_positions(tokens_BxL, tokens_BxL.shape[1], cfg, constrain)[1]
        if positions is None:
            positions = jnp.arange(tokens_BxL.shape[1])
        x = x + jnp.take(constrain(params["positions"], (None, None)), positions, axis=0)
    x = x.astype(jnp.dtype(cfg.compute_dtype))
    # Looked up whole over `tensor` first: under sequence parallelism XLA would otherwise gather the table.
    x = constrain(x, ("batch", "seq_context", "embed"))
    return constrain(x, ("batch", "seq", "embed"))


def head_matrix(params: Params, cfg: GPTConfig) -> jax.Array:
    """[D, V]: the head, or the embedding table transposed when tied."""
    return params["embed"].T if cfg.tie_embeddings else params["head"]


def head_logits(h_BxLxD: jax.Array, params: Params, cfg: Any) -> jax.Array:
    """The final-normed `h` through the head, in compute dtype. A tied table is read as [V, D]: head_matrix's
    transpose was a copy of the whole table in every decode step on XLA's CPU backend."""
    dtype = jnp.dtype(cfg.compute_dtype)
    if cfg.tie_embeddings:
        return jnp.einsum("bld,vd->blv", h_BxLxD, params["embed"].astype(dtype))
    return jnp.einsum("bld,dv->blv", h_BxLxD, params["head"].astype(dtype))


def logits(params: Params, x_BxLxD: jax.Array, cfg: GPTConfig, constrain: Constrain = no_constraint):
    out = head_logits(norm(x_BxLxD, params, "final_norm", cfg), params, cfg)
    return lm_loss.used(constrain(out.astype(jnp.float32), ("batch", "seq", "vocab")), cfg.vocab_size)


def head_loss(params: Params, x_BxLxD: jax.Array, targets_BxL: jax.Array, cfg: GPTConfig,
              constrain: Constrain = no_constraint, loss_mask_BxL: jax.Array | None = None):
    """Final norm, head and cross entropy: the one function the plain step, eval and the last pipeline
    cell call (in chunks of model.loss_chunk_size positions, see models/lm_loss.py). Returns (loss, no metrics)."""
    params = lora.freeze(params, cfg)
    return mean_head_loss(norm(x_BxLxD, params, "final_norm", cfg), head_matrix(params, cfg), targets_BxL, cfg,
                          constrain, loss_mask_BxL), {}


def mean_head_loss(h_BxLxD, head_DxV, targets_BxL, cfg, constrain, loss_mask_BxL):
    """Mean cross entropy over the counted targets of the final-normed `h` through the head `head_DxV`."""
    head_DxV = constrain.weight(head_DxV, ("embed", "vocab"))
    total, count = lm_loss.head_loss(h_BxLxD, head_DxV.astype(jnp.dtype(cfg.compute_dtype)), targets_BxL,
                                     loss_mask_BxL, cfg.loss_chunk_size, constrain, cfg.vocab_size)
    return total / jnp.maximum(count, 1.0)


# ----------------------------------------------------------------------------- decoding with a KV cache

def init_cache(cfg: GPTConfig, batch: int, max_len: int) -> dict[str, jax.Array]:
    return empty_kv_cache(cfg, cfg.n_heads, batch, max_len)


def decode_paged(weights: Params, batch: Any, pools: dict, cfg: GPTConfig, constrain: Constrain = no_constraint):
    """The contract's paged decoding (models/paged.py) with GPT's own blocks; learned positions read each
    token's own position."""
    pieces = paged.Pieces(
        embed=lambda top, tokens, positions: embed(top, tokens, cfg, constrain, positions),
        block=lambda p, x, positions, attend: block(p, x, cfg, constrain, None, positions, attend),
        attention=lambda p, h, positions, attend: attention(p, h, cfg, constrain, None, positions, attend),
        expert_fn=lambda w, x: expert_mlp(w, x, cfg), norm=lambda p, x, name: norm(x, p, name, cfg),
        logits=lambda top, x: logits(top, x, cfg, constrain))
    return paged.decode(weights, batch, pools, cfg, constrain, pieces)


def decode(params: Params, tokens_BxT: jax.Array, cache: dict, length: jax.Array, cfg: GPTConfig,
           constrain: Constrain = no_constraint):
    """Prefill or one step over the KV cache (models/layers.decode_with_cache); learned positions count from each
    row's first real token (a left-padded row's `start`), as transformers' do from the attention mask."""
    def cached_block(p, x, positions, kv):
        return block(p, x, cfg, constrain, None, positions, kv)

    embed_fn = embed
    if cfg.positions == "learned":
        if cache["k"].shape[2] > cfg.position_rows:
            raise ModelConfigError(f"model.max_positions={cfg.position_rows}: the learned position table is shorter "
                                   f"than the prompt and new tokens ({cache['k'].shape[2]}); lower --max_new_tokens")
        positions = length + jnp.arange(tokens_BxT.shape[1])
        if "start" in cache:
            positions = jnp.maximum(positions[None, :] - cache["start"][:, None], 0)

        def embed_fn(params, tokens, cfg, constrain):
            return embed(params, tokens, cfg, constrain, positions)
    return decode_with_cache(params, tokens_BxT, cache, length, cfg, constrain, embed_fn, cached_block, logits)


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
    return matmuls + contract.causal_attention_flops(cfg)


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
    forward=contract.Forward(init_params=init_params, abstract_params=abstract_params, embed=embed,
                             run_layers=run_layers, head_loss=head_loss, logits=logits, lora_projections=projections),
    parallel=contract.Parallel(lookup_keys=lookup_keys, divisibility=divisibility, expert_buffers=moe.expert_buffers),
    cost=contract.Cost(flops_per_token=flops_per_token, param_count=param_count,
                       layer_bytes_per_token=layer_bytes_per_token),
    decoding=contract.Decoding(init_cache=init_cache, decode=decode, paged=decode_paged), hf=gpt_hf.ADAPTER))
