"""Paged KV-cache decoding over a flat batch of tokens from many sequences: each token's keys and values go to
its sequence's page slot in its layer's pool, and it attends over that sequence's pages alone, a block of pages at a
time, as far as the step's longest sequence reaches (a sliding layer: over its window's blocks alone). Layers whose
caches are alike share one page table per sequence (a `CacheGroup`: every causal layer, or every sliding layer of
one window), so a sliding layer's pages that fall out of its window can be given back (train/serve/pages.py) while
a causal layer's are kept. The family lends its layer once (models/contract.Block, the training stack's); the
per-layer weights, the pool writes, the attention over pages and the layer loop are here.

The loop over layers is unrolled over weights split per layer (`unstack`) and one pool per layer: a scan over the
stacked weights and pools made XLA copy each layer's weights out of the stack and the whole pool once per step
(on a 100M Llama on CPU: 209 ms a step of 16 sequences, against 43 ms unrolled)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from mesh.numbers import ceil_div
from models import moe, stack
from models.contract import LAYERS, Attend, Block, Hooks, Params, Rotate, family_of, layer_specs, top_params
from models.layers import rotation
from models.protocols import ModelConfig

ATTEND_TOKENS = 64  # keys each step of the attention loop reads per token (a whole number of pages, at least one)


@dataclasses.dataclass(frozen=True)
class Batch:
    """The tokens of one step: tokens, positions and sequence slots [N] (slot -1: padding, written to the
    scratch page 0 and never read), page tables [C, S, P], one per cache group (page ids by position // page
    size, 0 where unallocated or given back; P a multiple of `block_pages`), the token index [R] whose logits are
    wanted, and `blocks` (int32 []): the blocks of `block_pages` pages the attention visits, enough for the step's
    longest sequence (`blocks_for`)."""
    tokens_N: jax.Array
    positions_N: jax.Array
    slots_N: jax.Array
    tables_CxSxP: jax.Array
    select_R: jax.Array
    blocks: jax.Array


@dataclasses.dataclass(frozen=True)
class CacheGroup:
    """Layers whose caches share one page table per sequence: `window` 0, layers that keep every position (causal);
    else sliding layers of that window, which need a sequence's latest `window` positions alone."""
    window: int
    layers: tuple[int, ...]

    @property
    def kind(self) -> str:
        """`causal`, or `sliding_<window>`: how /metrics names the group."""
        return f"sliding_{self.window}" if self.window else "causal"


def cache_groups(cfg: ModelConfig) -> tuple[CacheGroup, ...]:
    """The model's cache groups from its LayerSpecs, in order of first appearance."""
    specs = layer_specs(cfg)
    windows = dict.fromkeys(s.window for s in specs)
    return tuple(CacheGroup(w, tuple(i for i, s in enumerate(specs) if s.window == w)) for w in windows)


def pool_shape(cfg: ModelConfig, kv_heads: int, pages: int, page_size: int) -> tuple[int, int, int, int]:
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


def window_blocks(window: int, page_size: int) -> int:
    """Attention blocks that cover any `window` consecutive positions, wherever they start."""
    width = block_pages(page_size) * page_size
    return -(-(window - 1) // width) + 1


def cache_bytes(cfg: ModelConfig, context: int, kv_heads: int, windows: bool = True) -> int:
    """Keys and values one sequence of `context` positions holds over every layer: a causal layer every position,
    a sliding one its window's alone (or, `windows` False, every position: what it would hold without them)."""
    per_position = 2 * kv_heads * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize
    return sum(per_position * (min(context, s.window) if s.window and windows else context) for s in layer_specs(cfg))


def position_limit(cfg: ModelConfig) -> int | None:
    """The most positions the model can encode: its learned position table's rows; None for rotary positions."""
    return cfg.position_rows if getattr(cfg, "positions", "rotary") == "learned" else None


def max_context(cfg: ModelConfig) -> int:
    """The longest sequence an engine takes by default: the training length, within the position table."""
    return min(cfg.seq_len, position_limit(cfg) or cfg.seq_len)


# ----------------------------------------------------------------------------- weights split per layer

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
    """The `attend(q, k, v)` a family's Block calls here for one layer (models/contract.Attend): writes the batch's
    new keys and values (k and v [1, N, G, K]) into the layer's pools at its group's pages, then attends over them;
    q [1, N, H, K]. The new pools are left in `k_pool` and `v_pool`."""

    def __init__(self, batch: Batch, k_pool: jax.Array, v_pool: jax.Array, group: int, window: int):
        self.batch, self.k_pool, self.v_pool, self.group, self.window = batch, k_pool, v_pool, group, window

    def __call__(self, q_1xNxHxK, k_1xNxGxK, v_1xNxGxK):
        b = self.batch
        tables_SxP = b.tables_CxSxP[self.group]
        page = self.k_pool.shape[2]
        real = b.slots_N >= 0
        slot = jnp.where(real, b.slots_N, 0)
        page_N = jnp.where(real, tables_SxP[slot, b.positions_N // page], 0)
        flat_N = page_N * page + jnp.where(real, b.positions_N % page, 0)
        self.k_pool = _write(self.k_pool, flat_N, k_1xNxGxK[0])
        self.v_pool = _write(self.v_pool, flat_N, v_1xNxGxK[0])
        # Read inside a conditional that always runs (blocks >= 1): read directly, XLA's CPU backend fused the
        # pool's write into its reads and so copied every layer's whole pool twice per step (2.3 ms of a 2.8 ms
        # step of a tiny Llama over 257 pages).
        attend = lambda *a: attend_pages(*a, window=self.window)  # noqa: E731
        out = jax.lax.cond(b.blocks > 0, attend, lambda q, *_: q.astype(jnp.float32), q_1xNxHxK[0], self.k_pool,
                           self.v_pool, tables_SxP[slot], b.positions_N, b.blocks)
        return out[None].astype(q_1xNxHxK.dtype)


def _write(pool_GxPxSxK: jax.Array, flat_N: jax.Array, new_NxGxK: jax.Array) -> jax.Array:
    G, P, S, K = pool_GxPxSxK.shape
    flat = pool_GxPxSxK.reshape(G, P * S, K)
    return flat.at[:, flat_N].set(jnp.swapaxes(new_NxGxK, 0, 1).astype(flat.dtype)).reshape(pool_GxPxSxK.shape)


def attend_pages(q_NxHxK: jax.Array, k_pool: jax.Array, v_pool: jax.Array, pages_NxP: jax.Array,
                 positions_N: jax.Array, blocks: jax.Array, window: int = 0) -> jax.Array:
    """Each token's causal attention over its own sequence's pages (`pages_NxP`, its row of the page tables), in
    float32: an online softmax over `blocks` blocks of block_pages pages, each gathered from the pool as it is
    read (FlashAttention's running max and sum, over pages rather than tiles). With a `window`, each token's blocks
    start at the one holding the first position it sees and are no more than `window_blocks`: a sliding layer
    reads its window alone, whatever the sequence's length, and never the pages given back before it. Out
    [N, H, K]."""
    N, H, K = q_NxHxK.shape
    G, page = k_pool.shape[0], k_pool.shape[2]
    R, bp = H // G, block_pages(page)
    width = bp * page
    q = jnp.swapaxes((q_NxHxK.reshape(N, G, R, K) * K ** -0.5).astype(jnp.float32), 0, 1)  # [G, N, R, K]
    first_N = jnp.maximum(positions_N - window + 1, 0) // width if window else None  # each token's first block

    def block(i, carry):
        top, total, acc = carry
        if window:
            start_N = first_N + i
            columns = start_N[:, None] * bp + jnp.arange(bp)[None, :]
            pages = jnp.take_along_axis(pages_NxP, columns, axis=1, mode="clip")
            key_NxC = start_N[:, None] * width + jnp.arange(width)[None, :]
            seen = (key_NxC <= positions_N[:, None]) & (key_NxC > positions_N[:, None] - window)
        else:
            pages = jax.lax.dynamic_slice_in_dim(pages_NxP, i * bp, bp, axis=1)
            seen = (i * width + jnp.arange(width))[None, :] <= positions_N[:, None]
        keys = k_pool[:, pages].reshape(G, N, width, K).astype(jnp.float32)
        values = v_pool[:, pages].reshape(G, N, width, K).astype(jnp.float32)
        scores = jnp.einsum("gnrk,gnck->gnrc", q, keys)
        scores = jnp.where(seen[None, :, None, :], scores, -jnp.inf)
        new_top = jnp.maximum(top, scores.max(axis=-1))  # finite: a token's first block holds its first key
        probs = jnp.exp(scores - new_top[..., None])
        rescale = jnp.exp(top - new_top)
        return (new_top, total * rescale + probs.sum(axis=-1),
                acc * rescale[..., None] + jnp.einsum("gnrc,gnck->gnrk", probs, values))

    count = jnp.minimum(blocks, window_blocks(window, page)) if window else blocks
    init = (jnp.full((G, N, R), -jnp.inf), jnp.zeros((G, N, R)), jnp.zeros((G, N, R, K)))
    _, total, acc = jax.lax.fori_loop(0, count, block, init)
    return jnp.swapaxes(acc / total[..., None], 0, 1).reshape(N, H, K)


# ----------------------------------------------------------------------------- the stack

def decode(weights: Params, batch: Batch, pools: dict[str, list[jax.Array]], cfg: ModelConfig,
           hooks: Hooks) -> tuple[jax.Array, dict[str, list[jax.Array]]]:
    """The family's layers over the batch's tokens (`weights` as `unstack` gives them), each with its LayerSpec,
    writing each layer's pools {"k": [layers], "v": [layers]}; returns (float32 logits [R, V] of the selected tokens,
    the new pools)."""
    family = family_of(cfg)
    block, specs = family.block(cfg, hooks), layer_specs(cfg)
    group_of = {layer: g for g, group in enumerate(cache_groups(cfg)) for layer in group.layers}
    top, positions = weights["top"], batch.positions_N
    x = family.forward.embed(top, batch.tokens_N[None], cfg, hooks, positions)
    ks, vs = [], []
    for layer, p in enumerate(weights["blocks"]):
        spec = specs[layer]
        attend = PagedAttend(batch, pools["k"][layer], pools["v"][layer], group_of[layer], spec.window)
        rotate = rotation(spec.rope, spec.rope_dim, positions)
        if spec.mlp == "experts":
            x = expert_layer(block, p, x, rotate, attend, cfg, hooks)
        else:
            x = stack.mlp_half(block, p, x + block.attention(p, x, rotate, attend), hooks)
        ks.append(attend.k_pool)
        vs.append(attend.v_pool)
    chosen = jnp.take(x, batch.select_R, axis=1)
    return family.forward.logits(top, chosen, cfg, hooks)[0], {"k": ks, "v": vs}


def expert_layer(block: Block, p: Params, x, rotate: Rotate, attend: Attend, cfg: ModelConfig, hooks: Hooks):
    """A mixture's MoE block (models/moe.py) whose experts take every token (capacity_factor 0: none dropped, so a
    token's output never depends on the others in the batch)."""
    layer = p["moe"]
    x = x + block.attention(layer, x, rotate, attend)
    # One row per token: dropless routing is per token, and rows (unlike the one row of the flat batch) split
    # over the batch axes as a mesh splitting the experts needs (sharding/experts.py).
    h = block.mlp_input(layer, x)
    whole = dataclasses.replace(cfg, capacity_factor=0.0)
    y, _ = moe.moe_mlp(p["router"], p["experts"], h.reshape(-1, 1, h.shape[-1]), whole, hooks, block.expert_mlp)
    return x + block.mlp_output(layer, y.reshape(x.shape))
