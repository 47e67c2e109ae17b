"""Saving during training: when (every_steps; every_minutes, agreed across processes; the final step;
preemption), what (the plain state tree with the RNG, and meta with every array's checksum), and what
it cost (blocked and save seconds into metrics.jsonl and goodput). A failed background save is raised
on the main thread at the next step."""
from __future__ import annotations

import json
import time
from typing import Any

import jax

import checkpoint
from checkpoint import format as ckpt_format
from checkpoint import plain
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
    config.setdefault("data", {})["order"] = trainer.plan.source.order
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
                 last_saved: int):
        self.ckpts, self.trainer = ckpts, trainer
        every = trainer.plan.checkpoint
        self.enabled = every.enabled  # False (checkpoint.enabled): the loop schedules no save (train/loop/builtin.py)
        self.policy = (checkpoint.SavePolicy(every.every_steps, every.every_minutes, every.mtbf_hours)
                       if self.enabled else checkpoint.SavePolicy())  # disabled: never due
        self._blocked: list[float] = []  # measured save costs, for the mtbf_hours interval
        self.run_info = describe_run(trainer)
        self.log, self.goodput = log, goodput
        self.last_saved = last_saved
        self._since = time.monotonic()
        self._prepared: tuple[int, Any, Any] | None = None  # (step, tree, checksums dispatched)

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

    def save(self, step: int, state: dict[str, Any], rng: jax.Array) -> None:
        """Save `step` (its state must be finite: the loop checked its metrics first), in logical layer
        order so that any pipeline layout can restore it."""
        if step == self.last_saved:
            return
        if self._prepared and self._prepared[0] == step:
            _, tree, checksums = self._prepared
        else:
            tree, checksums = ckpt_format.to_tree(self.trainer, state, rng), None
        self._prepared = None
        jax.block_until_ready(tree)  # waiting for the step itself is step time, not checkpoint time
        blocked = self.ckpts.save(step, tree, self.run_info, checksums=checksums)
        self.goodput.add("checkpoint_blocked_s", blocked)
        self._blocked.append(blocked)
        self.last_saved, self._since = step, time.monotonic()

    def _report(self, records: list[checkpoint.SaveRecord]) -> None:
        for r in records:
            self.log.write({"step": r.step, "checkpoint_blocked_s": round(r.blocked_s, 4),
                            "checkpoint_save_s": round(r.save_s, 4)})

    def poll(self) -> None:
        """Log saves that have committed; raise SaveFailed if a background save failed."""
        self._report(self.ckpts.poll())

    def wait(self) -> None:
        self._report(self.ckpts.wait())
