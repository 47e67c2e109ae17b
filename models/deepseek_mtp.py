"""DeepSeek-V3's multi-token prediction (MTP; Liu et al. 2024, section 2.2): `num_nextn_predict_layers` modules
after the main model, the k-th predicting the token k+1 places ahead. Module k combines the previous depth's hidden
state h (the main model's last, before its final norm, for k = 1) with the embedding of the token k places ahead,
  h' = eh_proj [enorm(Emb(t_{i+k})); hnorm(h_i)],
runs one transformer block on h' (a mixture layer, as DeepSeek-V3's layer 61), and predicts t_{i+k+1} through its
own norm (head_norm, the checkpoint's shared_head.norm) and the shared output head; the embedding and the head are
the main model's. Its loss at depth k is the mean cross entropy over the positions whose target t_{i+k+1} is in the
row and counts (the paper divides by the row's length instead), and the MTP loss the mean over depths, which the
objective adds times `mtp_loss_weight` (DeepSeek's lambda).

The modules' weights live outside the layer stack under `mtp`, stacked [M, ...] on an unsplit leading axis, so the
last pipeline stage (which holds the head) runs them; their block has a mixture's weights (router, experts, the
balancing bias, shared experts) and its attention and norms under `moe`, as a stack group has."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models import documents, glu, moe, vocab
from models.contract import Block, Hooks, Params
from models.layer_spec import LayerSpec
from models.layers import param, remat, rms_norm, rotation, zeros
from models.protocols import ModelConfig

KEY = "mtp"  # its entry among the top parameters


class MTP(nnx.Module):
    """M modules' weights [M, ...]: enorm, hnorm [D], eh_proj [2, D, D] (embedding half, hidden half), head_norm [D],
    the block's attention and norms `moe` (`layers_cls`, without a dense MLP), and its mixture."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layers_cls: type, shared_cls: type | None):
        M, D, E, dt = cfg.num_nextn_predict_layers, cfg.d_model, cfg.n_experts, jnp.dtype(cfg.param_dtype)
        lead = ((M,), (None,))
        self.enorm = param(rngs, (M, D), (None, "embed"), dt, None)
        self.hnorm = param(rngs, (M, D), (None, "embed"), dt, None)
        self.eh_proj = param(rngs, (M, 2, D, D), (None, None, "embed", None), dt, 0.02)
        self.moe = layers_cls(cfg, rngs, lead, False)
        self.router = param(rngs, (M, D, E), (None, "embed", None), dt, D ** -0.5)
        self.experts = glu.Experts(cfg, rngs, M, cfg.moe_d_mlp, lead=None)
        if moe.has_bias(cfg):
            self.expert_bias = zeros((M, E), (None, None), jnp.float32)
        if shared_cls is not None:
            self.shared = shared_cls(cfg, rngs, lead)
        self.head_norm = param(rngs, (M, D), (None, "embed"), dt, None)


def active(cfg: ModelConfig) -> bool:
    """Whether the objective has an MTP loss (modules present and a weight above 0)."""
    return cfg.num_nextn_predict_layers > 0 and cfg.mtp_loss_weight > 0


def _ahead(a_BxL: jax.Array, k: int, order: jax.Array | None, fill=0) -> jax.Array:
    """a[:, i + k] at each position i (`fill` past the row's end), in the layout's order: a context-parallel
    layout's permuted sequence is put back in order for the shift and permuted again."""
    if order is not None:
        a_BxL = jnp.take(a_BxL, jnp.argsort(order), axis=1)
    shifted = jnp.concatenate([a_BxL[:, k:], jnp.full((a_BxL.shape[0], k), fill, a_BxL.dtype)], axis=1)
    return shifted if order is None else jnp.take(shifted, order, axis=1)


def loss(top: Params, x_BxLxD: jax.Array, targets_BxL: jax.Array, mask_BxL: jax.Array | None, cfg: ModelConfig,
         hooks: Hooks, block: Block, spec: LayerSpec) -> tuple[jax.Array, jax.Array]:
    """(the MTP loss, what the modules' mixtures add to the objective: their weighted router losses and balance
    taps) of the main model's last hidden state `x` (before its final norm) and its targets; `spec` the modules'
    LayerSpec (their rotary embedding)."""
    L = x_BxLxD.shape[1]
    order = hooks.context_order(L)
    positions = documents.segments_and_positions(targets_BxL, L, cfg, hooks)[1]
    rotate = rotation(spec.rope, spec.rope_dim, positions)
    attend = lambda q, k, v: hooks.causal_attention(q, k, v, cfg.attention, None, 0)  # noqa: E731
    counted = jnp.ones(targets_BxL.shape, bool) if mask_BxL is None else mask_BxL
    weights = top[KEY]

    def module(p, h, tokens_BxL):
        e = vocab.embed(top, tokens_BxL, cfg, hooks)
        eh = p["eh_proj"].astype(jnp.dtype(cfg.compute_dtype))
        h = (jnp.einsum("bld,de->ble", rms_norm(e, p["enorm"], cfg.norm_eps), eh[0])
             + jnp.einsum("bld,de->ble", rms_norm(h, p["hnorm"], cfg.norm_eps), eh[1]))
        h = hooks(h, ("batch", "seq", "embed"))
        h = h + block.attention(p["moe"], h, rotate, attend)
        return moe.mixture_half(p, h, cfg, hooks, block)

    step = remat(module, cfg.remat)
    h, losses, aux = x_BxLxD, [], jnp.zeros((), jnp.float32)
    for k in range(1, cfg.num_nextn_predict_layers + 1):
        p = jax.tree.map(lambda a, depth=k - 1: a[depth], weights)
        h, stats = step(p, h, _ahead(targets_BxL, k - 1, order))
        labels, valid = _ahead(targets_BxL, k, order), _ahead(counted, k, order, False)
        normed = rms_norm(h, p["head_norm"], cfg.norm_eps)
        losses.append(vocab.mean_head_loss(normed, top, labels, cfg, hooks, valid))
        aux = aux + moe.aux_loss(stats, cfg, stats.pop("balance_tap", None))
    return jnp.mean(jnp.stack(losses)), aux


def matmul_params(cfg: ModelConfig, per_block: int) -> int:
    """The modules' matmul weights beside their blocks' (`per_block` each): eh_proj."""
    return cfg.num_nextn_predict_layers * (2 * cfg.d_model * cfg.d_model + per_block)
