"""The loop body as a scheduler, the one owner of the loop's state: dispatch step s, read step s-1's
metrics, run the actions that are due (train/loop/builtin.py defines them and their order) on a frozen
StepInfo, and apply the Update each returns. Metrics of step s are read after step s+1 is dispatched, so
logging never stalls the device."""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Sequence

import jax

from train.loop import builtin
from train.loop.info import Action, Decision, Services, StepInfo, Update
from train.loop.resume import Start
from train.state import State


@dataclasses.dataclass(frozen=True)
class Dispatched:
    """A dispatched step whose metrics (device arrays) and posted stop/save wishes wait to be read."""
    step: int
    metrics: dict[str, jax.Array]
    flags: tuple[bool, ...] | jax.Array


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What the run's summary needs once the loop ends."""
    state: State
    loss: float                  # the last step's (NaN when no step was read)
    eval_loss: float | None      # the last evaluation's (None: none ran)
    step_times: tuple[float, ...]


class Scheduler:
    """The loop's state: the train state, the steps dispatched but not read yet, the agreed stop/save
    decision, the step clock and the profiler; actions change it only through the Updates they return."""

    def __init__(self, services: Services, begin: Start, user_actions: Sequence[Action]):
        self.s, self.plan, self.first = services, services.plan, begin.step
        self.state: State = begin.state
        self.unread: list[Dispatched] = []  # oldest first
        self.latest: Dispatched | None = None
        self.read_through, self.values = begin.step, {}  # the newest step read, and its metrics
        self.decision = Decision()
        self.clock = time.perf_counter()  # when the current step's time started counting
        self.times: list[float] = []
        self.eval_loss: float | None = None
        self.tracing = self.save_prepared = False
        fault = builtin.fault_injection(services)  # one object: it poisons before dispatch, restores after
        self.before_dispatch = builtin.before_dispatch(services, fault)
        self.metric_actions = builtin.metric_actions(services)
        self.step_actions = builtin.step_actions(services, list(user_actions), fault)

    def run(self) -> Outcome:
        """Steps begin.step+1 .. train.steps, then the last metrics and the final evaluation."""
        for step in range(self.first + 1, self.plan.steps + 1):
            self.dispatch(step)
        self.read(self.plan.steps)
        t = self.plan.train
        if t.eval_batches and (not t.eval_every or self.plan.steps % t.eval_every):
            self.eval_loss = builtin.evaluate_logged(self.s, self.plan.steps, self.state["params"])
        return Outcome(self.state, self.values.get("loss", math.nan), self.eval_loss, tuple(self.times))

    def dispatch(self, step: int) -> None:
        self.run_due(self.before_dispatch, lambda: self.step_info(step, dispatched=False))
        # `step` is the number of completed updates once it is done; its batch is the one at index step-1.
        self.state, metrics = self.s.compiled(self.state, self.s.trainer.batch(step - 1))
        signals = self.s.signals  # a save is wished when one is due by time or SIGUSR1 asked for one
        save = self.s.saver.time_due() or signals.take_save_request()
        flags = self.s.agreement.post((signals.requested.is_set(), save))
        self.latest = Dispatched(step, metrics, flags)
        self.unread.append(self.latest)
        self.save_prepared = False
        self.run_due(self.step_actions, lambda: self.step_info(step, dispatched=True))

    def read(self, through: int) -> None:
        """Read the metrics of every dispatched step up to `through`, oldest first, through the metric actions."""
        while self.unread and self.unread[0].step <= through:
            done = self.unread.pop(0)
            self.values = {k: float(v) for k, v in jax.device_get(done.metrics).items()}
            self.read_through = done.step
            self.run_due(self.metric_actions, lambda done=done: self.read_info(done))

    def run_due(self, actions: list[builtin.Action], info_now: Callable[[], StepInfo]) -> None:
        """Each action sees the loop as the actions before it left it."""
        for action in actions:
            info = info_now()
            if action.due(info):
                self.apply(info.step, action.run(info))

    def step_info(self, step: int, dispatched: bool) -> StepInfo:
        metrics = self.latest.metrics if dispatched and self.latest else {}
        return StepInfo(step, self.state, metrics, self.values if self.read_through == step else {},
                        self.read_through, self.decision, self.save_prepared, self.tracing, dispatched)

    def read_info(self, done: Dispatched) -> StepInfo:
        return StepInfo(done.step, self.state, done.metrics, self.values, self.read_through, self.decision,
                        self.save_prepared, self.tracing, flags=done.flags,
                        since_clock_s=time.perf_counter() - self.clock,
                        recent_step_times=tuple(self.times[-self.plan.train.log_every:]))

    def apply(self, step: int, update: Update | None) -> None:
        """Make the change an action returned; reading metrics runs the metric actions in turn."""
        if update is None:
            return
        for record in update.records:
            self.s.log.write({"step": step, **record})
        self.state = self.state if update.state is None else update.state
        self.decision = self.decision if update.decision is None else update.decision
        if update.step_time_s is not None:  # the next step's time starts where this one's ended
            self.times.append(update.step_time_s)
            self.clock += update.step_time_s
        if update.restart_clock:
            self.clock = time.perf_counter()
        self.save_prepared |= update.save_prepared
        self.tracing = self.tracing if update.tracing is None else update.tracing
        self.eval_loss = self.eval_loss if update.eval_loss is None else update.eval_loss
        if update.read_through:
            self.read(update.read_through)
