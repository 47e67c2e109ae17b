"""The local checkpoint tier against the persistent one on this machine: how long a save blocks the loop, until it
commits, and a verified restore, per tier; then the steps a failure loses with and without the local tier at a
given cadence. `python -m experiments.bench_tiers [--local_dir=/dev/shm --every_steps=100 --local_every_steps=10]`."""
from __future__ import annotations

import shutil
import statistics
import tempfile
import time

import jax
import numpy as np
from absl import flags, logging

import checkpoint
from checkpoint import format as ckpt_format
from experiments import default, tiny
from experiments.bench_checkpoint import random_state, timed_saves  # and its --repeats, --num_cpu_devices
from train import cli
from train.trainer import Trainer

_LOCAL = flags.DEFINE_string("local_dir", "/dev/shm", "Node-local storage for the local tier (the persistent tier "
                             "goes to a temporary folder on the disk of --persistent_dir).")
_PERSISTENT = flags.DEFINE_string("persistent_dir", "", "Where the persistent tier is written (default: the "
                                  "system's temporary folder).")
_EVERY = flags.DEFINE_integer("every_steps", 100, "Persistent cadence for the steps-lost rows.")
_LOCAL_EVERY = flags.DEFINE_integer("local_every_steps", 10, "Local cadence for the steps-lost rows.")
_STEP_S = flags.DEFINE_float("step_s", 1.0, "Step time assumed for the steps-lost rows (a save that has not "
                             "committed yet cannot be restored).")

MODELS = {"tiny": lambda: _config(tiny.get_config(), data=8), "default": lambda: _config(
    default.get_config("fsdp_tensor"))}


def _config(config, **mesh):
    config.plan.auto = False
    config.data.source = "synthetic"
    config.mesh.update(mesh)
    return config


def _timed_restores(restore) -> list[float]:
    times = []
    for _ in range(flags.FLAGS.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(restore().tree)
        times.append(time.perf_counter() - t0)
    return times


def measure(name: str, root: str) -> dict[str, tuple[float, float, float]]:
    """{tier: (blocked s, until committed s, restore + verify s)}, medians, and the state's size in MB."""
    trainer = Trainer.build(MODELS[name]())
    target = ckpt_format.target(trainer)
    rng = ckpt_format.rng_of(0, trainer.mesh)
    tree = jax.block_until_ready(ckpt_format.to_tree(trainer, random_state(trainer), rng))
    persistent = checkpoint.Checkpoints(f"{_PERSISTENT.value or root}/{name}/checkpoints", keep=2)
    empty = checkpoint.Checkpoints(f"{root}/{name}-empty/checkpoints", keep=1)
    local = checkpoint.LocalCheckpoints(_LOCAL.value, f"{root}/{name}")
    steps = range(1, flags.FLAGS.repeats + 2)  # the first save of each tier warms up and is not counted
    out = {}
    for tier, restore in ((persistent, lambda: checkpoint.restore_newest(persistent, target)),
                          (local, lambda: checkpoint.restore_tiers(empty, local, target))):
        blocked, committed, _ = timed_saves(tier, tree, steps)
        med = statistics.median
        out["persistent" if tier is persistent else "local"] = (med(blocked[1:]), med(committed[1:]),
                                                               med(_timed_restores(restore)))
    shutil.rmtree(local.root, ignore_errors=True)
    persistent.close()
    mb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)) / 1e6
    return out, mb


def steps_lost(every: int, commit_s: float, step_s: float, horizon: int = 20) -> float:
    """Mean steps redone after a failure at a uniformly random time: the steps run since the newest save that
    had committed (a save of step s commits commit_s after s ends; saves at every `every` steps)."""
    times = np.linspace(0, horizon * every * step_s, 200_001)[1:]
    done = np.floor(times / step_s)
    saved = np.floor(np.maximum(times - commit_s, 0) / step_s / every) * every
    return float(np.mean(done - saved))


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    jax.config.update("jax_num_cpu_devices", flags.FLAGS.num_cpu_devices)
    rows = {}
    root = tempfile.mkdtemp(prefix="bench_tiers_")
    try:
        for name in MODELS:
            rows[name] = measure(name, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    where = _PERSISTENT.value or tempfile.gettempdir()
    print(f"checkpoint tiers: {jax.devices()[0].device_kind}, {jax.device_count()} devices, median of "
          f"{flags.FLAGS.repeats}; local tier in {_LOCAL.value}, persistent in {where}")
    print("| model (state) | tier | loop blocked | until committed | restore + verify |")
    print("|---|---|---|---|---|")
    for name, (tiers, mb) in rows.items():
        for tier, (blocked, committed, restore) in tiers.items():
            print(f"| {name} ({mb:,.0f} MB) | {tier} | {blocked:.3f} s | {committed:.3f} s | {restore:.3f} s |")
    every, local_every, step_s = _EVERY.value, _LOCAL_EVERY.value, _STEP_S.value
    print(f"\nsteps lost per failure, step time {step_s:g} s, persistent every {every} steps, local every "
          f"{local_every} (commit delays as measured above)")
    print("| model | persistent only | with the local tier: process crash, or node lost with its peer's copy |")
    print("|---|---|---|")
    for name, (tiers, _) in rows.items():
        print(f"| {name} | {steps_lost(every, tiers['persistent'][1], step_s):.1f} | "
              f"{steps_lost(local_every, tiers['local'][1], step_s):.1f} |")


if __name__ == "__main__":
    cli.run(main)  # a bad flag or setting: one line, exit 2
