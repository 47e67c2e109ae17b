"""The communication a layout must do by construction, per step and per device, in nccl-tests bytes S.

Data parallel: one all-reduce of the gradients over the axes that split the batch but not the weight.
FSDP / ZeRO-3: the weights are all-gathered over `fsdp` in the forward pass and again in the backward
pass (the memory-saving choice of ZeRO-3), and their gradients reduce-scattered once.
Megatron tensor parallelism: per block, one activation all-reduce after attention and one after the MLP,
each mirrored in the backward pass, plus the embedding (forward) and the head's input gradient (backward);
full rematerialization repeats the two forward ones.
Pipeline (sharding/pipeline.py): the lockstep executor sends one activation and one gradient per time slot,
2(vm+p-1) slots a step; each backward cell recomputes its forward (tensor all-reduces as under full remat);
FSDP weights are gathered once per step (pipeline.FSDP_GATHER), not in the forward and again in the backward.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
from jax.sharding import PartitionSpec as P

import models


@dataclasses.dataclass(frozen=True)
class Expected:
    purpose: str
    op: str                    # as in mesh.hlo records
    axes: tuple[str, ...]      # mesh axes of one collective, in mesh order (a str for one axis)
    bytes: float               # sum over the step of S x executions, per device

    def __post_init__(self):
        if isinstance(self.axes, str):
            object.__setattr__(self, "axes", (self.axes,))


def _axes_of(spec: P) -> set[str]:
    out: set[str] = set()
    for entry in spec:
        out.update((entry,) if isinstance(entry, str) else (entry or ()))
    return out


def _shard_bytes(leaf, spec: P, sizes: Mapping[str, int], drop: str | None = None) -> float:
    """Bytes of one device's piece of `leaf` under `spec`, optionally as if `drop` did not split it."""
    ways = math.prod(sizes[a] for a in _axes_of(spec) if a != drop)
    return math.prod(leaf.shape) * leaf.dtype.itemsize / ways


def expected_traffic(cfg: models.GPTConfig, abstract_params: Any, param_specs: Any, rules: Mapping,
                     sizes: Mapping[str, int], global_batch: int,
                     pipeline: Mapping[str, int] | None = None) -> list[Expected]:
    """What the layout requires; `pipeline` = {microbatches, virtual_stages} when mesh.pipeline > 1."""
    leaves = jax.tree.leaves(abstract_params)
    specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, P))
    batch_axes = [a for a in rules.get("batch", ()) if sizes.get(a, 1) > 1]
    pipelined = bool(pipeline) and sizes.get("pipeline", 1) > 1
    out: list[Expected] = []
    for axis in batch_axes:
        grads = gathered = 0.0
        for leaf, spec in zip(leaves, specs):
            if axis in _axes_of(spec):  # sharded over the batch axis: FSDP gathers and reduce-scatters
                gathered += _shard_bytes(leaf, spec, sizes, drop=axis)
            else:                       # replicated over it: plain data-parallel all-reduce of its shard
                grads += _shard_bytes(leaf, spec, sizes)
        if grads:
            out.append(Expected("gradient all-reduce", "all_reduce", axis, grads))
        if gathered:
            if pipelined:
                out.append(Expected("weight all-gather (once per step, pipeline)", "all_gather", axis, gathered))
            else:
                out.append(Expected("weight all-gather (forward + backward)", "all_gather", axis, 2 * gathered))
            out.append(Expected("gradient reduce-scatter", "reduce_scatter", axis, gathered))
    tensor = sizes.get("tensor", 1)
    if tensor > 1 and any("tensor" in _axes_of(s) for s in specs):
        ways = math.prod(sizes[a] for a in batch_axes)
        stages = sizes.get("pipeline", 1)
        act = global_batch // ways * cfg.seq_len * cfg.d_model * jax.numpy.dtype(cfg.compute_dtype).itemsize
        per_layer = (6 if cfg.remat == "full" else 4) + (2 if pipelined else 0)
        out.append(Expected("activation all-reduce (Megatron)", "all_reduce", "tensor",
                            (per_layer * cfg.n_layers // stages + 2) * act))
    if pipelined:
        ways = math.prod(sizes[a] for a in batch_axes)
        micro = global_batch // ways // pipeline["microbatches"]
        act = micro * cfg.seq_len * cfg.d_model * jax.numpy.dtype(cfg.compute_dtype).itemsize
        slots = 2 * (pipeline.get("virtual_stages", 1) * pipeline["microbatches"] + sizes["pipeline"] - 1)
        sends = 2 * slots  # idle cells send zeros: SPMD collectives run on every device every slot
        out.append(Expected("stage activations and gradients", "collective_permute", "pipeline", sends * act))
    return out
