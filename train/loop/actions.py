"""User actions: periodic work an experiment adds to the training loop, beside the built-in actions
(evaluation, saves, profiling, logging, watchdog, stop/save agreement, goodput) of train/loop/builtin.py,
whose `step_actions` documents the order they all run in (user actions run after the save of step s and
before the preemption stop). Actions run on every process; only process 0 writes files.

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


def build(listed: tuple[str, ...], config: Any) -> list[UserAction]:
    """The actions `listed` (Plan.train.actions), each from its factory; `config` is handed to the factories
    untouched: an experiment's own action may read its own settings there, train/ reads none of it."""
    return [REGISTRY[name](config) for name in listed]
