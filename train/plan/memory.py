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
from train.plan.candidate import Candidate, mesh_of

STRATEGY = "fsdp_tensor"  # every axis size is a choice of the planner; size-1 axes drop out of the rules


@functools.lru_cache(maxsize=64)
def abstract_params(cfg: models.ModelConfig):
    return models.abstract_params(dataclasses.replace(cfg, remat="none"))


@functools.lru_cache(maxsize=4096)
def layout_specs(cfg: models.ModelConfig, mesh: tuple[tuple[str, int], ...], sequence_parallel: bool = False):
    """(abstract params, their PartitionSpecs, rules) of `cfg` on `mesh`; raises ShardingConfigError if a
    weight does not divide. Sequence parallelism splits `seq` over `tensor` too (as train/config/experiment.py does)."""
    sizes = dict(mesh)
    abstract, logical = abstract_params(dataclasses.replace(cfg, remat="none"))
    rules = sharding_rules.resolve(STRATEGY, {}, sizes)
    if sequence_parallel:
        rules = {**rules, "seq": tuple(rules.get("seq", ())) + ("tensor",)}
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


def per_token_layer_bytes(cfg: models.ModelConfig, remat: str, tensor: int, sequence_parallel: bool = False) -> float:
    """Bytes one layer keeps for its backward pass, per token of a microbatch on one device (the family's own
    count: models.Family.layer_bytes_per_token). Sequence parallelism splits over `tensor` what tensor
    parallelism leaves whole (the residual stream, the norms and their outputs), so every byte is split."""
    family = models.family_of(cfg)
    if sequence_parallel:
        return family.cost.layer_bytes_per_token(cfg, remat, 1) / tensor
    return family.cost.layer_bytes_per_token(cfg, remat, tensor)


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
    sp = c.sequence_parallel
    layer = per_token_layer_bytes(cfg, c.remat, t, sp) * tokens
    working = per_token_layer_bytes(cfg, "none", t, sp) * tokens  # one layer recomputed in the backward
    b = jnp.dtype(cfg.compute_dtype).itemsize
    if p > 1:
        table = schedule_table(c.schedule, p, c.microbatches, c.virtual_stages)
        in_flight = int(max(schedules.max_in_flight(table)))
        chunk_layers = cfg.n_layers // (p * c.virtual_stages)
        activations = in_flight * tokens * cfg.d_model * b / (t if sp else 1) + chunk_layers * layer
    else:
        activations = cfg.n_layers * layer
    logits = 2 * tokens * cfg.vocab_size / t * 4  # float32 logits and their gradient
    slots, gradients = expert_buffer_bytes(cfg, c, global_batch)
    kept = 0.0 if c.remat == "full" else slots  # full remat keeps layer inputs only
    if c.remat == "none":
        kept += pinned_weight_bytes(cfg, c)
    parts = {"params": params, "optimizer_state": moments, "gradients": grads, "outputs": outputs,
             "batch": batch, "activations": activations + kept,
             "temporaries": working + logits + gradients + gathered_kv_bytes(cfg, c, tokens)}
    parts["total"] = sum(parts.values())
    return parts


@functools.lru_cache(maxsize=4096)
def pinned_weight_bytes(cfg: models.ModelConfig, c: Candidate) -> float:
    """The blocks' weights gathered over `fsdp` where the model's hooks pin them so (sharding.specs.pins_weights):
    without remat the backward keeps every layer's gathered copy (the norms counted with them, a rounding error;
    a mixture's experts are gathered apart). 0 elsewhere."""
    abstract, specs, rules = layout_specs(cfg, c.mesh, c.sequence_parallel)
    sizes = c.sizes
    if not sharding_specs.pins_weights(rules, sizes):
        return 0.0
    leaves = jax.tree_util.tree_flatten_with_path(abstract[models.LAYERS])[0]
    pspecs = jax.tree.leaves(specs[models.LAYERS], is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize / _ways(sharding_specs.without_axis(spec, "fsdp"), sizes)
               for (path, leaf), spec in zip(leaves, pspecs)
               if "fsdp" in sharding_specs.spec_axes(spec) and "experts" not in jax.tree_util.keystr(path))


def gathered_kv_bytes(cfg: models.ModelConfig, c: Candidate, tokens: float) -> float:
    """Context parallelism inside a pipeline: a cell all-gathers one layer's K and V over `context` at a time
    (sharding/context.py, _next_block) and its backward holds their gradients before the reduce-scatter, all c
    blocks of the rows' whole sequence on each device's heads; `tokens`: the device's slice of a microbatch. 0
    elsewhere (the ring holds one block in flight)."""
    sizes = c.sizes
    if sizes["pipeline"] == 1 or sizes["context"] == 1:
        return 0.0
    kv = models.family_of(cfg).parallel.kv_heads(cfg)
    kv_heads = kv / math.gcd(kv, sizes["tensor"])  # heads split over `tensor`, or one each when fewer
    per_token = 2 * kv_heads * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize  # K and V
    return 2 * tokens * sizes["context"] * per_token  # the blocks and their gradients


def expert_buffer_bytes(cfg: models.ModelConfig, c: Candidate, global_batch: int) -> tuple[float, float]:
    """(kept, working) bytes per device of a mixture's per-expert buffers, without remat. Each mixture layer's MLP
    runs on [rows, experts, capacity] slots, not on the rows' tokens: the backward keeps the dispatched and the
    combined buffers (d_model wide) and the experts' hidden before and after the activation (d_mlp / tensor wide)
    in place of the dense MLP's two per token that per_token_layer_bytes counted; the backward of one layer holds
    the two buffers' gradients. (0, 0) for a dense model."""
    experts = models.family_of(cfg).parallel.expert_buffers(cfg)
    if experts is None:
        return 0.0, 0.0
    sizes, b = c.sizes, jnp.dtype(cfg.compute_dtype).itemsize
    rows = rows_per_device(c, global_batch)
    slots = rows * experts.experts * experts.capacity  # after the all-to-all: the local experts' slots of all rows
    mlp = cfg.d_mlp / sizes["tensor"]
    dense = rows * cfg.seq_len / sizes["context"] * 2 * mlp
    layers = experts.layers / (sizes["pipeline"] * c.virtual_stages)
    return layers * (slots * (2 * cfg.d_model + 2 * mlp) - dense) * b, 2 * slots * cfg.d_model * b


@functools.lru_cache(maxsize=64)
def expert_params(cfg: models.ModelConfig) -> int:
    """Parameters of the experts' weights (logical axis `experts`), all mixture layers and experts together."""
    abstract, logical = abstract_params(cfg)
    names = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    return sum(math.prod(leaf.shape) for leaf, spec in zip(jax.tree.leaves(abstract), names) if "experts" in spec)


def resident(parts: dict[str, float]) -> float:
    """Arguments and outputs of the step only: what XLA's CPU memory analysis counts as peak."""
    return parts["params"] + parts["optimizer_state"] + parts["outputs"] + parts["batch"]


def candidate_of(plan) -> Candidate:
    """A resolved run's layout (a train.config Plan) as the planner's candidate."""
    pipe = plan.pipeline
    return Candidate(mesh_of(plan.mesh_sizes), pipe.schedule if pipe else "none", pipe.microbatches if pipe else 1,
                     pipe.virtual_stages if pipe else 1, plan.model.remat, plan.shard_opt_state, plan.grad_accum)
