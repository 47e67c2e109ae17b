"""The measured step `--calibrate` sets against its roofline: the planned model's first layers (one of each kind
of block), the rows per device of its data-parallel layout (the global batch over the local devices, halved until
the step fits in half a device's memory), a whole training step (forward, backward, clipped AdamW) on every local
device at once, each on its own rows and its own copy of the state, so no collective runs. Its fastest time over
the roofline's work for the same step (matmuls on the calibrated curve, memory-bound bytes at the measured
bandwidth) is the topology's `step_overhead`: the work a roofline does not see, which the planner then charges
every layout's compute and memory-bound work. On XLA:CPU that is most of the step (many small copies, transposes,
scan-stack updates and fills: docs/benchmarks.md); on an accelerator, kernel launches and what fusion leaves.
"""
from __future__ import annotations

import dataclasses

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
from mesh import make_mesh
from mesh import topology as topology_lib
from models import lora
from train.plan import memory, timing
from train.plan.candidate import Candidate, mesh_of
from train.runtime import hardware, probes

MEMORY_SHARE = 0.5  # of a device's memory the reference step may take
# the training step's own kinds of work: its objective, a global-norm clip, AdamW with weight decay
OPTIMIZER = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, weight_decay=0.1))


def reference_model(cfg: models.ModelConfig) -> models.ModelConfig:
    """The model's first layers: two, or a mixture's whole group of `moe_every` when that is more. Without LoRA
    adapters: the step then trains every weight, as its roofline counts it, whatever a run would freeze."""
    group = cfg.n_layers // models.stack_length(cfg)
    ref = dataclasses.replace(cfg, n_layers=min(cfg.n_layers, max(2, group)))
    return dataclasses.replace(ref, lora_rank=0) if lora.enabled(ref) else ref


def _candidate(ref: models.ModelConfig) -> Candidate:
    return Candidate(mesh_of({"data": jax.local_device_count()}), remat=ref.remat)


def fits(ref: models.ModelConfig, rows: int) -> bool:
    """Whether every device can hold the reference step: its own copy of the state, the new state beside it (the
    step does not donate), activations, logits and temporaries, as the planner counts them."""
    limit = hardware.memory_per_device()
    if limit is None:
        return True
    need = memory.predict(ref, _candidate(ref), jax.local_device_count() * rows, donated=False)["total"]
    return need <= MEMORY_SHARE * limit


def rows_per_device(ref: models.ModelConfig, global_batch: int) -> int | None:
    """The data-parallel layout's rows per device, halved until the step fits (a run would accumulate or
    pipeline them); None when even one row does not fit."""
    rows = max(1, global_batch // jax.local_device_count())
    while not fits(ref, rows):
        if rows == 1:
            return None
        rows //= 2
    return rows


def describe(cfg: models.ModelConfig, global_batch: int) -> str:
    """The reference step in words, for the calibrated file's provenance."""
    ref = reference_model(cfg)
    rows = rows_per_device(ref, global_batch)
    what = f"{ref.n_layers} layers of {cfg.family} d_model={cfg.d_model}"
    if rows is None:
        return f"{what}: not measured, one row's step would take more than half a device's memory (step_overhead 1)"
    return f"{what}, {rows} x {cfg.seq_len} tokens per device"


def roofline_seconds(ref: models.ModelConfig, topo: topology_lib.Topology, rows: int) -> float:
    """The planner's compute + memory-bound work for the reference step, before any overhead."""
    compute, bound = timing.work_seconds(ref, _candidate(ref), jax.local_device_count() * rows,
                                         dataclasses.replace(topo, step_overhead=1.0))
    return compute + sum(bound.values())


def train_step(ref: models.ModelConfig, mesh: jax.sharding.Mesh):
    """jit(params, opt_state, tokens): each device trains its own copy of the replicated state on its rows. The
    copies are cast to vary over `data` first, so the gradients are each device's own: no all-reduce."""
    def local(p, s, t):
        p, s = jax.lax.pcast((p, s), "data", to="varying")
        grads = jax.grad(lambda q: models.loss_and_metrics(q, t, ref)[0])(p)
        updates, s = OPTIMIZER.update(grads, s, p)
        return jax.tree.map(lambda x: x[None], (optax.apply_updates(p, updates), s))

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P("data")))


def measured_seconds(ref: models.ModelConfig, rows: int, repeats: int) -> float:
    """The fastest of `repeats` reference steps (after one that compiles), every local device at once."""
    k = jax.local_device_count()
    mesh = make_mesh({"data": k}, devices=jax.local_devices())
    params = jax.device_put(models.init_params(ref, 0), NamedSharding(mesh, P()))
    state = jax.jit(OPTIMIZER.init)(params)
    tokens = jax.random.randint(jax.random.key(0), (k * rows, ref.seq_len + 1), 0, ref.vocab_size)
    tokens = jax.device_put(tokens, NamedSharding(mesh, P("data")))
    step = train_step(ref, mesh)
    return probes.best_seconds(lambda t: step(params, state, t), tokens, repeats)


def step_overhead(cfg: models.ModelConfig, global_batch: int, topo: topology_lib.Topology,
                  repeats: int) -> float | None:
    """Measured over roofline for `cfg`'s reference step on `topo` (calibrated), or None when it does not fit."""
    ref = reference_model(cfg)
    rows = rows_per_device(ref, global_batch)
    if rows is None:
        return None
    return measured_seconds(ref, rows, repeats) / roofline_seconds(ref, topo, rows)
