"""A bare decode step over a contiguous KV cache: the baseline `bench_serve --engine_only` sets the serving engine's
step beside. It runs the family's one Block (models/contract.py), as the engine does, with an attention of its own
that writes each layer's [B, S, G, K] keys and values at the step's position and attends over the cache up to it
(within a sliding layer's window): no pages, no scheduler, no sampling but greedy."""
from __future__ import annotations

import jax
import jax.numpy as jnp

import models
from models import paged, stack
from models.layers import rotation


class CacheAttend:
    """The Block's `attend(q, k, v)` over one layer's contiguous cache, the new keys and values written at
    `length` first; the new cache is left in `k` and `v`."""

    def __init__(self, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array, length: jax.Array, window: int):
        self.k, self.v, self.length, self.window = k_BxSxGxK, v_BxSxGxK, length, window

    def __call__(self, q_BxTxHxK, k_BxTxGxK, v_BxTxGxK):
        self.k = jax.lax.dynamic_update_slice_in_dim(self.k, k_BxTxGxK.astype(self.k.dtype), self.length, 1)
        self.v = jax.lax.dynamic_update_slice_in_dim(self.v, v_BxTxGxK.astype(self.v.dtype), self.length, 1)
        query_T = self.length + jnp.arange(q_BxTxHxK.shape[1])
        key_S = jnp.arange(self.k.shape[1])
        allowed = key_S[None, :] <= query_T[:, None]
        if self.window:
            allowed &= key_S[None, :] > query_T[:, None] - self.window
        return jax.nn.dot_product_attention(q_BxTxHxK, self.k.astype(q_BxTxHxK.dtype),
                                            self.v.astype(q_BxTxHxK.dtype), mask=allowed[None, None])


def empty_cache(cfg: models.ModelConfig, batch: int, length: int) -> dict[str, list[jax.Array]]:
    """Keys and values of every layer, [B, length, kv_heads, head_dim] each, in the compute dtype."""
    shape = (batch, length, models.family_of(cfg).parallel.kv_heads(cfg), cfg.head_dim)
    return {n: [jnp.zeros(shape, cfg.compute_dtype) for _ in range(cfg.n_layers)] for n in ("k", "v")}


def step(weights: models.contract.Params, tokens_BxT: jax.Array, cache: dict, length: jax.Array,
         cfg: models.ModelConfig, hooks: models.contract.Hooks):
    """T new tokens at positions length.. (`weights` as models.paged.unstack gives them): (float32 logits of the
    last one [B, V], the new cache)."""
    family = models.family_of(cfg)
    block, specs = family.block(cfg, hooks), models.layer_specs(cfg)
    positions = length + jnp.arange(tokens_BxT.shape[1])
    x = family.forward.embed(weights["top"], tokens_BxT, cfg, hooks, positions)
    ks, vs = [], []
    for layer, p in enumerate(weights["blocks"]):
        spec = specs[layer]
        attend = CacheAttend(cache["k"][layer], cache["v"][layer], length, spec.window)
        rotate = rotation(spec.rope, spec.rope_dim, positions)
        if spec.mlp == "experts":
            x = paged.expert_layer(block, p, x, rotate, attend, cfg, hooks)
        else:
            x = stack.mlp_half(block, p, x + block.attention(p, x, rotate, attend), hooks)
        ks.append(attend.k)
        vs.append(attend.v)
    return family.forward.logits(weights["top"], x[:, -1:], cfg, hooks)[:, 0], {"k": ks, "v": vs}
