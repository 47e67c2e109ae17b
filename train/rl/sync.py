"""The weight sync: the trainer's params (its layout, the layers stacked) -> each engine replica's per-layer weights
(models/paged.unstack, split over the replica's `tensor`) on the devices, with no host round trip. One jitted program,
compiled once, lays the weights out in the engine's layout on the trainer's own devices (the staging mesh: its
devices in rows of rl.rollout_tensor); then each replica device takes the slice it needs from a staging device of
its process, the one it is itself where the placement is colocated (no copy), another one where it is split
(a device-to-device copy, batched in one jax.device_put)."""
from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

import models
from models import paged
from train.state import ParamLayout


def _index(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict[jax.Device, tuple]:
    """Each device's slice of an array of `shape`, hashable."""
    return {d: tuple((s.start, s.stop, s.step) for s in idx) for d, idx in sharding.devices_indices_map(shape).items()}


def _on(layout_shardings: Any, mesh: jax.sharding.Mesh) -> Any:
    """NamedShardings of the same specs on another mesh with the same axis names."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s.spec), layout_shardings)


def gather_slices(staged: Any, targets: Any) -> Any:
    """`staged` (arrays laid out alike on other devices) as arrays in the `targets` shardings, each target device's
    slice taken from a local staged shard holding exactly it: itself when it is on that device, else copied."""
    leaves, treedef = jax.tree.flatten(staged)
    wanted = treedef.flatten_up_to(targets)
    picks, moves = [], []
    for x, sharding in zip(leaves, wanted):
        by_slice: dict[tuple, list] = {}
        for shard in x.addressable_shards:
            by_slice.setdefault(tuple((s.start, s.stop, s.step) for s in shard.index), []).append(shard.data)
        chosen = []
        for device, index in _index(sharding, x.shape).items():
            if device.process_index != jax.process_index():
                continue
            found = by_slice[index]
            here = next((b for b in found if b.devices() == {device}), None)
            if here is None:
                moves.append((len(picks), len(chosen), found[0], device))
            chosen.append(here)
        picks.append(chosen)
    if moves:
        copied = jax.device_put([m[2] for m in moves], [m[3] for m in moves])
        for (leaf, slot, _, _), array in zip(moves, copied):
            picks[leaf][slot] = array
    out = [jax.make_array_from_single_device_arrays(x.shape, s, bufs) for x, s, bufs in zip(leaves, wanted, picks)]
    return treedef.unflatten(out)


class WeightSync:
    """Trainer params -> the local replicas' engine weights (per-layer), and their stacked params once for building
    the engines. `replicas`: the local replicas' ParamLayouts; `staging`: the trainer's devices as rows of tensor."""

    def __init__(self, cfg: models.ModelConfig, trainer: ParamLayout, staging: jax.sharding.Mesh,
                 replicas: list[ParamLayout]):
        assert replicas, "every process runs a replica of the engine (train/rl/engines.py)"
        self.cfg, self.replicas = cfg, replicas
        self.stacked_staging = _on(replicas[0].params, staging)
        self.unstacked_staging = paged.unstacked_shardings(self.stacked_staging, cfg)
        self.targets = [paged.unstacked_shardings(r.params, cfg) for r in replicas]
        self._unstack = jax.jit(lambda p: paged.unstack(p, cfg), in_shardings=(trainer.params,),
                                out_shardings=self.unstacked_staging)
        self._restack = jax.jit(lambda p: p, in_shardings=(trainer.params,), out_shardings=self.stacked_staging)
        self.version, self.seconds, self.bytes = 0, 0.0, 0

    def stacked(self, params: Any) -> list[Any]:
        """The params in each local replica's (stacked) layout: what an Engine is built from."""
        staged = self._restack(params)
        return [gather_slices(staged, r.params) for r in self.replicas]

    def __call__(self, params: Any, engines: list) -> None:
        """Give every local engine `params` as its weights, empty its prefix cache, count a policy version."""
        t0 = time.perf_counter()
        staged = self._unstack(params)
        weights = [gather_slices(staged, target) for target in self.targets]
        jax.block_until_ready(weights)
        for engine, w in zip(engines, weights):
            engine.update_weights(w)  # in place, nothing compiled again; the prefix cache emptied
        self.seconds = time.perf_counter() - t0
        self.bytes = sum(int(np.prod(s.data.shape)) * s.data.dtype.itemsize
                         for w in weights for leaf in jax.tree.leaves(w) for s in leaf.addressable_shards)
        self.version += 1
