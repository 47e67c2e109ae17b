"""Building blocks the families share: parameters carrying logical axes, RMSNorm and LayerNorm, rotary embeddings and
their frequencies per layer (models/layer_spec.Rope), rematerialization policies, a weight as its matmul takes it;
pure functions of arrays."""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.contract import Hooks, Params, Rotate
from models.layer_spec import Rope


def param(rngs: nnx.Rngs, shape, axes: tuple, dtype, std: float | None) -> nnx.Param:
    """A parameter carrying its logical axis names as metadata (`logical_axes`, one per dimension)."""
    assert len(shape) == len(axes), (shape, axes)
    value = jnp.ones(shape, dtype) if std is None else std * jax.random.normal(rngs.params(), shape, dtype)
    return nnx.Param(value, logical_axes=P(*axes))


def zeros(shape, axes: tuple, dtype) -> nnx.Param:
    """A parameter of zeros (a bias) carrying its logical axis names."""
    assert len(shape) == len(axes), (shape, axes)
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=P(*axes))


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


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm (Ba et al. 2016) over the last axis, in float32: (x - mean) / sqrt(var + eps) * scale + bias."""
    x32 = x.astype(jnp.float32)
    centered = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    y = centered * jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def rotary(x_BxLxHxK: jax.Array, freqs_K2: jax.Array | None = None, positions_L: jax.Array | None = None):
    """Rotary position embedding (Su et al. 2021), half-split layout; positions 0..L-1 unless given ([L], or
    [B, L] per row), frequencies 10000^(-2i/K) unless given."""
    L, K = x_BxLxHxK.shape[1], x_BxLxHxK.shape[3]
    if freqs_K2 is None:
        freqs_K2 = rope_frequencies(Rope(), K)
    if positions_L is None:
        positions_L = jnp.arange(L, dtype=jnp.float32)
    angles_BxLxK2 = positions_L.astype(jnp.float32)[..., None] * freqs_K2
    if angles_BxLxK2.ndim == 2:
        angles_BxLxK2 = angles_BxLxK2[None]
    sin, cos = jnp.sin(angles_BxLxK2)[:, :, None, :], jnp.cos(angles_BxLxK2)[:, :, None, :]
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BxLxHxK.dtype)


def rope_frequencies(rope: Rope, dim: int) -> jax.Array:
    """float32 [dim/2]: theta^(-2i/dim), scaled as `rope.scaling` says: `linear` divides them all by the factor;
    `llama3` divides wavelengths above original_context/low_freq_factor by it, keeps those below
    original_context/high_freq_factor and interpolates the band between (the formula of transformers'
    `_compute_llama3_parameters`)."""
    freqs = 1.0 / (rope.theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if rope.scaling == "linear":
        return freqs / rope.factor
    if rope.scaling == "yarn":
        return _yarn(freqs, rope, dim)
    if rope.scaling != "llama3":
        return freqs
    factor, low, high, context = rope.factor, rope.low_freq_factor, rope.high_freq_factor, rope.original_context
    wavelen = 2 * math.pi / freqs
    scaled = jnp.where(wavelen > context / low, freqs / factor, freqs)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return jnp.where(medium, smoothed, scaled)


def _yarn(freqs: jax.Array, rope: Rope, dim: int) -> jax.Array:
    """YaRN's frequencies (Peng et al. 2023, section 3.2; transformers' `_compute_yarn_parameters`): the dimension
    pairs whose wavelength turns fewer than beta_slow times over the original context are interpolated (divided by
    the factor), those turning more than beta_fast times kept, a linear ramp between (bounds floored and ceiled)."""
    def pair(turns: float) -> float:  # the dimension whose wavelength makes `turns` turns over the original context
        return dim * math.log(rope.original_context / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))
    low = max(math.floor(pair(rope.beta_fast)), 0)
    high = min(math.ceil(pair(rope.beta_slow)), dim - 1)
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / max(high - low, 1e-3), 0.0, 1.0)
    return freqs / rope.factor * ramp + freqs * (1.0 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term 0.1 * mscale * ln(factor) + 1 (1 without extension)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(rope: Rope | None) -> float:
    """What YaRN multiplies the rotated dimensions by: mscale(factor, mscale) / mscale(factor, mscale_all_dim) when
    both are set (DeepSeek's configs: 1), else mscale(factor); 1 for every other scaling."""
    if rope is None or rope.scaling != "yarn":
        return 1.0
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def rotation(rope: Rope | None, rope_dim: int, positions: jax.Array | None) -> Rotate:
    """A layer's `rotate(q, k)` (models/contract.Block): its rotary embedding at `positions` over the first
    `rope_dim` dimensions' worth of frequencies (0: the head's), or nothing without one."""
    if rope is None:
        return lambda q, k: (q, k)

    scale = rope_attention_factor(rope)

    def rotate(q_BxLxHxK, k_BxLxGxK):
        freqs = rope_frequencies(rope, rope_dim or q_BxLxHxK.shape[-1])
        q, k = rotary(q_BxLxHxK, freqs, positions), rotary(k_BxLxGxK, freqs, positions)
        if scale != 1.0:
            q, k = q * jnp.asarray(scale, q.dtype), k * jnp.asarray(scale, k.dtype)
        return q, k
    return rotate


def rotation_by_kind(ropes: list[Rope | None], rope_dim: int, positions: jax.Array | None,
                     kind: jax.Array) -> Rotate:
    """`rotation` of the traced `kind`'s rope among `ropes` (every one a rotary embedding, or none at all): the
    frequencies of each kind stacked and the layer's read by index, so layers of several kinds run one program."""
    if all(r is None for r in ropes):
        return lambda q, k: (q, k)
    assert all(r is not None for r in ropes), ropes

    def rotate(q_BxLxHxK, k_BxLxGxK):
        dim = rope_dim or q_BxLxHxK.shape[-1]
        freqs = jnp.stack([rope_frequencies(r, dim) for r in ropes])[kind]
        return rotary(q_BxLxHxK, freqs, positions), rotary(k_BxLxGxK, freqs, positions)
    return rotate


def weight(p: Params, name: str, axes: dict, compute_dtype: str, hooks: Hooks) -> jax.Array:
    """One layer's matrix `name` (logical axes `axes[name]`) in the compute dtype, as the layout's hooks hand it to
    its matmul."""
    return hooks.weight(p[name], axes[name]).astype(jnp.dtype(compute_dtype))


def remat(fn, policy: str):
    if policy == "none":
        return fn
    saveable = {"full": None, "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[policy]
    return jax.checkpoint(fn, policy=saveable, prevent_cse=False)
