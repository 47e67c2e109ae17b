"""Which meshes a model can run on, and why the others are skipped: every reason is a short phrase the planner
counts ("heads not divisible by tensor=8"), read from the model contract and the layout's own weights, and
mirrors a check train/config/experiment.py makes before a run."""
from __future__ import annotations

import functools
import math
from typing import Mapping

import jax

import models
from sharding import rules as sharding_rules
from sharding import specs as sharding_specs
from train.plan.memory import STRATEGY, abstract_params

# The mesh axis that splits each logical axis the family names in its divisibility (sharding/rules.py, fsdp_tensor).
SPLIT_BY = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor", "embed": "fsdp", "experts": "expert"}
# Context parallelism splits every row's sequence, which pays where attention (quadratic in the length) is a
# large part of the step: searched when attention's FLOPs are at least this share of the model's.
CONTEXT_ATTENTION_SHARE = 0.25


def has_experts(cfg: models.ModelConfig) -> bool:
    return models.family_of(cfg).parallel.expert_buffers(cfg) is not None


def long_sequence(cfg: models.ModelConfig) -> bool:
    family = models.family_of(cfg)
    return family.cost.attention_flops_per_token(cfg) >= CONTEXT_ATTENTION_SHARE * family.cost.flops_per_token(cfg)


def replicas(sizes: Mapping[str, int]) -> int:
    """The mesh ways the batch splits over (rules: batch -> data, fsdp, expert)."""
    return sizes["data"] * sizes["fsdp"] * sizes["expert"]


def skip_reason(cfg: models.ModelConfig, sizes: Mapping[str, int], global_batch: int) -> str | None:
    """Why the model cannot run on `sizes` (a short phrase), or None when it can."""
    for reason in (_batch(sizes, global_batch), _widths(cfg, sizes), _sequence(cfg, sizes),
                   _experts(cfg, sizes, global_batch), _weights(cfg, tuple(sizes.items()))):
        if reason:
            return reason
    return None


def _batch(sizes: Mapping[str, int], global_batch: int) -> str | None:
    if global_batch % replicas(sizes):
        split = " x ".join(f"{a}={sizes[a]}" for a in ("data", "fsdp", "expert") if sizes[a] > 1)
        return f"batch not divisible by {split}"
    return None


def _widths(cfg: models.ModelConfig, sizes: Mapping[str, int]) -> str | None:
    """The sizes the family names per logical axis (models.Family.divisibility), and the layers into stages."""
    for logical, settings in models.family_of(cfg).parallel.divisibility(cfg).items():
        axis = SPLIT_BY.get(logical)
        if axis and any(size % sizes[axis] for _, size in settings):
            return f"{logical} not divisible by {axis}={sizes[axis]}"
    if models.stack_length(cfg) % sizes["pipeline"]:  # a mixture's stack: its groups of moe_every layers
        return f"layers not divisible by pipeline={sizes['pipeline']}"
    return None


def _sequence(cfg: models.ModelConfig, sizes: Mapping[str, int]) -> str | None:
    context = sizes["context"]
    if context > 1 and cfg.seq_len % (2 * context):
        return f"sequence not divisible by 2 x context={context}"
    return None


def _experts(cfg: models.ModelConfig, sizes: Mapping[str, int], global_batch: int) -> str | None:
    if not has_experts(cfg):
        return "expert axis on a dense model" if sizes["expert"] > 1 else None
    if sizes["context"] > 1 and (global_batch // replicas(sizes)) % sizes["context"]:
        return f"rows not divisible by context={sizes['context']} for the experts"
    return None


@functools.lru_cache(maxsize=4096)
def _weights(cfg: models.ModelConfig, mesh: tuple[tuple[str, int], ...]) -> str | None:
    """A weight dimension its mesh axes do not divide (e.g. a stack of layer groups shorter than the stages)."""
    sizes = dict(mesh)
    abstract, logical = abstract_params(cfg)
    rules = sharding_rules.resolve(STRATEGY, {}, sizes)
    for leaf, names in zip(_leaves(abstract), _leaves(logical)):
        spec = sharding_specs.mesh_spec(names, rules, None, sizes)
        for dim, axes in sharding_specs.sharded_dims(spec):
            if leaf.shape[dim] % math.prod(sizes[a] for a in axes):
                split = " x ".join(f"{a}={sizes[a]}" for a in axes)
                return f"{names[dim]} weights not divisible by {split}"
    return None


def _leaves(tree) -> list:
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
