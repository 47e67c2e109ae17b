"""The training loop's periodic actions: each says whether it is due at step s and runs at step s.

The loop (train/loop.py) dispatches step s, then runs, in this order (the order is the contract):
  1. fault injection (tests only: fault_injection.*), while step s runs;
  2. the metrics of step s-1 are fetched and go through the METRIC actions: step clock and goodput,
     watchdog kick, the cross-process stop/save agreement, the non-finite guard, then logging
     (metrics.jsonl, TensorBoard, W&B) every train.log_every steps;
  3. a failed background save is raised; the profiling window closes at its last step;
  4. the save decision (step-based, time-based or preemption, as agreed so far); when a save or an eval
     is due, step s's metrics are fetched at once, so the agreement is read BEFORE the final save
     decision and a non-finite state is never evaluated or saved;
  5. evaluation, then the checkpoint save (decided again: step s's agreed flags may have asked for it);
  6. user actions (`train.actions`), then the preemption stop.
Actions run on every process; only process 0 writes files (MetricsLog and the loggers check it).

A user action comes from an experiment file: `actions.register("name", factory)` where
`factory(config)` returns an object with `due(step) -> bool` and `run(step, state, metrics) -> dict | None`
(a returned dict is logged as a metrics record at that step); list it in `train.actions = "name"`.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

REGISTRY: dict[str, Callable[[Any], "UserAction"]] = {}


class UserAction(Protocol):
    def due(self, step: int) -> bool: ...

    def run(self, step: int, state: Any, metrics: dict[str, Any]) -> dict[str, float] | None: ...


def register(name: str, factory: Callable[[Any], UserAction]) -> None:
    """Make `name` usable in `train.actions`; `factory(config)` builds the action once per run."""
    REGISTRY[name] = factory


def names(text: str) -> tuple[str, ...]:
    """'a, b' -> ('a', 'b'): the comma-separated list of a train.actions or train.loggers setting."""
    return tuple(n.strip() for n in str(text or "").split(",") if n.strip())


class Every:
    """A user action that calls `fn(step, state, metrics)` every `steps` steps."""

    def __init__(self, steps: int, fn: Callable[[int, Any, dict[str, Any]], dict[str, float] | None]):
        self.steps, self.fn = steps, fn

    def due(self, step: int) -> bool:
        return step % self.steps == 0

    def run(self, step: int, state: Any, metrics: dict[str, Any]) -> dict[str, float] | None:
        return self.fn(step, state, metrics)


def build(config: Any) -> list[UserAction]:
    return [REGISTRY[name](config) for name in names(config.train.actions)]
