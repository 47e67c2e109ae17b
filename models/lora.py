"""Low-rank adapters (Hu et al. 2021, LoRA): a frozen model's projection W becomes W + (alpha/rank)·A·B, B zero at
first so the adapted model starts as its base; adapters sit in the layer stack's dict under `lora`, stacked on
`layers`, each dimension named with its base weight's logical axis and the rank dimension with none. A mixture of
experts holds them in each of its stacks (`moe`, and `dense` when moe_every > 1), beside the attention weights."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.protocols import ModelConfig

KEY = "lora"  # the layer dict's entry holding the adapters
TARGETS = ("q", "k", "v", "o", "mlp")


@dataclasses.dataclass(frozen=True)
class Projection:
    """One adapted matrix of a layer: the weight it adds to (`weight`, `index`: the slice of one layer's weight,
    () for all of it), the sizes and logical axes of its input dimensions (contracted) and output dimensions."""
    weight: str
    index: tuple
    in_shape: tuple[int, ...]
    in_axes: tuple
    out_shape: tuple[int, ...]
    out_axes: tuple


def targets(cfg: ModelConfig) -> tuple[str, ...]:
    """The adapted projections, from the comma list `model.lora_targets`."""
    return tuple(t.strip() for t in str(getattr(cfg, "lora_targets", "") or "").split(",") if t.strip())


def adapter_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The adapters of the targets: one per target, two for `mlp` (its input and output matrices)."""
    return tuple(n for t in targets(cfg) for n in (("mlp_in", "mlp_out") if t == "mlp" else (t,)))


def enabled(cfg: ModelConfig) -> bool:
    return getattr(cfg, "lora_rank", 0) > 0


def scale(cfg: ModelConfig) -> float:
    return cfg.lora_alpha / cfg.lora_rank


class Adapter(nnx.Module):
    """A [*lead, *in, rank] (std 1/sqrt(fan-in)) and B [*lead, rank, *out] (zeros) for one projection."""

    def __init__(self, proj: Projection, rank: int, lead: tuple, lead_axes: tuple, dtype, rngs: nnx.Rngs):
        a_shape = (*lead, *proj.in_shape, rank)
        std = 1.0 / math.sqrt(math.prod(proj.in_shape))
        self.a = nnx.Param(std * jax.random.normal(rngs.params(), a_shape, dtype),
                           logical_axes=P(*lead_axes, *proj.in_axes, None))
        self.b = nnx.Param(jnp.zeros((*lead, rank, *proj.out_shape), dtype),
                           logical_axes=P(*lead_axes, None, *proj.out_axes))


class Adapters(nnx.Module):
    """One Adapter per projection of `cfg.lora_targets` (adapter_names), stacked over the `layers` axis, or over
    the `lead` dimensions (sizes, logical axes) of the stack they sit in."""

    def __init__(self, cfg: ModelConfig, projections: dict[str, Projection], rngs: nnx.Rngs,
                 lead: tuple | None = None):
        shape, axes = lead or ((cfg.n_layers,), ("layers",))
        for name in adapter_names(cfg):
            setattr(self, name, Adapter(projections[name], cfg.lora_rank, shape, axes, jnp.dtype(cfg.param_dtype),
                                        rngs))


def add(y: jax.Array, p: dict, name: str, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """`y` (the base projection of `x`, [B, L, *out]) plus the adapter `name`'s scale·(x·A)·B, when adapted.

    The families call this at each projection themselves. google/qwix (LoRA for Flax) does not fit this model
    code: it intercepts the einsums an NNX module's `__call__` runs and attaches `<name>_lora_a/_b` to that module,
    sharded like the concrete array it finds there; here the NNX modules only create parameters, the forward pass
    is pure functions of a plain dict run under `lax.scan` and inside the pipeline's `shard_map` (no module call to
    intercept), q, k and v are slices of one fused einsum, and shardings come from logical axes at abstract init."""
    adapter = p.get(KEY, {}).get(name)
    if adapter is None:
        return y
    a, b = adapter["a"].astype(x.dtype), adapter["b"].astype(x.dtype)
    u_BxLxR = jnp.tensordot(x, a, axes=a.ndim - 1)
    return y + (scale(cfg) * jnp.tensordot(u_BxLxR, b, axes=1)).astype(y.dtype)


def is_adapter(path: tuple) -> bool:
    """Whether a pytree path (jax key entries or plain names) lies under an adapter."""
    return any(getattr(k, "key", k) == KEY for k in path)


def freeze(params: Any, cfg: ModelConfig) -> Any:
    """With adapters, every other parameter is a constant of the forward pass: no executor (the plain step, a
    pipeline cell's vjp) computes its weight gradient, which comes out as zeros."""
    if not enabled(cfg):
        return params
    return jax.tree_util.tree_map_with_path(lambda path, x: x if is_adapter(path) else jax.lax.stop_gradient(x),
                                            params)


def merge(params: dict, cfg: ModelConfig, projections: dict[str, Projection]) -> dict:
    """numpy params (layers stacked, logical order) -> the same without adapters, each adapted weight replaced by
    W + scale·A·B (computed in float32): what an export writes. Every stack holding a `lora` entry (the layers,
    or a mixture's `moe` and `dense`) is merged with its own adapters."""
    return {**params, "layers": _merged_stack(params["layers"], cfg, projections)}


def _merged_stack(stack: dict, cfg: ModelConfig, projections: dict[str, Projection]) -> dict:
    out = {k: _merged_stack(v, cfg, projections) if isinstance(v, dict) else v
           for k, v in stack.items() if k != KEY}
    for name, adapter in stack.get(KEY, {}).items():
        proj = projections[name]
        a, b = np.asarray(adapter["a"], np.float32), np.asarray(adapter["b"], np.float32)
        lead, rank = a.shape[:a.ndim - len(proj.in_shape) - 1], a.shape[-1]
        n = math.prod(lead)
        delta = np.matmul(a.reshape(n, -1, rank), b.reshape(n, rank, -1)).reshape(*lead, *proj.in_shape,
                                                                                 *proj.out_shape)
        w = np.array(out[proj.weight], np.float32)
        w[(*(slice(None),) * len(lead), *proj.index)] += scale(cfg) * delta
        out[proj.weight] = w.astype(np.asarray(stack[proj.weight]).dtype)
    return out


def adapter_count(cfg: ModelConfig, projections: dict[str, Projection]) -> int:
    """Adapter parameters of the whole stack."""
    return cfg.n_layers * cfg.lora_rank * sum(math.prod(projections[t].in_shape) + math.prod(projections[t].out_shape)
                                              for t in adapter_names(cfg))


def matmul_flops(cfg: ModelConfig, matmul_params: int, projections: dict[str, Projection]) -> float:
    """Training FLOPs per token of the matmul weights: 6N (forward 2N, backward 4N); with adapters the frozen
    weights skip their weight gradient (4N) and each adapter parameter costs 6."""
    if not enabled(cfg):
        return 6.0 * matmul_params
    return 4.0 * matmul_params + 6.0 * adapter_count(cfg, projections)
