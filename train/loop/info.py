"""What every loop action, built-in or user, sees and returns: a frozen record of the step (`StepInfo`),
the change it asks the scheduler to make (`Update`), and the services the built-in actions act through."""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Mapping, Protocol

import jax

from train.config.experiment import Plan
from train.loop.goodput import Goodput
from train.loop.metrics import MetricsLog
from train.loop.preemption import Agreement, StopSignals
from train.loop.saver import Saver
from train.loop.watchdog import Watchdog
from train.state import State
from train.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class Decision:
    """The stop/save decision, agreed across processes (train/loop/preemption.Agreement)."""
    stop: bool = False       # save this step, then exit 75
    time_save: bool = False  # a time-based save is due, or one SIGUSR1 asked for


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """The loop as an action sees it, built afresh for every call. For the step actions `step` is the step
    just dispatched; for the metric actions it is the step whose metrics were just read (`state` is then
    the newest state, that of the step dispatched after it)."""
    step: int                                # updates completed once this step is done
    state: State                             # the train state after `step` (device arrays, maybe in flight)
    metrics: Mapping[str, jax.Array]         # this step's metrics as device arrays (reading one waits)
    values: Mapping[str, float]              # this step's metrics on the host; empty until they are read
    read_through: int                        # every step up to this one has had its metrics read
    decision: Decision
    save_prepared: bool = False              # a save of this step was prepared (its metrics are read first)
    tracing: bool = False                    # the profiler is recording
    dispatched: bool = True                  # False before `step` is dispatched: `state` is its input
    flags: tuple[bool, ...] | jax.Array | None = None  # the read step's posted stop/save wishes (Agreement.post)
    since_clock_s: float = 0.0               # seconds since the step clock started, when the metrics were read
    recent_step_times: tuple[float, ...] = ()  # the last train.log_every step times, newest last


@dataclasses.dataclass(frozen=True)
class Update:
    """What an action changes; the scheduler applies it before the next action runs. Users return
    `Update.log(record)` or `Update(state=...)`; the other fields are the built-in actions'."""
    records: tuple[Mapping[str, float], ...] = ()  # logged to metrics.jsonl (and the loggers) at this step
    state: State | None = None         # replaces the train state the next step starts from
    read_through: int = 0              # read the metrics of every dispatched step up to this one now
    decision: Decision | None = None   # replaces the stop/save decision
    step_time_s: float | None = None   # a step's time was measured: the step clock restarts at its end
    restart_clock: bool = False        # blocking work (evaluation, a save) is not step time
    save_prepared: bool = False
    tracing: bool | None = None
    eval_loss: float | None = None

    @classmethod
    def log(cls, record: Mapping[str, float]) -> "Update":
        return cls(records=(record,))


class Action(Protocol):
    """One signature for every action: `due(info)`, then `run(info) -> Update | None`."""

    def due(self, info: StepInfo) -> bool: ...

    def run(self, info: StepInfo) -> Update | None: ...


@dataclasses.dataclass(frozen=True)
class Services:
    """What the built-in actions act through, built once per run by train/loop/runner.py."""
    trainer: Trainer
    compiled: jax.stages.Compiled  # the compiled train step
    path: pathlib.Path
    log: MetricsLog
    saver: Saver
    goodput: Goodput
    signals: StopSignals
    agreement: Agreement
    dog: Watchdog
    rng: jax.Array                 # the run's key, saved with every checkpoint
    rep: dict[str, Any]            # the compile report (JSON)
    peak: float                    # FLOP/s of all devices together, for MFU (0: unknown)
    peak_measured: bool = False    # the peak is the measured CPU one, checked against the run's rate (hardware.mfu)

    @property
    def plan(self) -> Plan:
        return self.trainer.plan
