"""Logical-axis rules: plain tables mapping each logical axis name to zero or more mesh axes.

A strategy is a named table. Parameters and activations share names (`embed` is both a weight
dimension and the residual stream's width); within one array a mesh axis is used at most once, by
the first dimension that claims it, so `batch -> (data, fsdp)` and `embed -> fsdp` give FSDP weights
sharded on `embed` while activations stay sharded on `batch` only.
"""
from __future__ import annotations

from typing import Mapping

from mesh.errors import UserError

Rules = dict[str, tuple[str, ...]]

# Megatron-LM tensor parallelism (Shoeybi et al. 2019): QKV and MLP-in are column-parallel (their
# output dims `heads`/`mlp` are split), attention-out and MLP-out row-parallel (input dims split),
# so each block needs one all-reduce after attention and one after the MLP; heads split over `tensor`.
_TENSOR: Rules = {"heads": ("tensor",), "mlp": ("tensor",), "vocab": ("tensor",)}
# Shared by every strategy: the `expert` axis splits the batch like `data` outside the mixture-of-experts
# layers and holds a slice of the experts inside them (models/moe.py); the `context` axis splits every row's
# sequence (ring attention passes the keys and values around it). `seq_context` is a sequence dimension that
# only `context` splits, never sequence parallelism's `tensor` (the vocab-parallel embedding lookup's output).
_LONG_AND_SPARSE: Rules = {"seq": ("context",), "seq_context": ("context",), "experts": ("expert",)}

STRATEGIES: dict[str, Rules] = {
    # Parameters replicated, batch split over `data` (and `expert`).
    "data_parallel": {"batch": ("data", "expert"), **_LONG_AND_SPARSE},
    # ZeRO-3 / FSDP (Rajbhandari et al. 2020): parameters, gradients and optimizer state sharded
    # over `fsdp` along `embed`; the batch is split over data x fsdp x expert.
    "fsdp": {"batch": ("data", "fsdp", "expert"), "embed": ("fsdp",), **_LONG_AND_SPARSE},
    "tensor_parallel": {"batch": ("data", "expert"), **_TENSOR, **_LONG_AND_SPARSE},
    # Everything at once on one mesh: data x fsdp x expert x context x tensor. The default.
    "fsdp_tensor": {"batch": ("data", "fsdp", "expert"), "embed": ("fsdp",), **_TENSOR, **_LONG_AND_SPARSE},
}
DEFAULT_STRATEGY = "fsdp_tensor"


class ShardingConfigError(UserError):
    """A sharding setting the user can fix; the message is one line naming the setting."""


def register_strategy(name: str, rules: Mapping[str, tuple[str, ...] | str | None]) -> None:
    """Add or replace a named strategy, e.g. from an experiment file."""
    STRATEGIES[name] = normalize(rules)


def normalize(rules: Mapping[str, tuple[str, ...] | str | None]) -> Rules:
    """Accept `'data'`, `None` or a tuple for each logical axis; return tuples."""
    out: Rules = {}
    for name, axes in rules.items():
        if axes is None:
            axes = ()
        elif isinstance(axes, str):
            axes = (axes,)
        out[str(name)] = tuple(str(a) for a in axes)
    return out


def check_strategy(strategy: str) -> None:
    """A one-line error for a strategy no table is registered under."""
    if strategy not in STRATEGIES:
        raise ShardingConfigError(
            f"sharding.strategy={strategy!r}: unknown strategy; use one of {', '.join(sorted(STRATEGIES))} "
            f"or register one with sharding.register_strategy")


def resolve(strategy: str, overrides: Mapping | None = None, mesh_sizes: Mapping[str, int] | None = None) -> Rules:
    """The rules of `strategy` with `overrides` applied on top, checked against the mesh.

    Every mesh axis of size > 1 other than `pipeline` (which the pipeline executor owns) must be
    used by some rule, or devices would silently hold copies of the same work. With `mesh.pipeline` > 1
    the rule `layers -> pipeline` is added: each stage holds its slice of the stacked layers.
    """
    check_strategy(strategy)
    rules = dict(STRATEGIES[strategy])
    rules.update(normalize(overrides or {}))
    if mesh_sizes is not None and mesh_sizes.get("pipeline", 1) > 1:
        # Pipeline stages are contiguous slices of the stacked layers; only the executor may use the axis.
        others = sorted(name for name, axes in rules.items() if "pipeline" in axes and name != "layers")
        if others:
            raise ShardingConfigError(
                f"sharding.rules maps {others[0]!r} onto 'pipeline', which the pipeline executor owns; "
                f"remove 'pipeline' from that rule")
        rules["layers"] = ("pipeline",)
    if mesh_sizes is not None:
        used = {axis for axes in rules.values() for axis in axes}
        unknown = sorted(used - set(mesh_sizes))
        if unknown:
            raise ShardingConfigError(
                f"sharding.rules maps to mesh axis {unknown[0]!r}, which the mesh does not have; "
                f"use {', '.join(mesh_sizes)}")
        idle = [a for a, size in mesh_sizes.items() if size > 1 and a != "pipeline" and a not in used]
        if idle:
            raise ShardingConfigError(
                f"mesh.{idle[0]}={mesh_sizes[idle[0]]} but sharding.strategy={strategy!r} maps nothing onto "
                f"{idle[0]!r}; set mesh.{idle[0]}=1 or choose a strategy that uses it")
    return rules
