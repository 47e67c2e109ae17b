"""Context parallelism: each device holds a slice of every row's sequence (the `context` mesh axis) and
attention runs as a ring, the key/value blocks passing device to device with `ppermute` while each device
folds them into its queries' output by online softmax (Liu et al. 2023, Ring Attention).

The sequence is laid out zigzag: with c devices the
sequence is cut into 2c chunks and device i holds chunks i and 2c-1-i, so under the causal mask every device
has the same work: after its own block, each of the c-1 blocks it receives is exactly half visible, and only
that half is computed.
"""
from __future__ import annotations

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


def _ring(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array, ways: int) -> jax.Array:
    """One device's causal attention over the whole sequence (in shard_map: L is its 2 chunks)."""
    me = jax.lax.axis_index(AXIS)
    C = q_BxLxHxK.shape[1] // 2
    positions = jnp.asarray(zigzag_order(2 * C * ways, ways)).reshape(ways, 2 * C)[me]  # my chunks' global positions
    out, lse = attention_block(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, positions[:, None] >= positions[None, :])
    q_top, q_bottom = q_BxLxHxK[:, :C], q_BxLxHxK[:, C:]
    to_next = [(d, (d + 1) % ways) for d in range(ways)]

    def hop(carry, step):
        k, v, out, lse = carry
        k, v = jax.lax.ppermute(k, AXIS, to_next), jax.lax.ppermute(v, AXIS, to_next)
        # The block came from device j = me - step. If j < me, every query of mine sees j's first chunk and none
        # of its second; otherwise only my second chunk's queries see anything, and they see both of j's.
        earlier = (me - step) % ways < me
        out1, lse1 = attention_block(q_bottom, k[:, :C], v[:, :C])  # my 2nd chunk vs j's 1st: always visible
        q2 = jnp.where(earlier, q_top, q_bottom)
        k2, v2 = (jnp.where(earlier, t[:, :C], t[:, C:]) for t in (k, v))
        out2, lse2 = attention_block(q2, k2, v2)
        skipped = jnp.full_like(lse2, -jnp.inf)
        top = merge_blocks(out[:, :C], lse[:, :C], out2, jnp.where(earlier, lse2, skipped))
        bottom = merge_blocks(out[:, C:], lse[:, C:], out1, lse1)
        bottom = merge_blocks(*bottom, out2, jnp.where(earlier, skipped, lse2))
        out, lse = (jnp.concatenate(pair, axis=1) for pair in zip(top, bottom))
        return (k, v, out, lse), None

    if ways > 1:  # c-1 hops: the last block received is used, never sent on
        (_, _, out, lse), _ = jax.lax.scan(hop, (k_BxLxGxK, v_BxLxGxK, out, lse), jnp.arange(1, ways))
    return out.astype(q_BxLxHxK.dtype)


def ring_attention(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array, mesh: jax.sharding.Mesh,
                   q_spec: P, kv_spec: P) -> jax.Array:
    """Causal attention of zigzag-ordered q, k, v whose sequence dimension is split over `context` alone
    (`q_spec`/`kv_spec`: their layouts; every mesh axis is manual inside, so batch and heads stay local)."""
    assert tuple(np.atleast_1d(q_spec[1])) == (AXIS,) and tuple(np.atleast_1d(kv_spec[1])) == (AXIS,), \
        (q_spec, kv_spec)
    ways = mesh.shape[AXIS]
    return jax.shard_map(lambda q, k, v: _ring(q, k, v, ways), mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec),
                         out_specs=q_spec, check_vma=True)(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
