"""Where the engine and the trainer run (rl.placement): the devices of each, and the engine's replicas, each a
tensor-parallel Engine (train/serve/engine.py) on rl.rollout_tensor devices of one process. Colocated, the replicas
are consecutive blocks of the trainer mesh's device order, so the weight sync's staging layout already holds each
replica's slices on its own devices; split, the engine has devices of its own and the trainer the rest."""
from __future__ import annotations

import dataclasses

import jax
import ml_collections

from mesh import make_mesh
from train import state as state_lib
from train.config.experiment import resolve
from train.config.sections import RLSection
from train.exit_codes import ConfigError


def sorted_devices() -> list[jax.Device]:
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def split_devices(rl: RLSection) -> tuple[list[jax.Device], list[jax.Device]]:
    """(the engine's devices, the trainer's) of placement=split: the first rl.rollout_devices / processes local
    devices of each process go to the engine; all of them when colocated (then both are every device)."""
    devices = sorted_devices()
    if rl.placement == "colocated":
        return devices, devices
    processes = jax.process_count()
    n = rl.rollout_devices
    if not 0 < n < len(devices) or n % (processes * rl.rollout_tensor):
        raise ConfigError(f"rl.rollout_devices={n}: placement=split needs between 1 and {len(devices) - 1} devices "
                          f"for the engine, a multiple of rl.rollout_tensor={rl.rollout_tensor} on each of the "
                          f"{processes} process(es)")
    per = n // processes
    engine = [d for p in range(processes) for d in [x for x in devices if x.process_index == p][:per]]
    return engine, [d for d in devices if d not in engine]


def trainer_devices(rl: RLSection) -> list[jax.Device]:
    return split_devices(rl)[1]


@dataclasses.dataclass(frozen=True)
class Replicas:
    """The engine's replicas: each one's devices (rl.rollout_tensor of them, in its tensor order)."""
    devices: tuple[tuple[jax.Device, ...], ...]

    @property
    def local(self) -> list[int]:
        """The replicas this process runs (their devices are its own)."""
        return [r for r, ds in enumerate(self.devices) if ds[0].process_index == jax.process_index()]


def replicas(rl: RLSection, trainer_mesh: jax.sharding.Mesh) -> Replicas:
    """Colocated: consecutive blocks of the trainer mesh's device order; split: of the engine's devices."""
    devices = list(trainer_mesh.devices.flat) if rl.placement == "colocated" else split_devices(rl)[0]
    t = rl.rollout_tensor
    if len(devices) % t:
        raise ConfigError(f"rl.rollout_tensor={t} does not divide the engine's {len(devices)} devices; choose a "
                          f"divisor")
    blocks = tuple(tuple(devices[i:i + t]) for i in range(0, len(devices), t))
    if any(len({d.process_index for d in b}) > 1 for b in blocks):
        raise ConfigError(f"rl.rollout_tensor={t}: a replica would span processes; use a divisor of each process's "
                          f"devices")
    return Replicas(blocks)


def engine_config(config: ml_collections.ConfigDict, tensor: int) -> ml_collections.ConfigDict:
    """The run's config as one replica decodes it: `tensor` ways of tensor parallelism and nothing else."""
    out = ml_collections.ConfigDict(config.to_dict())
    out.mesh.update({axis: 1 for axis in out.mesh})
    out.mesh.tensor = tensor
    out.sharding.update(strategy="tensor_parallel", rules={}, sequence_parallel=False, shard_opt_state=False)
    out.plan.auto = False
    out.train.update(global_batch_size=1, grad_accum_steps=1)
    return out


def engine_layout(config: ml_collections.ConfigDict, tensor: int, devices) -> state_lib.ParamLayout:
    """A replica's parameter layout on `devices` (checked: the model's heads and widths must split `tensor` ways)."""
    try:
        plan = resolve(engine_config(config, tensor), tensor)
    except ConfigError as e:
        raise ConfigError(f"rl.rollout_tensor={tensor}: {e}") from None
    mesh = make_mesh({"tensor": tensor}, devices=list(devices))
    return state_lib.param_layout(plan.model, plan.rules, mesh)


def staging_mesh(trainer_mesh: jax.sharding.Mesh, tensor: int) -> jax.sharding.Mesh:
    """The trainer's devices, in its mesh order, as rows of `tensor`: where the sync lays the engine's weights out
    before they reach it (a jitted program's outputs must be on its inputs' devices, in the same order)."""
    devices = list(trainer_mesh.devices.flat)
    if len(devices) % tensor:
        raise ConfigError(f"rl.rollout_tensor={tensor} does not divide the trainer's {len(devices)} devices (the "
                          f"sync stages the engine's layout there); choose a divisor")
    return make_mesh({"data": len(devices) // tensor, "tensor": tensor}, devices=devices)
