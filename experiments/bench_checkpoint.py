"""Checkpoint cost on this machine: how long an async save blocks the train loop compared with a
synchronous save of the same state, and how long a verified restore takes (onto the same layout and
onto another one). `python -m experiments.bench_checkpoint [--models=384x6,640x10 --repeats=5]`."""
from __future__ import annotations

import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
from absl import flags, logging

import checkpoint
from checkpoint import format as ckpt_format
from checkpoint import integrity
from experiments.tiny import get_config
from train import cli
from train.trainer import Trainer

_MODELS = flags.DEFINE_list("models", ["384x6", "640x10"], "d_model x n_layers of each state measured "
                            "(params + two Adam moments: about 36 x n_layers x d_model^2 bytes).")
_DEVICES = flags.DEFINE_integer("num_cpu_devices", 8, "Virtual CPU devices.", lower_bound=1)
flags.register_validator("models", lambda specs: all(len(s.split("x")) == 2 and all(x.isdigit() and int(x) > 0
                                                                                      for x in s.split("x"))
                                                     for s in specs),
                         "each must be D_MODELxN_LAYERS, e.g. 384x6")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Saves and restores timed per figure (the median is shown).",
                                lower_bound=1)


def build(d_model: int, n_layers: int, mesh: dict):
    config = get_config()
    config.data.source = "synthetic"
    config.model.update(preset="small", d_model=d_model, n_layers=n_layers, n_heads=8)
    config.mesh.update({"data": 1, **mesh})
    return Trainer.build(config)


def random_state(trainer):
    """The state with every float array filled with random values: they compress as little as trained
    weights and Adam moments do (a freshly initialized state, with zero moments, would flatter the save)."""
    def fill(state):
        leaves, treedef = jax.tree.flatten(state)
        keys = jax.random.split(jax.random.key(0), len(leaves))
        return treedef.unflatten([0.02 * jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                                  else x for k, x in zip(keys, leaves)])
    return jax.jit(fill, out_shardings=trainer.layout.state)(trainer.init_state())


def timed_saves(tier, tree, steps) -> tuple[list[float], list[float], list[float]]:
    """(blocked, until committed, checksums) seconds per save of `tree` at each of `steps` to `tier` (the
    persistent or the local one). As in the train loop, the checksums are dispatched first: they cost device time
    after the step, so they are timed on their own."""
    blocked, committed, checksum = [], [], []
    for step in steps:
        t0 = time.perf_counter()
        prepared = integrity.device_checksums(tree)
        jax.block_until_ready(prepared[1])
        t1 = time.perf_counter()
        blocked.append(tier.save(step, tree, {}, checksums=prepared))
        tier.wait()
        committed.append(time.perf_counter() - t1)
        checksum.append(t1 - t0)
    return blocked, committed, checksum


def measure(d_model: int, n_layers: int, root: str) -> list[tuple[str, str]]:
    med = statistics.median
    n = _REPEATS.value
    trainer = build(d_model, n_layers, {"fsdp": jax.device_count()})
    rng = ckpt_format.rng_of(0, trainer.mesh)
    tree = jax.block_until_ready(ckpt_format.to_tree(trainer, random_state(trainer), rng))
    mb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)) / 1e6
    runs = checkpoint.Checkpoints(f"{root}/async", keep=n + 1)
    runs.save(1, tree, {})  # a process's first save compiles the checksum program: not timed
    runs.wait()
    blocked, committed, checksum = timed_saves(runs, tree, range(2, 2 + n))
    sync = checkpoint.Checkpoints(f"{root}/sync", keep=n, async_save=False)
    synchronous = []
    for step in range(1, 1 + n):
        t0 = time.perf_counter()
        sync.save(step, tree, {})
        sync.wait()
        synchronous.append(time.perf_counter() - t0)
    same = _restores(runs, trainer)
    other = _restores(runs, build(d_model, n_layers, {"data": 2, "fsdp": 2, "tensor": 2})) \
        if jax.device_count() == 8 else [float("nan")]
    return [("state", f"{mb:,.0f} MB ({d_model}x{n_layers}, fsdp={jax.device_count()})"),
            ("loop blocked by async save", f"{med(blocked):.3f} s"),
            ("async save until committed", f"{med(committed):.3f} s"),
            ("checksums (device time)", f"{med(checksum):.3f} s"),
            ("synchronous save", f"{med(synchronous):.3f} s"),
            ("blocked / synchronous", f"{med(blocked) / med(synchronous):.3f}"),
            ("restore+verify, same layout", f"{med(same):.3f} s"),
            ("restore+verify, 2x2x2 layout", f"{med(other):.3f} s")]


def _restores(ckpts, trainer) -> list[float]:
    times = []
    for _ in range(_REPEATS.value):
        t0 = time.perf_counter()
        jax.block_until_ready(checkpoint.restore_newest(ckpts, ckpt_format.target(trainer)).tree)
        times.append(time.perf_counter() - t0)
    return times


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # as in training: Orbax logs every save at INFO
    jax.config.update("jax_num_cpu_devices", _DEVICES.value)
    columns = []
    for spec in _MODELS.value:
        d_model, n_layers = (int(x) for x in spec.split("x"))
        root = tempfile.mkdtemp(prefix="bench_checkpoint_")
        try:
            columns.append(measure(d_model, n_layers, root))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(f"checkpoint benchmark: {jax.devices()[0].device_kind}, {jax.device_count()} devices, median of "
          f"{_REPEATS.value} (target: blocked / synchronous <= 0.05)")
    names = [name for name, _ in columns[0]]
    width = max(len(n) for n in names)
    cell = max(len(v) for col in columns for _, v in col)
    print("| " + " | ".join([" " * width] + [f"{i + 1:^{cell}}" for i in range(len(columns))]) + " |")
    print("|" + "|".join(["-" * (width + 2)] + ["-" * (cell + 2)] * len(columns)) + "|")
    for row, name in enumerate(names):
        print("| " + " | ".join([f"{name:<{width}}"] + [f"{col[row][1]:>{cell}}" for col in columns]) + " |")


if __name__ == "__main__":
    cli.run(main)  # a bad flag or setting: one line, exit 2
