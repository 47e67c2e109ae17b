"""Bytes per device of a candidate layout: the sharded state (from the layout's own PartitionSpecs), gradients,
activations under the remat policy and the pipeline schedule, and the largest temporaries.

Activations are counted per token of one microbatch on one device, from what the backward pass of the
family's block reads (its contract's layer_bytes_per_token): no remat keeps every intermediate, `save_dots`
the matmul outputs, `full` only each layer's input. A pipeline keeps only stage inputs for the microbatches in
flight (the schedule table's count; 1F1B holds at most p) because each backward cell recomputes its forward.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

import models
from models import lora
from sharding import rules as sharding_rules
from sharding import schedules
from sharding import specs as sharding_specs
from train.planner.candidate import Candidate

STRATEGY = "fsdp_tensor"  # every axis size is a choice of the planner; size-1 axes drop out of the rules


@functools.lru_cache(maxsize=64)
def abstract_params(cfg: models.ModelConfig):
    return models.abstract_params(dataclasses.replace(cfg, remat="none"))


@functools.lru_cache(maxsize=4096)
def layout_specs(cfg: models.ModelConfig, mesh: tuple[tuple[str, int], ...]):
    """(abstract params, their PartitionSpecs, rules) of `cfg` on `mesh`; raises ShardingConfigError if a
    weight does not divide."""
    sizes = dict(mesh)
    abstract, logical = abstract_params(dataclasses.replace(cfg, remat="none"))
    rules = sharding_rules.resolve(STRATEGY, {}, sizes)
    return abstract, sharding_specs.param_specs(abstract, logical, rules, sizes), rules


@functools.lru_cache(maxsize=4096)
def state_bytes(cfg: models.ModelConfig, mesh: tuple[tuple[str, int], ...],
                shard_opt_state: bool) -> tuple[float, float]:
    """(parameter bytes, Adam moment bytes) per device, following the layout's specs exactly; with LoRA adapters
    only they have moments (the frozen base has none)."""
    sizes = dict(mesh)
    abstract, specs, _ = layout_specs(cfg, mesh)
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    pspecs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    params = moments = 0.0
    for (path, leaf), spec in zip(leaves, pspecs):
        nbytes = math.prod(leaf.shape) * leaf.dtype.itemsize
        params += nbytes / _ways(spec, sizes)
        if lora.enabled(cfg) and not lora.is_adapter(path):
            continue
        if shard_opt_state:
            spec = sharding_specs.add_axis(spec, leaf.shape, "data", sizes)
        moments += 2 * nbytes / _ways(spec, sizes)  # Adam's mu and nu, in the parameter dtype
    return params, moments


def _ways(spec, sizes) -> int:
    return math.prod(sizes[a] for a in sharding_specs.spec_axes(spec))


@functools.lru_cache(maxsize=1024)
def schedule_table(name: str, p: int, m: int, v: int) -> schedules.Schedule:
    return schedules.build(name, p, m, v)


def per_token_layer_bytes(cfg: models.ModelConfig, remat: str, tensor: int) -> float:
    """Bytes one layer keeps for its backward pass, per token of a microbatch on one device (the family's own
    count: models.Family.layer_bytes_per_token)."""
    return models.family_of(cfg).layer_bytes_per_token(cfg, remat, tensor)


def rows_per_device(c: Candidate, global_batch: int) -> float:
    """Rows of one microbatch on one device (the batch splits over data x fsdp x expert, accumulation and
    microbatches)."""
    sizes = c.sizes
    return global_batch / (sizes["data"] * sizes["fsdp"] * sizes["expert"] * c.grad_accum_steps * c.microbatches)


def predict(cfg: models.ModelConfig, c: Candidate, global_batch: int, donated: bool) -> dict[str, float]:
    """{part: bytes per device}: params, optimizer_state, gradients, outputs (the new state when the old one is
    not donated), batch, activations, temporaries, and total."""
    sizes = c.sizes
    t, p = sizes["tensor"], sizes["pipeline"]
    params, moments = state_bytes(cfg, c.mesh, c.shard_opt_state)
    grads = params * (2 if c.grad_accum_steps > 1 else 1)  # the accumulator and one slice's gradients
    outputs = 0.0 if donated else params + moments
    batch = global_batch / (sizes["data"] * sizes["fsdp"] * sizes["expert"]) * (cfg.seq_len + 1) * 4  # int32 tokens
    tokens = rows_per_device(c, global_batch) * cfg.seq_len / sizes["context"]  # context splits every row
    layer = per_token_layer_bytes(cfg, c.remat, t) * tokens
    working = per_token_layer_bytes(cfg, "none", t) * tokens  # one layer recomputed in the backward
    b = jnp.dtype(cfg.compute_dtype).itemsize
    if p > 1:
        table = schedule_table(c.schedule, p, c.microbatches, c.virtual_stages)
        in_flight = int(max(schedules.max_in_flight(table)))
        chunk_layers = cfg.n_layers // (p * c.virtual_stages)
        activations = in_flight * tokens * cfg.d_model * b + chunk_layers * layer
    else:
        activations = cfg.n_layers * layer
    logits = 2 * tokens * cfg.vocab_size / t * 4  # float32 logits and their gradient
    parts = {"params": params, "optimizer_state": moments, "gradients": grads, "outputs": outputs,
             "batch": batch, "activations": activations, "temporaries": working + logits}
    parts["total"] = sum(parts.values())
    return parts


def resident(parts: dict[str, float]) -> float:
    """Arguments and outputs of the step only: what XLA's CPU memory analysis counts as peak."""
    return parts["params"] + parts["optimizer_state"] + parts["outputs"] + parts["batch"]
