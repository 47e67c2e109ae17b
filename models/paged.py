"""Paged KV-cache decoding over a flat batch of tokens from many sequences: each token's keys and values go to
its sequence's page slot in its layer's pool, and it attends causally over that sequence's pages alone, a block
of pages at a time, as far as the step's longest sequence reaches. The families lend their own projections
(block, attention, expert MLP); the per-layer weights, the pool writes, the attention and the layer loop are here.

The loop over layers is unrolled over weights split per layer (`unstack`) and one pool per layer: a scan over the
stacked weights and pools made XLA copy each layer's weights out of the stack and the whole pool once per step
(on a 100M Llama on CPU: 209 ms a step of 16 sequences, against 43 ms unrolled)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from mesh.numbers import ceil_div
from models import moe
from models.contract import LAYERS, Hooks, Params, top_params
from models.protocols import ModelConfig

ATTEND_TOKENS = 64  # keys each step of the attention loop reads per token (a whole number of pages, at least one)


@dataclasses.dataclass(frozen=True)
class Batch:
    """The tokens of one step: tokens, positions and sequence slots [N] (slot -1: padding, written to the
    scratch page 0 and never read), page tables [S, P] (page ids, 0 where unallocated; P a multiple of
    `block_pages`), the token index [R] whose logits are wanted, and `blocks` (int32 []): the blocks of
    `block_pages` pages the attention visits, enough for the step's longest sequence (`blocks_for`)."""
    tokens_N: jax.Array
    positions_N: jax.Array
    slots_N: jax.Array
    tables_SxP: jax.Array
    select_R: jax.Array
    blocks: jax.Array


def pool_shape(cfg: ModelConfig, kv_heads: int, pages: int, page_size: int) -> tuple[int, ...]:
    """[kv heads, pages, page_size, head dim]: the K (or V) pool of one layer, each head's pages apart, so the keys
    a block of pages gathers are already laid out as the attention's batched matmuls read them."""
    return kv_heads, pages, page_size, cfg.head_dim


POOL_AXES = ("heads", None, None, "kv")  # logical names: a tensor mesh splits each pool by KV heads


def block_pages(page_size: int) -> int:
    """Pages one step of the attention loop reads per token: ATTEND_TOKENS of keys, at least one page."""
    return max(1, ATTEND_TOKENS // page_size)


def table_width(pages_per_seq: int, page_size: int) -> int:
    """Columns of the page tables: a sequence's most pages, rounded up to whole attention blocks."""
    b = block_pages(page_size)
    return ceil_div(pages_per_seq, b) * b


def blocks_for(longest: int, page_size: int) -> int:
    """Attention blocks that cover `longest` positions (the step's longest sequence, its new tokens included)."""
    return max(1, ceil_div(longest, block_pages(page_size) * page_size))


def position_limit(cfg: ModelConfig) -> int | None:
    """The most positions the model can encode: its learned position table's rows; None for rotary positions."""
    return cfg.position_rows if getattr(cfg, "positions", "rotary") == "learned" else None


def max_context(cfg: ModelConfig) -> int:
    """The longest sequence an engine takes by default: the training length, within the position table."""
    return min(cfg.seq_len, position_limit(cfg) or cfg.seq_len)


# ----------------------------------------------------------------------------- weights split per layer

def _is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """A mixture's groups end with their MoE block (models/moe.py): every `moe_every`-th layer."""
    return moe.is_moe(cfg) and (layer + 1) % cfg.moe_every == 0


def _per_layer(layers: Params, cfg: ModelConfig, take: Callable) -> list[Params]:
    """The stack as one entry per layer in execution order; `take(leaf, index)` picks a leaf's layer at the
    leading `index` (a tuple: (layer,), or (group, block) for a mixture's dense blocks)."""
    pick = lambda tree, index: jax.tree.map(lambda a: take(a, index), tree)  # noqa: E731
    if not moe.is_moe(cfg):
        return [pick(layers, (l,)) for l in range(cfg.n_layers)]
    out = []
    for g in range(moe.groups(cfg)):
        out += [pick(layers["dense"], (g, j)) for j in range(cfg.moe_every - 1)]
        out.append(pick({k: layers[k] for k in ("moe", "router", "experts")}, (g,)))
    return out


def unstack(params: Params, cfg: ModelConfig) -> Params:
    """The params as paged decoding takes them: {"top": the params outside the stack, "blocks": [one dict per
    layer]}. Run it jitted once (it copies every weight) with `unstacked_shardings` as out_shardings."""
    return {"top": top_params(params), "blocks": _per_layer(params[LAYERS], cfg, lambda a, i: a[i])}


def unstacked_shardings(shardings: Params, cfg: ModelConfig) -> Params:
    """`unstack`'s shardings from the stacked params' NamedShardings: each layer's as its stack's, less the
    leading layer dimensions."""
    def take(s, index):
        return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*tuple(s.spec)[len(index):]))
    return {"top": top_params(shardings), "blocks": _per_layer(shardings[LAYERS], cfg, take)}


# ----------------------------------------------------------------------------- attention over pages

class PagedAttend:
    """What a family's attention calls in place of a contiguous cache: `self(q, k, v) -> (out, (k pool, v pool))`
    for q [1, N, H, K], k and v [1, N, G, K] of the batch's tokens."""

    def __init__(self, batch: Batch, k_pool: jax.Array, v_pool: jax.Array):
        self.batch, self.k_pool, self.v_pool = batch, k_pool, v_pool

    def __call__(self, q_1xNxHxK, k_1xNxGxK, v_1xNxGxK):
        b = self.batch
        page = self.k_pool.shape[2]
        real = b.slots_N >= 0
        slot = jnp.where(real, b.slots_N, 0)
        page_N = jnp.where(real, b.tables_SxP[slot, b.positions_N // page], 0)
        flat_N = page_N * page + jnp.where(real, b.positions_N % page, 0)
        k_pool = _write(self.k_pool, flat_N, k_1xNxGxK[0])
        v_pool = _write(self.v_pool, flat_N, v_1xNxGxK[0])
        # Read inside a conditional that always runs (blocks >= 1): read directly, XLA's CPU backend fused the
        # pool's write into its reads and so copied every layer's whole pool twice per step (2.3 ms of a 2.8 ms
        # step of a tiny Llama over 257 pages).
        out = jax.lax.cond(b.blocks > 0, attend_pages, lambda q, *_: q.astype(jnp.float32), q_1xNxHxK[0], k_pool,
                           v_pool, b.tables_SxP[slot], b.positions_N, b.blocks)
        return out[None].astype(q_1xNxHxK.dtype), (k_pool, v_pool)


def _write(pool_GxPxSxK: jax.Array, flat_N: jax.Array, new_NxGxK: jax.Array) -> jax.Array:
    G, P, S, K = pool_GxPxSxK.shape
    flat = pool_GxPxSxK.reshape(G, P * S, K)
    return flat.at[:, flat_N].set(jnp.swapaxes(new_NxGxK, 0, 1).astype(flat.dtype)).reshape(pool_GxPxSxK.shape)


def attend_pages(q_NxHxK: jax.Array, k_pool: jax.Array, v_pool: jax.Array, pages_NxP: jax.Array,
                 positions_N: jax.Array, blocks: jax.Array) -> jax.Array:
    """Each token's causal attention over its own sequence's pages (`pages_NxP`, its row of the page tables), in
    float32: an online softmax over `blocks` blocks of block_pages pages, each gathered from the pool as it is
    read (FlashAttention's running max and sum, over pages rather than tiles). Out [N, H, K]."""
    N, H, K = q_NxHxK.shape
    G, page = k_pool.shape[0], k_pool.shape[2]
    R, bp = H // G, block_pages(page)
    width = bp * page
    q = jnp.swapaxes((q_NxHxK.reshape(N, G, R, K) * K ** -0.5).astype(jnp.float32), 0, 1)  # [G, N, R, K]

    def block(i, carry):
        top, total, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(pages_NxP, i * bp, bp, axis=1)
        keys = k_pool[:, pages].reshape(G, N, width, K).astype(jnp.float32)
        values = v_pool[:, pages].reshape(G, N, width, K).astype(jnp.float32)
        scores = jnp.einsum("gnrk,gnck->gnrc", q, keys)
        seen = (i * width + jnp.arange(width))[None, :] <= positions_N[:, None]
        scores = jnp.where(seen[None, :, None, :], scores, -jnp.inf)
        new_top = jnp.maximum(top, scores.max(axis=-1))  # finite: block 0 holds position 0 of every token
        probs = jnp.exp(scores - new_top[..., None])
        rescale = jnp.exp(top - new_top)
        return (new_top, total * rescale + probs.sum(axis=-1),
                acc * rescale[..., None] + jnp.einsum("gnrc,gnck->gnrk", probs, values))

    init = (jnp.full((G, N, R), -jnp.inf), jnp.zeros((G, N, R)), jnp.zeros((G, N, R, K)))
    _, total, acc = jax.lax.fori_loop(0, blocks, block, init)
    return jnp.swapaxes(acc / total[..., None], 0, 1).reshape(N, H, K)


# ----------------------------------------------------------------------------- the stack

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


def decode(weights: Params, batch: Batch, pools: dict[str, list[jax.Array]], cfg: ModelConfig, constrain: Hooks,
           pieces: Pieces) -> tuple[jax.Array, dict[str, list[jax.Array]]]:
    """The layers over the batch's tokens (`weights` as `unstack` gives them), writing each layer's pools
    {"k": [layers], "v": [layers]}; returns (float32 logits [R, V] of the selected tokens, the new pools)."""
    top, positions = weights["top"], batch.positions_N
    x = pieces.embed(top, batch.tokens_N[None], positions)
    ks, vs = [], []
    for layer, p in enumerate(weights["blocks"]):
        attend = PagedAttend(batch, pools["k"][layer], pools["v"][layer])
        if _is_moe_layer(cfg, layer):
            x, (k, v) = _moe_block(p, x, positions, attend, cfg, constrain, pieces)
        else:
            x, (k, v) = pieces.block(p, x, positions, attend)
        ks.append(k)
        vs.append(v)
    chosen = jnp.take(x, batch.select_R, axis=1)
    return pieces.logits(top, chosen)[0], {"k": ks, "v": vs}


def _moe_block(p: Params, x, positions, attend: PagedAttend, cfg: ModelConfig, constrain: Hooks, pieces: Pieces):
    """A mixture's MoE block (models/moe.py) whose experts take every token (capacity_factor 0: none dropped, so a
    token's output never depends on the others in the batch)."""
    block = p["moe"]
    a, kv = pieces.attention(block, pieces.norm(block, x, "attn_norm"), positions, attend)
    x = x + a
    # One row per token: dropless routing is per token, and rows (unlike the one row of the flat batch) split
    # over the batch axes as a mesh splitting the experts needs (sharding/experts.py).
    h = pieces.norm(block, x, "mlp_norm")
    whole = dataclasses.replace(cfg, capacity_factor=0.0)
    y, _ = moe.moe_mlp(p["router"], p["experts"], h.reshape(-1, 1, h.shape[-1]), whole, constrain, pieces.expert_fn)
    return x + y.reshape(x.shape), kv
