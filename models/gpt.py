"""GPT-style decoder in Flax NNX: pre-norm blocks (RMSNorm, causal multi-head attention with rotary
positions, GELU MLP), untied output head, no biases.

The layer stack is stored as stacked parameters with a leading `layers` axis and run by `lax.scan`,
so one compiled block serves every layer and a pipeline stage is just a contiguous slice of the stack.
The NNX module owns parameter creation and the logical axis names of every weight; the forward pass
is a set of pure functions of a plain parameter dict, which is what jit, pipelines and Orbax consume.
Activations are annotated through a `constrain(x, logical_names)` hook that the caller supplies:
this package knows no mesh.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.config import GPTConfig

Params = dict[str, Any]
Constrain = Callable[[jax.Array, tuple], jax.Array]


def no_constraint(x: jax.Array, names: tuple) -> jax.Array:
    return x


def _param(rngs: nnx.Rngs, shape, axes: tuple, dtype, std: float | None) -> nnx.Param:
    """A parameter carrying its logical axis names as metadata (`logical_axes`, one per dimension)."""
    assert len(shape) == len(axes), (shape, axes)
    value = jnp.ones(shape, dtype) if std is None else std * jax.random.normal(rngs.params(), shape, dtype)
    return nnx.Param(value, logical_axes=P(*axes))


class Layers(nnx.Module):
    """The stacked transformer blocks: every weight has a leading `layers` dimension."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        L, D, H, K, F = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_mlp
        dt = jnp.dtype(cfg.param_dtype)
        out_std = 0.02 / math.sqrt(2 * L)  # GPT-2: residual projections scaled by depth
        self.attn_norm = _param(rngs, (L, D), ("layers", "embed"), dt, None)
        self.wqkv = _param(rngs, (L, D, 3, H, K), ("layers", "embed", None, "heads", "kv"), dt, 0.02)
        self.wo = _param(rngs, (L, H, K, D), ("layers", "heads", "kv", "embed"), dt, out_std)
        self.mlp_norm = _param(rngs, (L, D), ("layers", "embed"), dt, None)
        self.w_in = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), dt, 0.02)
        self.w_out = _param(rngs, (L, F, D), ("layers", "mlp", "embed"), dt, out_std)


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = jnp.dtype(cfg.param_dtype)
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), dt, 0.02)
        self.layers = Layers(cfg, rngs)
        self.final_norm = _param(rngs, (cfg.d_model,), ("embed",), dt, None)
        self.head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), dt, 0.02)

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        return forward(param_dict(self), tokens_BxL, self.cfg)


def _nest(flat: dict[tuple, Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
        node[str(path[-1])] = value
    return out


def param_dict(model: nnx.Module) -> Params:
    """The parameters as a plain nested dict of arrays (what jit, pipelines and Orbax see)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def logical_axes(model: nnx.Module) -> dict:
    """A dict shaped like `param_dict(model)` whose leaves are PartitionSpecs of logical axis names."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return _nest({path: var.get_metadata()["logical_axes"] for path, var in flat})


def init_params(cfg: GPTConfig, seed: int) -> Params:
    return param_dict(GPT(cfg, rngs=nnx.Rngs(params=seed)))


def abstract_params(cfg: GPTConfig) -> tuple[Params, dict]:
    """Shapes and logical axes of every parameter, without allocating any of them."""
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(params=0)))
    return param_dict(model), logical_axes(model)


# ----------------------------------------------------------------------------- the forward pass

def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rotary(x_BxLxHxK: jax.Array) -> jax.Array:
    """Rotary position embedding (Su et al. 2021), half-split layout, positions 0..L-1."""
    L, K = x_BxLxHxK.shape[1], x_BxLxHxK.shape[3]
    freqs = 10000.0 ** (-jnp.arange(0, K // 2, dtype=jnp.float32) * 2 / K)
    angles_LxK2 = jnp.arange(L, dtype=jnp.float32)[:, None] * freqs[None, :]
    sin, cos = jnp.sin(angles_LxK2)[None, :, None, :], jnp.cos(angles_LxK2)[None, :, None, :]
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BxLxHxK.dtype)


def block(p: Params, x_BxLxD: jax.Array, cfg: GPTConfig, constrain: Constrain = no_constraint) -> jax.Array:
    """One pre-norm transformer block on unstacked weights `p` (one layer's slice)."""
    cdt = jnp.dtype(cfg.compute_dtype)
    h = rms_norm(x_BxLxD, p["attn_norm"])
    qkv = jnp.einsum("bld,dthk->tblhk", h, p["wqkv"].astype(cdt))
    q, k, v = (constrain(t, ("batch", "seq", "heads", "kv")) for t in (qkv[0], qkv[1], qkv[2]))
    o_BxLxHxK = jax.nn.dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
    o_BxLxHxK = constrain(o_BxLxHxK, ("batch", "seq", "heads", "kv"))
    x_BxLxD = x_BxLxD + constrain(jnp.einsum("blhk,hkd->bld", o_BxLxHxK, p["wo"].astype(cdt)),
                                  ("batch", "seq", "embed"))
    h = rms_norm(x_BxLxD, p["mlp_norm"])
    u_BxLxF = jax.nn.gelu(jnp.einsum("bld,df->blf", h, p["w_in"].astype(cdt)))
    u_BxLxF = constrain(u_BxLxF, ("batch", "seq", "mlp"))
    out = jnp.einsum("blf,fd->bld", u_BxLxF, p["w_out"].astype(cdt))
    return constrain(x_BxLxD + out, ("batch", "seq", "embed"))


def _remat(fn, policy: str):
    if policy == "none":
        return fn
    saveable = {"full": None, "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[policy]
    return jax.checkpoint(fn, policy=saveable, prevent_cse=False)


def run_layers(layers: Params, x_BxLxD: jax.Array, cfg: GPTConfig, constrain: Constrain = no_constraint):
    """Apply a stack (or any contiguous slice of it) of blocks with one scanned, rematerialized body."""
    body = _remat(lambda p, x: block(p, x, cfg, constrain), cfg.remat)
    x_BxLxD, _ = jax.lax.scan(lambda x, p: (body(p, x), None), x_BxLxD, layers)
    return x_BxLxD


def embed(params: Params, tokens_BxL: jax.Array, cfg: GPTConfig, constrain: Constrain = no_constraint):
    # Gather the table's `embed` dimension first (as FSDP does for any weight before use): XLA's
    # partitioner cannot look rows up in a table split along both dimensions without replicating it.
    table = constrain(params["embed"], ("vocab", None))
    x = jnp.take(table, tokens_BxL, axis=0).astype(jnp.dtype(cfg.compute_dtype))
    return constrain(x, ("batch", "seq", "embed"))


def logits(params: Params, x_BxLxD: jax.Array, cfg: GPTConfig, constrain: Constrain = no_constraint):
    h = rms_norm(x_BxLxD, params["final_norm"])
    out = jnp.einsum("bld,dv->blv", h, params["head"].astype(jnp.dtype(cfg.compute_dtype)))
    return constrain(out.astype(jnp.float32), ("batch", "seq", "vocab"))


def forward(params: Params, tokens_BxL: jax.Array, cfg: GPTConfig, constrain: Constrain = no_constraint):
    """Logits (float32) for every position."""
    x = embed(params, tokens_BxL, cfg, constrain)
    x = run_layers(params["layers"], x, cfg, constrain)
    return logits(params, x, cfg, constrain)


def cross_entropy(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    """Mean next-token cross entropy in nats."""
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, targets_BxL).mean()


def loss(params: Params, tokens_BxL1: jax.Array, cfg: GPTConfig, constrain: Constrain = no_constraint):
    """Language-model loss of a batch of `seq_len + 1` tokens per row (inputs and shifted targets)."""
    inputs, targets = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]
    return cross_entropy(forward(params, inputs, cfg, constrain), targets)


# ----------------------------------------------------------------------------- sizes

def matmul_params(cfg: GPTConfig) -> int:
    """Parameters that take part in matmuls (the blocks and the head; the embedding is a lookup)."""
    per_layer = 4 * cfg.d_model * cfg.d_model + 2 * cfg.d_model * cfg.d_mlp
    return cfg.n_layers * per_layer + cfg.d_model * cfg.vocab_size


def param_count(cfg: GPTConfig) -> int:
    norms = (2 * cfg.n_layers + 1) * cfg.d_model
    return matmul_params(cfg) + cfg.vocab_size * cfg.d_model + norms


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token: 6N for the matmul weights (forward 2N, backward 4N) plus the
    attention scores and values, 12 * layers * d_model * seq_len (Chowdhery et al. 2022, PaLM, App. B).
    Rematerialization is not counted: MFU measures useful model FLOPs."""
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.n_layers * cfg.d_model * cfg.seq_len
