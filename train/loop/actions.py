"""User actions: periodic work an experiment adds to the training loop, beside the built-in actions
(evaluation, saves, profiling, logging, watchdog, stop/save agreement, goodput) of train/loop/builtin.py,
whose `step_actions` documents the order they all run in (user actions run after the save of step s and
before the preemption stop). Actions run on every process; only process 0 writes files.

A user action comes from an experiment file: `actions.register("name", factory)` where `factory(config)`
returns an object with the one signature every loop action has, built-in or not:
    due(info: StepInfo) -> bool
    run(info: StepInfo) -> Update | None
`info` is a frozen record of step `info.step`: `state` (the train state after it), `metrics` (its metrics
as device arrays), the agreed stop/save `decision`, and more (train/loop/info.py). `Update.log(record)`
logs `record` as a metrics record at that step; `Update(state=...)` replaces the state the next step
starts from. `Every(n, fn)` runs `fn(info) -> dict | None` every n steps, logging the dict it returns.
List the names in `train.actions = "name"`.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from train.config.experiment import ConfigError
from train.loop import metrics
from train.loop.info import Action, StepInfo, Update

__all__ = ["Action", "Every", "REGISTRY", "StepInfo", "Update", "build", "check_names", "names", "register"]

REGISTRY: dict[str, Callable[[Any], Action]] = {}


def register(name: str, factory: Callable[[Any], Action]) -> None:
    """Make `name` usable in `train.actions`; `factory(config)` builds the action once per run."""
    REGISTRY[name] = factory


def names(text: str) -> tuple[str, ...]:
    """'a, b' -> ('a', 'b'): the comma-separated list of a train.actions or train.loggers setting."""
    return tuple(n.strip() for n in str(text or "").split(",") if n.strip())


def check_names(t: Any) -> None:
    """Every name in train.loggers and train.actions is registered (the registries fill as experiment files
    import): checked by the loop before it touches the workdir, as train.config checks the other settings."""
    for name in names(t.loggers):
        if name not in metrics.LOGGERS:
            raise ConfigError(f"train.loggers={t.loggers!r}: unknown logger {name!r}; use {', '.join(metrics.LOGGERS)}")
    for name in names(t.actions):
        if name not in REGISTRY:
            known = ", ".join(sorted(REGISTRY)) or "none registered"
            raise ConfigError(f"train.actions={t.actions!r}: unknown action {name!r} ({known}); register it with "
                              f"train.loop.actions.register(name, factory) in the experiment file")


class Every:
    """A user action that calls `fn(info)` every `steps` steps and logs the record it returns, if any."""

    def __init__(self, steps: int, fn: Callable[[StepInfo], Mapping[str, float] | None]):
        self.steps, self.fn = steps, fn

    def due(self, info: StepInfo) -> bool:
        return info.step % self.steps == 0

    def run(self, info: StepInfo) -> Update | None:
        record = self.fn(info)
        return Update.log(record) if record else None


def build(listed: tuple[str, ...], config: Any) -> list[Action]:
    """The actions `listed` (Plan.train.actions), each from its factory; `config` is handed to the factories
    untouched: an experiment's own action may read its own settings there, train/ reads none of it."""
    return [REGISTRY[name](config) for name in listed]
