"""Saving during training: when (every_steps; every_minutes, agreed across processes; the final step;
preemption), what (the plain state tree with the RNG, and meta with every array's checksum), and what
it cost (blocked and save seconds into metrics.jsonl and goodput). At most one save is in flight: a save
waits for the one before. A failed save (full disk, unwritable or vanished directory) is reported (a
warning line and goodput.json) and training goes on, saving again when the next save is due;
checkpoint.max_failed_saves failures in a row, or a failed final or preemption save, stop the run (exit 74).
The local tier (checkpoint.local_dir) saves every local_every_steps when no persistent save is due; the one save in
flight is across both tiers, so a local save never blocks longer than a persistent one would."""
from __future__ import annotations

import json
import time
from typing import Any

import jax

import checkpoint
from checkpoint import SaveFailed, plain
from checkpoint import format as ckpt_format
from mesh.layout import axis_sizes
from train.loop.goodput import Goodput
from train.loop.metrics import MetricsLog
from train.runtime import versions
from train.trainer import Trainer


def _spec(spec) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def recorded_config(trainer: Trainer) -> dict[str, Any]:
    """The run's config as meta records it: the raw config, JSON-safe now (not in the commit), with the data
    order the plan trains with (resume sets `random` for a checkpoint from before data.order)."""
    config = json.loads(json.dumps(trainer.config.to_dict(), default=str))
    config.setdefault("data", {})["order"] = trainer.plan.data.order
    return config


def describe_run(trainer: Trainer) -> dict[str, Any]:
    """Everything about the writer that meta records besides the arrays."""
    layout = trainer.layout
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    return {
        "config": recorded_config(trainer),
        "mesh": axis_sizes(trainer.mesh), "device_count": jax.device_count(), "process_count": jax.process_count(),
        "logical_axes": {k: _spec(v) for k, v in plain.flatten(layout.logical_axes, is_leaf=is_spec).items()},
        "partition_specs": {k: _spec(s.spec) for k, s in plain.flatten(layout.state).items()},
        "versions": versions.libraries(),
    }


class Saver:
    def __init__(self, ckpts: checkpoint.Checkpoints, trainer: Trainer, log: MetricsLog, goodput: Goodput,
                 last_saved: int, local: checkpoint.LocalCheckpoints | None = None):
        self.ckpts, self.trainer, self.local = ckpts, trainer, local
        every = trainer.plan.checkpoint
        self.enabled = every.enabled  # False (checkpoint.enabled): the loop schedules no save (train/loop/builtin.py)
        self.policy = (checkpoint.SavePolicy(every.every_steps, every.every_minutes, every.mtbf_hours)
                       if self.enabled else checkpoint.SavePolicy())  # disabled: never due
        self._blocked: list[float] = []  # measured save costs, for the mtbf_hours interval
        self.run_info = describe_run(trainer)
        self.log, self.goodput = log, goodput
        self.last_saved = last_saved  # the newest step saved or being saved
        self._committed = self._asked = last_saved  # the newest step whose save committed (-1: none); asked for
        self.max_failed, self.failures = every.max_failed_saves, 0  # failures: consecutive failed saves
        self._since = time.monotonic()
        self.local_every = every.local_every_steps if local is not None and self.enabled else 0
        self._prepared: tuple[int, Any, Any] | None = None  # (step, tree, checksums dispatched)

    def step_due(self, step: int) -> bool:
        """A step-based save of either tier."""
        return self.policy.step_due(step) or bool(self.local_every and step % self.local_every == 0)

    def time_due(self) -> bool:
        """This process's view; the loop makes it agreed before acting on it."""
        cost = sum(self._blocked) / len(self._blocked) if self._blocked else None
        return self.policy.time_due(time.monotonic() - self._since, cost)

    def warm_up(self, state: dict[str, Any], rng: jax.Array) -> float:
        """Compile the checksum program (and the layer reordering, if any) now, not at the first save;
        returns the seconds it took."""
        if not self.enabled:
            return 0.0
        t0 = time.perf_counter()
        jax.block_until_ready(ckpt_format.to_tree_with_checksums(self.trainer, state, rng)[1])
        return time.perf_counter() - t0

    def prepare(self, step: int, state: dict[str, Any], rng: jax.Array) -> None:
        """Dispatch the checksums of `step`'s state while the step still runs, so they cost device time
        after it rather than time on this thread (a dispatch with ready inputs runs inline on CPU)."""
        self._prepared = (step, *ckpt_format.to_tree_with_checksums(self.trainer, state, rng))

    def save(self, step: int, state: dict[str, Any], rng: jax.Array, persistent: bool = True) -> None:
        """Save `step` (its state must be finite: the loop checked its metrics first), in logical layer
        order so that any pipeline layout can restore it; to the local tier unless `persistent`."""
        if step == self.last_saved:
            return
        if self._prepared and self._prepared[0] == step:
            _, tree, checksums = self._prepared
        else:
            tree, checksums = ckpt_format.to_tree(self.trainer, state, rng), None
        self._prepared = None
        jax.block_until_ready(tree)  # waiting for the step itself is step time, not checkpoint time
        t0 = time.perf_counter()
        for tier in self._tiers():  # the save in flight commits (or fails) first: one in flight at most
            self._collect(tier, wait=True)
        self.last_saved = self._asked = step
        tier = self.ckpts if persistent or self.local is None else self.local
        if tier is self.ckpts:
            self._since = time.monotonic()  # a failed save, too, waits for the next due point
        try:
            blocked = tier.save(step, tree, self.run_info, checksums=checksums, waited_s=time.perf_counter() - t0)
        except SaveFailed as e:
            self._failed(e)
            return
        self.goodput.add("checkpoint_blocked_s", blocked)
        if tier is self.ckpts:
            self._blocked.append(blocked)

    def _tiers(self) -> list:
        return [self.ckpts] + ([self.local] if self.local is not None else [])

    def _report(self, records: list[checkpoint.SaveRecord], tier: str = "persistent") -> None:
        for r in records:
            self.log.write({"step": r.step, "checkpoint_blocked_s": round(r.blocked_s, 4),
                            "checkpoint_save_s": round(r.save_s, 4), "checkpoint_tier": tier})
            self._committed, self.failures = r.step, 0

    def _failed(self, error: SaveFailed, last_chance: bool = False) -> None:
        """Report a failed save; raise SaveFailed (exit 74) at checkpoint.max_failed_saves failures in a
        row, or when no later save would come (`last_chance`: the final or the preemption save)."""
        self.failures += 1
        self.last_saved = self._committed
        self.goodput.failed_save(error.step, str(error))
        self.goodput.flush()
        row = f"{self.failures} failed save(s) in a row, checkpoint.max_failed_saves={self.max_failed}"
        if last_chance or self.failures >= self.max_failed:
            raise SaveFailed(f"{error} ({row})", error.step) from error
        if jax.process_index() == 0:
            print(f"warning: {error}; training goes on and saves again when the next save is due ({row})",
                  flush=True)

    def _collect(self, tier, wait: bool, last_chance: bool = False) -> None:
        """A tier's poll (or wait): log the saves committed, report one that failed."""
        try:
            self._report(tier.wait() if wait else tier.poll(), "local" if tier is self.local else "persistent")
        except SaveFailed as e:
            self._failed(e, last_chance)

    def poll(self) -> None:
        """Log saves that have committed; report one that failed (raising SaveFailed at the limit)."""
        for tier in self._tiers():
            self._collect(tier, wait=False)

    def wait(self) -> None:
        """Wait for the save in flight, the last one before the run ends: its failure raises SaveFailed."""
        for tier in self._tiers():
            self._collect(tier, wait=True, last_chance=True)
        if self._asked > self._committed:  # the newest save failed before it started, as reported then
            raise SaveFailed(f"the save of checkpoint {self.ckpts.step_dir(self._asked)} failed (see the warning "
                             f"above), and no later save comes; the newest complete checkpoint is step "
                             f"{self._committed}", self._asked)
