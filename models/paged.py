"""Paged KV-cache decoding over a flat batch of tokens from many sequences: each token's keys and values go to
its sequence's page slot in a shared pool, and it attends causally over that sequence's pages alone. The families
lend their own projections (block, attention, expert MLP); the pool write, the gather and the stack run here."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from models import moe
from models.attention import attention_block
from models.contract import LAYERS, Hooks, Params, top_params
from models.protocols import ModelConfig


@dataclasses.dataclass(frozen=True)
class Batch:
    """The tokens of one step: tokens, positions and sequence slots [N] (slot -1: padding, written to the
    scratch page 0 and never read), page tables [S, P] (page ids, 0 where unallocated) and the token index
    [R] whose logits are wanted."""
    tokens_N: jax.Array
    positions_N: jax.Array
    slots_N: jax.Array
    tables_SxP: jax.Array
    select_R: jax.Array


def pool_shape(cfg: ModelConfig, kv_heads: int, pages: int, page_size: int) -> tuple[int, ...]:
    """[layers, pages, page_size, kv heads, head dim]: the K (or V) pool of every layer."""
    return cfg.n_layers, pages, page_size, kv_heads, cfg.head_dim


def position_limit(cfg: ModelConfig) -> int | None:
    """The most positions the model can encode: its learned position table's rows; None for rotary positions."""
    return cfg.position_rows if getattr(cfg, "positions", "rotary") == "learned" else None


def max_context(cfg: ModelConfig) -> int:
    """The longest sequence an engine takes by default: the training length, within the position table."""
    return min(cfg.seq_len, position_limit(cfg) or cfg.seq_len)


POOL_AXES = ("layers", None, None, "heads", "kv")  # logical names: a tensor mesh splits the pool by KV heads


class PagedAttend:
    """What a family's attention calls in place of a contiguous cache: `self(q, k, v) -> (out, (k pool, v pool))`
    for q [1, N, H, K], k and v [1, N, G, K] of the batch's tokens."""

    def __init__(self, batch: Batch, k_pool: jax.Array, v_pool: jax.Array):
        self.batch, self.k_pool, self.v_pool = batch, k_pool, v_pool

    def __call__(self, q_1xNxHxK, k_1xNxGxK, v_1xNxGxK):
        b = self.batch
        P, page = self.k_pool.shape[:2]
        real = b.slots_N >= 0
        slot = jnp.where(real, b.slots_N, 0)
        page_N = jnp.where(real, b.tables_SxP[slot, b.positions_N // page], 0)
        flat_N = page_N * page + jnp.where(real, b.positions_N % page, 0)
        k_pool = _write(self.k_pool, flat_N, k_1xNxGxK[0])
        v_pool = _write(self.v_pool, flat_N, v_1xNxGxK[0])
        pages_NxP = b.tables_SxP[slot]
        C = pages_NxP.shape[1] * page
        keys = k_pool[pages_NxP].reshape(len(slot), C, *k_pool.shape[2:])  # [N, C, G, K]: each token's sequence
        values = v_pool[pages_NxP].reshape(len(slot), C, *v_pool.shape[2:])
        allowed = (jnp.arange(C)[None, :] <= b.positions_N[:, None])[:, None, None, None, :]
        out, _ = attention_block(jnp.swapaxes(q_1xNxHxK, 0, 1), keys, values, allowed)
        return jnp.swapaxes(out, 0, 1).astype(q_1xNxHxK.dtype), (k_pool, v_pool)


def _write(pool_PxSxGxK: jax.Array, flat_N: jax.Array, new_NxGxK: jax.Array) -> jax.Array:
    P, S = pool_PxSxGxK.shape[:2]
    flat = pool_PxSxGxK.reshape(P * S, *pool_PxSxGxK.shape[2:])
    return flat.at[flat_N].set(new_NxGxK.astype(flat.dtype)).reshape(pool_PxSxGxK.shape)


@dataclasses.dataclass(frozen=True)
class Pieces:
    """A family's parts for paged decoding: embed(top, tokens_1xN, positions_N) -> x; block(p, x, positions,
    attend) -> (x, pools); attention(p, h, positions, attend) -> (out, pools) for an MoE block's first half;
    expert_fn(w, x_ExNxD) -> y; norm(p, x, name) the family's norm of a block's `name` weights; logits(top, x)
    -> [1, R, V]."""
    embed: Callable
    block: Callable
    attention: Callable
    expert_fn: Callable
    norm: Callable
    logits: Callable


def decode(params: Params, batch: Batch, pool: dict[str, jax.Array], cfg: ModelConfig, constrain: Hooks,
           pieces: Pieces) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The stack over the batch's tokens, writing the pools; returns (float32 logits [R, V] of the selected
    tokens, the new pool {"k", "v"})."""
    top = top_params(params)
    positions = batch.positions_N
    x = pieces.embed(top, batch.tokens_N[None], positions)

    def dense(x, layer):
        p, k, v = layer
        return pieces.block(p, x, positions, PagedAttend(batch, k, v))

    if moe.is_moe(cfg):
        x, (k, v) = _moe_stack(params[LAYERS], x, pool, batch, cfg, constrain, pieces, dense)
    else:
        x, (k, v) = jax.lax.scan(dense, x, (params[LAYERS], pool["k"], pool["v"]))
    chosen = jnp.take(x, batch.select_R, axis=1)
    return pieces.logits(top, chosen)[0], {"k": k, "v": v}


def _moe_stack(layers: Params, x, pool, batch: Batch, cfg: ModelConfig, constrain: Hooks, pieces: Pieces, dense):
    """A mixture's groups (models/moe.py): the dense blocks, then the MoE block whose experts take every token
    (capacity_factor 0: none dropped, so a token's output never depends on the others in the batch)."""
    every, groups = cfg.moe_every, moe.groups(cfg)
    whole = dataclasses.replace(cfg, capacity_factor=0.0)
    grouped = {n: t.reshape(groups, every, *t.shape[1:]) for n, t in pool.items()}

    def group(x, layer):
        g, k, v = layer
        ks, vs = [], []
        if "dense" in g:
            x, (kd, vd) = jax.lax.scan(dense, x, (g["dense"], k[:-1], v[:-1]))
            ks, vs = [kd], [vd]
        p = g["moe"]
        a, (km, vm) = pieces.attention(p, pieces.norm(p, x, "attn_norm"), batch.positions_N,
                                       PagedAttend(batch, k[-1], v[-1]))
        x = x + a
        # One row per token: dropless routing is per token, and rows (unlike the one row of the flat batch) split
        # over the batch axes as a mesh splitting the experts needs (sharding/experts.py).
        h = pieces.norm(p, x, "mlp_norm")
        y, _ = moe.moe_mlp(g["router"], g["experts"], h.reshape(-1, 1, h.shape[-1]), whole, constrain,
                           pieces.expert_fn)
        return x + y.reshape(x.shape), (jnp.concatenate(ks + [km[None]]), jnp.concatenate(vs + [vm[None]]))

    x, (k, v) = jax.lax.scan(group, x, (layers, grouped["k"], grouped["v"]))
    return x, (k.reshape(pool["k"].shape), v.reshape(pool["v"].shape))
