"""Mixture-of-experts blocks (Shazeer et al. 2017; GShard; Switch; Mixtral): a float32 router picks each token's
top-k experts, tokens are copied into fixed-size per-expert buffers (one row of the batch at a time, so every
layout drops the same tokens), the experts run on their buffers, and the outputs are gathered back, weighted.

The layer stack of an MoE model is a scan over groups of `moe_every` blocks: (moe_every - 1) dense blocks, then
one block whose MLP is the mixture. Each group's weights keep the leading `layers` axis (of n_layers / moe_every).
Where the experts run is the caller's business (`Hooks.moe_experts`): on one device here, with all-to-alls over
the `expert` mesh axis in sharding/experts.py.

DeepSeek's mixture (DeepSeek-V3, Liu et al. 2024) adds, where its config has them: a dense prefix of
`first_k_dense_replace` layers before the groups (held by the family outside the stack: `dense_prefix`),
sigmoid scores chosen in groups (`n_group`, `topk_group`), scaled by `routed_scaling_factor`, shared experts every
token runs through (`shared`), and the auxiliary-loss-free balancing bias `expert_bias` [E] per layer, added to
the scores only to choose experts. The bias gets no gradient of the loss: the layer adds `balance_tap` to the
objective, 0 in value, whose derivative with respect to the bias is the layer's expert load, so every layout's
reduction of gradients (accumulation, pipeline stages, data and expert axes) brings the step's load to the
optimizer, which moves the bias by its rate against the sign of each expert's excess (train/state.py).
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from models.contract import Block, Constrain, ExpertBuffers, Params
from models.layers import param, remat, zeros
from models.protocols import ModelConfig

# The scalars a mixture logs beside the language-model loss (per-expert load: moe_load_e0, moe_load_e1, ...).
METRICS = ("moe_z_loss", "moe_load_balance_loss", "moe_dropped_fraction")


def is_moe(cfg: ModelConfig) -> bool:
    return getattr(cfg, "n_experts", 0) > 0


def on_whole_rows(keys: tuple[str, ...]) -> bool:
    """Whether the layer-stack parameter at `keys` (below `layers`) belongs to an MoE block's second half (norm,
    router, experts: _mlp_half_on_rows), which a context-parallel layout runs on rows split over `context`, so
    its gradient is summed over the batch axes and `context` at once."""
    return keys[:1] in (("router",), ("experts",), (BIAS,), ("shared",)) or keys[:2] == ("moe", "mlp_norm")


def mlp_kind(cfg: ModelConfig, layer: int) -> str:
    """`experts` for the MLP of a mixture's MoE block (each group's last, every moe_every-th layer), else `dense`:
    what a family's LayerSpec of layer `layer` says."""
    k = dense_prefix(cfg)
    return "experts" if is_moe(cfg) and layer >= k and (layer - k + 1) % cfg.moe_every == 0 else "dense"


def dense_prefix(cfg: ModelConfig) -> int:
    """Dense layers before the first group (DeepSeek's first_k_dense_replace; 0 for the others)."""
    return getattr(cfg, "first_k_dense_replace", 0) if is_moe(cfg) else 0


def groups(cfg: ModelConfig) -> int:
    return (cfg.n_layers - dense_prefix(cfg)) // cfg.moe_every


def has_bias(cfg: ModelConfig) -> bool:
    """Whether each mixture layer keeps a balancing bias (sigmoid scores: DeepSeek-V3's noaux_tc routing)."""
    return is_moe(cfg) and getattr(cfg, "scoring_func", "softmax") == "sigmoid"


def shared_width(cfg: ModelConfig) -> int:
    """The shared experts' MLP width (n_shared_experts of moe_d_mlp each, run as one MLP), 0 without them."""
    return getattr(cfg, "n_shared_experts", 0) * getattr(cfg, "moe_d_mlp", 0) if is_moe(cfg) else 0


BIAS = "expert_bias"  # the balancing bias's leaf name, which the optimizer moves by the load (train/state.py)


def is_bias(path: tuple) -> bool:
    """Whether a parameter's pytree path names a balancing bias."""
    return bool(path) and str(getattr(path[-1], "key", path[-1])) == BIAS


def bias_update_speed(cfg: ModelConfig) -> float | None:
    """How far the optimizer moves a balancing bias per step (train/state.balance_update), None without biases."""
    return float(cfg.bias_update_speed) if has_bias(cfg) else None


def without_bias(tree):
    """`tree` with the balancing biases' entries zeroed (their gradient entries hold the load, not a gradient);
    the same tree when it has none."""
    return jax.tree_util.tree_map_with_path(lambda path, x: jnp.zeros_like(x) if is_bias(path) else x, tree)


def capacity(cfg: ModelConfig, seq_len: int) -> int:
    """Slots per expert per row: every token fits when dropless (a token picks an expert at most once)."""
    if not cfg.capacity_factor:
        return seq_len
    return min(seq_len, math.ceil(cfg.capacity_factor * seq_len * cfg.experts_per_token / cfg.n_experts))


class Groups(nnx.Module):
    """The stacked groups: `dense` blocks [G, moe_every-1, ...] (absent when moe_every is 1), the MoE block's
    attention and norms `moe` [G, ...], the `router` [G, D, E] and the family's `experts` [G, E, ...]; with sigmoid
    scores the balancing bias `expert_bias` [G, E] (float32 zeros, replicated: every token's routing reads all of
    it), and `shared(G)`'s shared experts where the family has them (dense MLP weights [G, ...]).
    `blocks(lead_shape, lead_axes, with_mlp)` makes a family's stacked block weights."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, blocks: Callable, experts: Callable,
                 shared: Callable | None = None):
        G, k = groups(cfg), cfg.moe_every
        if k > 1:
            self.dense = blocks((G, k - 1), ("layers", None), True)
        self.moe = blocks((G,), ("layers",), False)
        # Unit-variance initial logits (std 1/sqrt(D) on normed inputs): with 0.02 the logits of 8 experts differ
        # by ~0.2 and a token's k-th and (k+1)-th choices are often within float32 rounding of a tie.
        self.router = param(rngs, (G, cfg.d_model, cfg.n_experts), ("layers", "embed", None),
                            jnp.dtype(cfg.param_dtype), cfg.d_model ** -0.5)
        self.experts = experts(G)
        if has_bias(cfg):
            self.expert_bias = zeros((G, cfg.n_experts), ("layers", None), jnp.float32)
        if shared is not None:
            self.shared = shared(G)


def route(router_DxE: jax.Array, h_BxLxD: jax.Array, cfg: ModelConfig, bias_E: jax.Array | None = None):
    """float32 router: (logits [B,L,E], probabilities [B,L,E], top-k experts [B,k,L] and their combine weights
    [B,k,L]: the top-k probabilities, renormalized to sum to 1 as `cfg.router` says (renormalizing equals
    Mixtral's softmax over the chosen logits)), times DeepSeek's routed_scaling_factor where it is not 1. With
    sigmoid scores (`_sigmoid_choice`) the probabilities are the scores normalized over the experts."""
    logits = jnp.einsum("bld,de->ble", h_BxLxD.astype(jnp.float32), router_DxE.astype(jnp.float32))
    k = cfg.experts_per_token
    if has_bias(cfg):
        probs, top_e, top_p = _sigmoid_choice(logits, cfg, bias_E)
    else:
        probs = jax.nn.softmax(logits, axis=-1)
        top_e = top_k_indices(logits, k)  # ranked by logits: two probabilities can round to one float32 value
        top_p = jnp.take_along_axis(probs, top_e, axis=-1)
        if renormalizes(cfg):
            top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    scale = getattr(cfg, "routed_scaling_factor", 1.0)
    if scale != 1.0:
        top_p = top_p * scale
    return logits, probs, jnp.moveaxis(top_e, -1, 1), jnp.moveaxis(top_p, -1, 1)


def _sigmoid_choice(logits_BxLxE: jax.Array, cfg: ModelConfig, bias_E: jax.Array | None):
    """DeepSeek-V3's routing (transformers' DeepseekV3TopkRouter): sigmoid scores; the balancing bias added to
    them only to choose (so it gets no gradient); with n_group > 1 only the topk_group groups of experts whose two
    best biased scores sum highest compete; the chosen experts' weights are their unbiased scores, renormalized
    (+1e-20) when norm_topk_prob. Returns (scores normalized over the experts [B,L,E], top-k [B,L,k], weights)."""
    scores = jax.nn.sigmoid(logits_BxLxE)
    choice = scores if bias_E is None else scores + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
    groups_ = getattr(cfg, "n_group", 1)
    if groups_ > 1:
        B, L, E = choice.shape
        per_group = choice.reshape(B, L, groups_, E // groups_)
        best = jnp.max(per_group, axis=-1)
        runner_up = jnp.max(jnp.where(jax.nn.one_hot(jnp.argmax(per_group, axis=-1), E // groups_, dtype=jnp.bool_),
                                      -jnp.inf, per_group), axis=-1)
        kept = top_k_indices(best + runner_up, cfg.topk_group)  # [B, L, topk_group]
        open_ = jnp.sum(jax.nn.one_hot(kept, groups_, dtype=jnp.int32), axis=-2) > 0  # [B, L, G]
        choice = jnp.where(jnp.repeat(open_, E // groups_, axis=-1), choice, -jnp.inf)
    top_e = top_k_indices(choice, cfg.experts_per_token)
    top_p = jnp.take_along_axis(scores, top_e, axis=-1)
    if renormalizes(cfg):
        top_p = top_p / (jnp.sum(top_p, axis=-1, keepdims=True) + 1e-20)
    return scores / jnp.sum(scores, axis=-1, keepdims=True), top_e, top_p


def renormalizes(cfg: ModelConfig) -> bool:
    """Whether a token's top-k weights are scaled to sum to 1 (DeepSeek's `norm_topk_prob`, else `model.router`)."""
    norm = getattr(cfg, "norm_topk_prob", None)
    if norm is not None:
        return bool(norm)
    router = getattr(cfg, "router", "auto")
    return router == "topk_softmax" or (router == "auto" and cfg.experts_per_token > 1)


def top_k_indices(x_BxLxE: jax.Array, k: int) -> jax.Array:
    """[B, L, k]: lax.top_k's indices (ties to the lower index) as k argmaxes, which XLA's partitioner keeps
    local to each device's rows where it gathers a top_k's input over the batch."""
    picked = []
    for _ in range(k):
        index = jnp.argmax(x_BxLxE, axis=-1)
        picked.append(index)
        x_BxLxE = jnp.where(jax.nn.one_hot(index, x_BxLxE.shape[-1], dtype=jnp.bool_), -jnp.inf, x_BxLxE)
    return jnp.stack(picked, axis=-1)


def topk_margin(logits_BxLxE: jax.Array, top_e_BxKxL: jax.Array) -> jax.Array:
    """The smallest gap, over tokens, between a token's k-th and (k+1)-th router logit: how far the routing
    is from a tie that rounding could flip (infinite when every expert is chosen). Without a second top_k,
    which XLA's partitioner gathers across the batch."""
    chosen = jnp.sum(jax.nn.one_hot(top_e_BxKxL, logits_BxLxE.shape[-1], dtype=jnp.bool_), axis=1) > 0
    kth = jnp.take_along_axis(logits_BxLxE, jnp.moveaxis(top_e_BxKxL, 1, -1)[..., -1:], axis=-1)[..., 0]
    runner_up = jnp.max(jnp.where(chosen, -jnp.inf, logits_BxLxE), axis=-1)
    return jnp.min(kth - runner_up)


def slots(top_e_BxKxL: jax.Array, n_experts: int, cap: int):
    """Each (row, choice, token)'s slot in its expert's buffer, E*C when dropped: first choices before second
    ones, then token order (GShard's priority). Also the token filling each slot, L for an empty one."""
    B, K, L = top_e_BxKxL.shape
    onehot = jax.nn.one_hot(top_e_BxKxL.reshape(B, K * L), n_experts, dtype=jnp.int32)
    position = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)  # [B, K*L]
    kept = position < cap
    slot = jnp.where(kept, top_e_BxKxL.reshape(B, K * L) * cap + position, n_experts * cap)
    token = jnp.tile(jnp.arange(L), K)
    source = jax.vmap(lambda s: jnp.full((n_experts * cap,), L).at[s].set(token, mode="drop"))(slot)
    return slot.reshape(B, K, L), kept.reshape(B, K, L), source


def _take_rows(x_BxNxD: jax.Array, index_BxM: jax.Array) -> jax.Array:
    """x[b, index[b, m]], zeros where the index is N (what empty slots and dropped tokens read). A gather that
    fills out of range rather than a zero row appended: the append's transpose, a split along the rows, became a
    collective permute over `tensor` under sequence parallelism, which inside a pipeline's cells waits for stages
    running other cells."""
    return jnp.take_along_axis(x_BxNxD, index_BxM[..., None], axis=1, mode="fill", fill_value=0)


def moe_mlp(router_DxE: jax.Array, experts: Params, h_BxLxD: jax.Array, cfg: ModelConfig, constrain: Constrain,
            expert_fn: Callable, bias_E: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """The mixture on normed inputs: (output [B,L,D], this layer's router statistics over the whole batch).
    `expert_fn(experts, x_ExNxD) -> y_ExNxD` is the family's MLP applied per expert; `bias_E` the balancing bias."""
    y_BxLxD, stats = _mixture(router_DxE, experts, constrain.whole_rows(h_BxLxD), cfg, constrain, expert_fn, bias_E)
    return constrain(constrain.whole_rows(y_BxLxD), ("batch", "seq", "embed")), stats


def mixture_mlp(g: Params, h_BxLxD: jax.Array, cfg: ModelConfig, constrain: Constrain,
                block: Block, on_rows: bool = False) -> tuple[jax.Array, dict]:
    """One mixture layer's MLP half on normed inputs from its weights `g` (router, experts, and where the family
    has them the balancing bias and the shared experts, run by the block's dense MLP): moe_mlp, or `_mixture` for
    rows already whole (`on_rows`: _mlp_half_on_rows)."""
    run = _mixture if on_rows else moe_mlp
    y_BxLxD, stats = run(g["router"], g["experts"], h_BxLxD, cfg, constrain, block.expert_mlp, g.get(BIAS))
    if "shared" in g:
        y_BxLxD = y_BxLxD + block.mlp(g["shared"], h_BxLxD)
    return y_BxLxD, stats


def _mixture(router_DxE: jax.Array, experts: Params, h_BxLxD: jax.Array, cfg: ModelConfig, constrain: Constrain,
             expert_fn: Callable, bias_E: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """moe_mlp on whole rows, its output left where the computation puts it."""
    B, L, D = h_BxLxD.shape
    E, cap = cfg.n_experts, capacity(cfg, L)
    logits, probs, top_e, top_w = route(router_DxE, h_BxLxD, cfg, bias_E)
    slot, kept, source = slots(top_e, E, cap)
    buffer_BxExCxD = _take_rows(h_BxLxD, source).reshape(B, E, cap, D)
    out_BxExCxD = constrain.moe_experts(buffer_BxExCxD, experts, expert_fn)
    picked = _take_rows(out_BxExCxD.reshape(B, E * cap, D), slot.reshape(B, -1)).reshape(B, -1, L, D)
    weight_BxKxL = (top_w * kept).astype(h_BxLxD.dtype)
    y_BxLxD = jnp.einsum("bkld,bkl->bld", picked, weight_BxKxL)
    mean = constrain.batch_mean  # the statistics of the whole batch (or microbatch), however its rows are split
    load_E = mean(jnp.mean(jax.nn.one_hot(top_e, E, dtype=jnp.float32), axis=(0, 1, 2)))  # fraction routed to each
    stats = {"moe_z_loss": mean(jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)),
             "moe_load_balance_loss": E * jnp.sum(load_E * mean(jnp.mean(probs, axis=(0, 1)))),
             "moe_dropped_fraction": 1.0 - mean(jnp.mean(kept.astype(jnp.float32))), "moe_load": load_E,
             "topk_margin": topk_margin(jax.lax.stop_gradient(logits), top_e)}
    if hasattr(cfg, "seq_balance_weight"):  # DeepSeek's: the sequence-wise balance loss, and the bias's tap
        stats["moe_seq_balance_loss"] = mean(sequence_balance(top_e, probs))
        stats["balance_tap"] = jnp.zeros((), jnp.float32) if bias_E is None else balance_tap(bias_E, load_E)
    return y_BxLxD, stats


def sequence_balance(top_e_BxKxL: jax.Array, probs_BxLxE: jax.Array) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss (its eq. 17-20) before its weight: per row, sum over experts of
    f_i = E / (k L) x (tokens choosing expert i) times P_i, the mean over the row of the normalized scores; the
    mean over rows."""
    E = probs_BxLxE.shape[-1]
    f_BxE = E * jnp.mean(jax.nn.one_hot(top_e_BxKxL, E, dtype=jnp.float32), axis=(1, 2))
    return jnp.mean(jnp.sum(f_BxE * jnp.mean(probs_BxLxE, axis=1), axis=-1))


def balance_tap(bias_E: jax.Array, load_E: jax.Array) -> jax.Array:
    """0, whose derivative with respect to the balancing bias is the layer's expert load: added to the objective,
    it carries the load to the bias's gradient entry, where the optimizer reads it (module docstring); t - t of
    one value is exactly 0."""
    t = jnp.sum(bias_E.astype(jnp.float32) * jax.lax.stop_gradient(load_E))
    return t - jax.lax.stop_gradient(t)


def _mlp_half_on_rows(g: Params, x_BxLxD: jax.Array, cfg: ModelConfig, constrain: Constrain,
                      block: Block) -> tuple[jax.Array, dict]:
    """A context-parallel layout's MoE block after attention: its rows split over `context` in place of their
    sequence (one all-to-all each way) and the sequence back in its order there, so the norm, the mixture and the
    residual add see whole rows, route as one device does and drop the same tokens."""
    x_BxLxD = constrain.rows_in_order(x_BxLxD)
    y_BxLxD, stats = mixture_mlp(g, block.mlp_input(g["moe"], x_BxLxD), cfg, constrain, block, on_rows=True)
    out = x_BxLxD + block.mlp_output(g["moe"], y_BxLxD)
    return constrain(constrain.rows_to_context(out), ("batch", "seq", "embed")), stats


def mixture_half(g: Params, x_BxLxD: jax.Array, cfg: ModelConfig, constrain: Constrain,
                 block: Block) -> tuple[jax.Array, dict]:
    """x plus a mixture layer's MLP half (`g`: a group's weights, the block's norms under `moe`), on whole rows
    where a context-parallel layout splits them (_mlp_half_on_rows): (x, this layer's router statistics)."""
    if constrain.context_order(x_BxLxD.shape[1]) is not None:
        return _mlp_half_on_rows(g, x_BxLxD, cfg, constrain, block)
    y, stats = mixture_mlp(g, block.mlp_input(g["moe"], x_BxLxD), cfg, constrain, block)
    return constrain(x_BxLxD + block.mlp_output(g["moe"], y), ("batch", "seq", "embed")), stats


def run_groups(layers: Params, x_BxLxD: jax.Array, cfg: ModelConfig, constrain: Constrain, block: Block,
               dense_layer: Callable, attention: Callable,
               group_ids: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """The scanned groups of `block`s: `dense_layer(p, x, layer)` a whole dense layer and `attention(p, x, layer)`
    the attention half's addition of logical layer `layer`, which `attention.uniform` says they do not read (None
    then); `group_ids` the logical groups of a slice of the stack. Returns (x, aux): `aux_loss` (the weighted router
    losses, mean over MoE layers, for the objective), the statistics of METRICS and `moe_load` [E], each the mean
    over the MoE layers, and `topk_margin`, the smallest over them (not logged; the equivalence tests read it)."""
    k, prefix = cfg.moe_every, dense_prefix(cfg)

    def group(g, x, gid):
        first = None if gid is None else (gid * k + prefix if prefix else gid * k)
        if "dense" in g and gid is None:
            x, _ = jax.lax.scan(lambda x, p: (dense_layer(p, x, None), None), x, g["dense"])
        elif "dense" in g:
            x, _ = jax.lax.scan(lambda x, pj: (dense_layer(pj[0], x, first + pj[1]), None), x,
                                (g["dense"], jnp.arange(k - 1)))
        x = x + attention(g["moe"], x, None if gid is None else first + k - 1)
        return mixture_half(g, x, cfg, constrain, block)

    body = remat(group, cfg.remat)
    if attention.uniform:
        x_BxLxD, stats = jax.lax.scan(lambda x, g: body(g, x, None), x_BxLxD, layers)
    else:
        ids = jnp.arange(groups(cfg), dtype=jnp.int32) if group_ids is None else group_ids
        x_BxLxD, stats = jax.lax.scan(lambda x, gi: body(gi[0], x, gi[1]), x_BxLxD, (layers, ids))
    margin = jnp.min(stats.pop("topk_margin"))
    taps = stats.pop("balance_tap", None)
    stats = {**jax.tree.map(lambda s: jnp.mean(s, axis=0), stats), "topk_margin": margin}
    stats["aux_loss"] = aux_loss(stats, cfg, taps)
    return x_BxLxD, stats


def aux_loss(stats: dict, cfg: ModelConfig, taps: jax.Array | None = None) -> jax.Array:
    """The router losses the objective adds, from statistics averaged over the layers: z-loss and Switch's balance
    loss, DeepSeek's sequence-wise balance loss, and the layers' balance taps (0 in value), averaged too, so a
    bias's entry is its layer's load over the layers run together, the same in every layout (a pipeline's chunks
    each add their layers' mean over the chunk count)."""
    out = cfg.router_z_loss_weight * stats["moe_z_loss"] + cfg.load_balance_weight * stats["moe_load_balance_loss"]
    if taps is not None:
        out = out + cfg.seq_balance_weight * stats["moe_seq_balance_loss"] + jnp.mean(taps)
    return out


def log_fields(aux: dict) -> dict:
    """The statistics to log: METRICS, and the per-expert load `moe_load_e` [E], which models.loss_and_metrics
    logs as moe_load_e0, moe_load_e1, ..."""
    seq = {k: aux[k] for k in ("moe_seq_balance_loss",) if k in aux}  # DeepSeek's
    return {**{k: aux[k] for k in METRICS}, **seq, "moe_load_e": aux["moe_load"]}


def mlp_matmul_params(cfg: ModelConfig, per_mlp: int, active: bool = False) -> int:
    """MLP matmul parameters of the whole stack, `per_mlp` being one dense MLP's: the experts (all of them, or
    the k a token runs through when `active`) plus the router in each MoE block."""
    if not is_moe(cfg):
        return cfg.n_layers * per_mlp
    experts = cfg.experts_per_token if active else cfg.n_experts
    moe_layers = groups(cfg)
    return (cfg.n_layers - moe_layers) * per_mlp + moe_layers * (experts * per_mlp + cfg.d_model * cfg.n_experts)


def expert_buffers(cfg: ModelConfig) -> ExpertBuffers | None:
    """The contract's view of the mixture (models.contract.ExpertBuffers), None for dense layers."""
    return ExpertBuffers(groups(cfg), cfg.n_experts, capacity(cfg, cfg.seq_len)) if is_moe(cfg) else None


def divisibility(cfg: ModelConfig) -> dict:
    return {"experts": (("model.n_experts", cfg.n_experts),)} if is_moe(cfg) else {}
