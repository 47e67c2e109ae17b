"""The memory-bound part of a step: bytes one device moves through its memory outside the matmuls, priced at the
device's bandwidth (the topology's `hbm_gbps`, a datasheet's or `--calibrate`'s). Where matmuls are small these
terms decide the step, so a roofline prices each part at the bound that limits it.

Parts, per device and step (every microbatch and accumulation step):
- elementwise: norms, activations, residual adds, rotary: every intermediate a layer keeps for its backward
  (the contract's layer_bytes_per_token with no remat; all of it split over `tensor` under sequence
  parallelism, the residual stream's part left whole without) is written by the forward, then read and its gradient
  written by the backward (PASSES = 3); each recomputed forward (full remat, a pipeline's backward cell) writes
  them once more;
- attention_scores: XLA's attention writes the L x L scores and probabilities, and reads them back in the
  backward; a fused (cuDNN flash) kernel keeps them on chip, so only its FLOPs count;
- logits: the float32 logits, written, read by the softmax and their gradient written;
- optimizer: Adam reads each local parameter, its gradient and both moments and writes the parameter and the
  moments (over the data shard when the optimizer state is sharded).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import models
from mesh import topology as topology_lib
from models import attention as attention_lib
from train.plan import feasible, memory
from train.plan.candidate import Candidate

PASSES = 3  # forward write; backward read and gradient write (an assumption of one pass each, no reuse in cache)


def platform(topo: topology_lib.Topology) -> str:
    """The platform the topology's devices are: the DGX presets are GPUs, the TPU presets TPUs, anything else
    (`local`, a fitted or calibrated file) the devices of this process."""
    if topo.name.startswith("dgx"):
        return "gpu"
    if topo.name.startswith("tpu"):
        return "tpu"
    return jax.devices()[0].platform


def attention_kernel(cfg: models.TransformerConfig, topo: topology_lib.Topology) -> str:
    """`xla` or `cudnn`: the family's `attention` setting resolved as a run on the topology's devices would."""
    try:
        return attention_lib.resolve(cfg.attention, platform(topo), cfg.compute_dtype, cfg.head_dim)
    except ValueError:
        return "xla"  # an explicit cudnn the platform cannot run: the run itself will say so


def parts(cfg: models.ModelConfig, c: Candidate, global_batch: int, topo: topology_lib.Topology) -> dict[str, float]:
    """{part: bytes} one device moves per step outside the matmuls."""
    sizes = c.sizes
    t, b = sizes["tensor"], jnp.dtype(cfg.compute_dtype).itemsize
    tokens = global_batch * cfg.seq_len / (feasible.replicas(sizes) * sizes["context"])
    layers = cfg.n_layers / sizes["pipeline"]
    scores = 2 * cfg.n_heads * cfg.seq_len / t * b  # scores and probabilities per token (XLA's attention)
    kept = memory.per_token_layer_bytes(cfg, "none", t, c.sequence_parallel) - scores
    recomputed = (cfg.remat == "full") + (sizes["pipeline"] > 1)
    # a mixture's experts work on their slots: one microbatch's, on each chunk of the device's layers
    slots = memory.expert_buffer_bytes(cfg, c, global_batch)[0] * c.microbatches * c.grad_accum_steps * \
        c.virtual_stages
    out = {"elementwise": (PASSES + recomputed) * (kept * tokens * layers + slots),
           "attention_scores": 0.0, "logits": PASSES * tokens * cfg.vocab_size / t * 4}
    if attention_kernel(cfg, topo) == "xla":
        out["attention_scores"] = (PASSES + recomputed) * scores * tokens * layers
    params, moments = memory.state_bytes(cfg, c.mesh, c.shard_opt_state)
    updated = params / sizes["data"] if c.shard_opt_state else params
    out["optimizer"] = 3 * updated + 2 * moments  # read parameter and gradient, write parameter; moments both ways
    return out


def seconds(cfg: models.ModelConfig, c: Candidate, global_batch: int,
            topo: topology_lib.Topology) -> dict[str, float]:
    """{part: seconds} at the device's memory bandwidth; all 0 when the topology does not know it."""
    if not topo.hbm_gbps:
        return {}
    return {k: v / (topo.hbm_gbps * 1e9) for k, v in parts(cfg, c, global_batch, topo).items()}
