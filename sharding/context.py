"""Context parallelism: each device holds a slice of every row's sequence (the `context` mesh axis) and
attention runs as a ring, the key/value blocks passing device to device with `ppermute` while each device
folds them into its queries' output by online softmax (Liu et al. 2023, Ring Attention).

The sequence is laid out zigzag: with c devices the
sequence is cut into 2c chunks and device i holds chunks i and 2c-1-i, so under the causal mask every device
has the same work: after its own block, each of the c-1 blocks it receives is exactly half visible, and only
that half is computed. A sliding layer (a window of w positions) needs only the blocks whose keys some query's
window reaches (`ring_steps`): each comes straight from its device by one permute, and the others are neither sent
nor computed.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from models.attention import attention_block, merge_blocks

AXIS = "context"


def zigzag_order(length: int, ways: int) -> np.ndarray:
    """int32 [length]: the global position at each position of the zigzag layout (device i's contiguous
    slice holds chunks i and 2*ways-1-i of the 2*ways equal chunks)."""
    assert length % (2 * ways) == 0, (length, ways)
    chunks = np.arange(length, dtype=np.int32).reshape(2 * ways, length // (2 * ways))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * ways - 1 - i]]) for i in range(ways)])


def from_zigzag(x_BxLx: jax.Array, ways: int) -> jax.Array:
    """The sequence (dimension 1) of a zigzag layout back in order, by slices: device i's chunks i and 2c-1-i
    are the i-th of the first half and the i-th from the end of the second."""
    B, L = x_BxLx.shape[:2]
    pairs = x_BxLx.reshape(B, ways, 2, L // (2 * ways), *x_BxLx.shape[2:])
    first, second = pairs[:, :, 0], jnp.flip(pairs[:, :, 1], axis=1)
    return jnp.concatenate([first, second], axis=1).reshape(x_BxLx.shape)


def to_zigzag(x_BxLx: jax.Array, ways: int) -> jax.Array:
    """The inverse of `from_zigzag`: a sequence in order laid out zigzag."""
    B, L = x_BxLx.shape[:2]
    chunks = x_BxLx.reshape(B, 2 * ways, L // (2 * ways), *x_BxLx.shape[2:])
    pairs = jnp.stack([chunks[:, :ways], jnp.flip(chunks[:, ways:], axis=1)], axis=2)
    return pairs.reshape(x_BxLx.shape)


def ring_steps(ways: int, length: int, window: int = 0) -> tuple[int, ...]:
    """The ring's steps s (device me receives the block of device me - s) whose keys some query sees: every step
    1..ways-1 for a causal layer (window 0); for a sliding layer of `window` positions over a `length`-token zigzag
    sequence, those where some device's chunk a and its source's chunk b < a have a key-query pair closer than the
    window: (a - b - 1) * chunk + 1 < window."""
    if not window:
        return tuple(range(1, ways))
    chunk = length // (2 * ways)
    held = [(d, 2 * ways - 1 - d) for d in range(ways)]
    return tuple(s for s in range(1, ways)
                 if any(a > b and (a - b - 1) * chunk + 1 < window
                        for me in range(ways) for a in held[me] for b in held[(me - s) % ways]))


def ring(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array, ways: int,
         seg_BxW: jax.Array | None = None, gather: Callable[[jax.Array], jax.Array] | None = None,
         window: int = 0) -> jax.Array:
    """One device's causal attention over the whole sequence, inside a shard_map manual over `context` (L is the
    device's 2 chunks; `ring_attention` builds that region, a pipeline's region is already one). With packed
    documents, `seg_BxW` holds the segment ids of the whole rows (zigzag order, W = ways x L, tiny next to K and
    V): each device reads the ids of the block it holds from them rather than receiving them with the block,
    and a query sees only keys of its own document. `gather` (`all_gather_blocks`, or a caller's wrapping of it):
    the blocks come from one all-gather of K and V rather than hop by hop (`_next_block`); the same blocks in the
    same order, so the same result. A `window` > 0 (a sliding layer): `windowed_ring`."""
    if window:
        return windowed_ring(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, ways, window, seg_BxW, gather)
    me = jax.lax.axis_index(AXIS)
    C = q_BxLxHxK.shape[1] // 2
    positions = jnp.asarray(zigzag_order(2 * C * ways, ways)).reshape(ways, 2 * C)[me]  # my chunks' global positions
    allowed = positions[:, None] >= positions[None, :]
    docs = seg_BxW is not None
    segment_ids = (lambda device: jax.lax.dynamic_slice_in_dim(seg_BxW, device * 2 * C, 2 * C, axis=1)) if docs \
        else None
    if docs:
        mine = segment_ids(me)
        allowed = allowed & _same_document(mine, mine)
    out, lse = attention_block(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, allowed)
    q_top, q_bottom = q_BxLxHxK[:, :C], q_BxLxHxK[:, C:]
    next_block = _next_block(k_BxLxGxK, v_BxLxGxK, ways, gather)

    def hop(carry, step):
        k, v, out, lse = carry
        k, v = next_block(k, v, step)
        # The block came from device j = me - step. If j < me, every query of mine sees j's first chunk and none
        # of its second; otherwise only my second chunk's queries see anything, and they see both of j's.
        earlier = (me - step) % ways < me
        theirs = segment_ids((me - step) % ways) if docs else None
        mask1 = _same_document(mine[:, C:], theirs[:, :C]) if docs else None
        out1, lse1 = attention_block(q_bottom, k[:, :C], v[:, :C], mask1, docs)  # my 2nd chunk vs j's 1st
        q2 = jnp.where(earlier, q_top, q_bottom)
        k2, v2 = (jnp.where(earlier, t[:, :C], t[:, C:]) for t in (k, v))
        mask2 = _same_document(jnp.where(earlier, mine[:, :C], mine[:, C:]),
                               jnp.where(earlier, theirs[:, :C], theirs[:, C:])) if docs else None
        out2, lse2 = attention_block(q2, k2, v2, mask2, docs)
        skipped = jnp.full_like(lse2, -jnp.inf)
        top = merge_blocks(out[:, :C], lse[:, :C], out2, jnp.where(earlier, lse2, skipped))
        bottom = merge_blocks(out[:, C:], lse[:, C:], out1, lse1)
        bottom = merge_blocks(*bottom, out2, jnp.where(earlier, skipped, lse2))
        out, lse = (jnp.concatenate(pair, axis=1) for pair in zip(top, bottom))
        return (k, v, out, lse), None

    if ways > 1:  # c-1 hops: the last block received is used, never sent on
        (_, _, out, lse), _ = jax.lax.scan(hop, (k_BxLxGxK, v_BxLxGxK, out, lse), jnp.arange(1, ways))
    return out.astype(q_BxLxHxK.dtype)


def windowed_ring(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array, ways: int, window: int,
                  seg_BxW: jax.Array | None = None,
                  gather: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """`ring` for a sliding layer: its own block, then the blocks of the steps in `ring_steps` alone, each whole
    block masked by position (and document) and folded in by online softmax; a block a device's queries do not see
    at all comes in and counts for nothing (log-sum-exp -inf). Each block comes by one permute of its shift (or from
    the all-gathered blocks, `gather`)."""
    me = jax.lax.axis_index(AXIS)
    L = q_BxLxHxK.shape[1]
    order = jnp.asarray(zigzag_order(L * ways, ways)).reshape(ways, L)  # each device's global positions
    docs = seg_BxW is not None

    def allowed(source):
        """Which keys of `source`'s block each of my queries sees: [Q, S], or with documents [B, 1, 1, Q, S]."""
        distance = order[me][:, None] - order[source][None, :]
        seen = (distance >= 0) & (distance < window)
        if not docs:
            return seen
        segments = [jax.lax.dynamic_slice_in_dim(seg_BxW, d * L, L, axis=1) for d in (me, source)]
        return seen & _same_document(*segments)

    out, lse = attention_block(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, allowed(me))  # every query sees itself
    if gather is not None:
        k_BxWxGxK, v_BxWxGxK = gather(k_BxLxGxK), gather(v_BxLxGxK)
    for step in ring_steps(ways, L * ways, window):
        source = (me - step) % ways
        if gather is None:
            shift = [(d, (d + step) % ways) for d in range(ways)]
            k, v = jax.lax.ppermute(k_BxLxGxK, AXIS, shift), jax.lax.ppermute(v_BxLxGxK, AXIS, shift)
        else:
            k, v = (jax.lax.dynamic_slice_in_dim(a, source * L, L, axis=1) for a in (k_BxWxGxK, v_BxWxGxK))
        out, lse = merge_blocks(out, lse, *attention_block(q_BxLxHxK, k, v, allowed(source), empty_rows=True))
    return out.astype(q_BxLxHxK.dtype)


def all_gather_blocks(x_BxLx: jax.Array) -> jax.Array:
    """Every context device's block of `x` along the sequence, in device order: [B, ways x L, ...]."""
    return jax.lax.all_gather(x_BxLx, AXIS, axis=1, tiled=True)


def _next_block(k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array, ways: int, gather: Callable | None) -> Callable:
    """(k, v, step) -> the K and V blocks of device me - step: passed on one hop from the previous device (the
    ring), or read from the blocks of every device all-gathered once. The gathered form serves regions whose
    devices do not all run the attention at once (a pipeline's cells, one stage at a time): a collective permute
    waits for every device its pairs name, over every stage, where an all-gather waits only for its group. It
    moves the same bytes (c-1 blocks in, and their gradients reduce-scattered back) and holds all c blocks."""
    if gather is None:
        to_next = [(d, (d + 1) % ways) for d in range(ways)]
        return lambda k, v, step: (jax.lax.ppermute(k, AXIS, to_next), jax.lax.ppermute(v, AXIS, to_next))
    me, L = jax.lax.axis_index(AXIS), k_BxLxGxK.shape[1]
    k_BxWxGxK, v_BxWxGxK = gather(k_BxLxGxK), gather(v_BxLxGxK)
    return lambda k, v, step: tuple(jax.lax.dynamic_slice_in_dim(a, ((me - step) % ways) * L, L, axis=1)
                                    for a in (k_BxWxGxK, v_BxWxGxK))


def _same_document(q_seg_BxQ: jax.Array, k_seg_BxS: jax.Array) -> jax.Array:
    """bool [B, 1, 1, Q, S]: which keys share each query's document (attention_block's per-row mask)."""
    return (q_seg_BxQ[:, :, None] == k_seg_BxS[:, None, :])[:, None, None]


def ring_attention(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array, mesh: jax.sharding.Mesh,
                   q_spec: P, kv_spec: P, seg_BxW: jax.Array | None = None, seg_spec: P | None = None,
                   window: int = 0) -> jax.Array:
    """Causal attention of zigzag-ordered q, k, v whose sequence dimension is split over `context` alone
    (`q_spec`/`kv_spec`: their layouts; every mesh axis is manual inside, so batch and heads stay local); packed
    documents' segment ids `seg_BxW`, whole rows in the zigzag order laid out as `seg_spec` (the sequence not
    split), keep each query within its document; a `window` > 0, within its sliding window."""
    assert tuple(np.atleast_1d(q_spec[1])) == (AXIS,) and tuple(np.atleast_1d(kv_spec[1])) == (AXIS,), \
        (q_spec, kv_spec)
    ways = mesh.shape[AXIS]
    if seg_BxW is None:
        return jax.shard_map(lambda q, k, v: ring(q, k, v, ways, window=window), mesh=mesh,
                             in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                             check_vma=True)(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
    return jax.shard_map(lambda q, k, v, s: ring(q, k, v, ways, s, window=window), mesh=mesh,
                         in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                         check_vma=True)(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, seg_BxW)
