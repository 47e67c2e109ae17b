"""The loop body as a scheduler: dispatch step s, fetch step s-1's metrics, run the actions that are due
(train/loop/builtin.py defines them and their order). Metrics of step s are fetched after step s+1 is
dispatched, so logging never stalls the device."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from train.loop import builtin as loop_actions
from train.loop import preemption


@dataclasses.dataclass
class Services:
    """What the actions act through, built once per run by train/loop/runner.py."""
    trainer: Any
    compiled: Any  # the compiled train step
    path: Any
    log: Any
    saver: Any
    goodput: Any
    signals: preemption.StopSignals
    dog: Any
    rep: dict[str, Any]
    peak: float  # FLOP/s of all devices together, for MFU (0: unknown)


class Scheduler:
    """The loop's state, which the actions read and change: the train state, the dispatched and pending
    steps, the agreed stop/save decisions, the step clock and the profiler."""

    def __init__(self, services: Services, begin, user_actions: list):
        self.s, self.begin = services, begin
        self.plan = services.trainer.plan
        self.agree = preemption.Agreement()
        self.state = begin.state
        self.last: dict[str, Any] = {"loss": float("nan"), "eval_loss": None, "times": []}
        self.decided = {"stop": False, "time_save": False}
        self.t_prev = time.perf_counter()
        self.dispatched = None  # (step, metrics, flags) of the step just dispatched
        self.pending = None     # (step, metrics, flags) dispatched but not yet fetched
        self.metrics = None     # step s's metrics (device arrays), for user actions
        self.fetched_values: dict[str, float] = {}
        self.fetched_flags = None
        self.fetch_now = False  # a save was prepared at this step: read its metrics before deciding
        self.tracing = False
        self.before_dispatch = [loop_actions.ProfileStart(self)]
        self.metric_actions = loop_actions.metric_actions(self)
        self.step_actions = loop_actions.step_actions(self, user_actions)

    def run(self) -> tuple[Any, dict[str, Any]]:
        """Steps begin.step+1 .. train.steps; returns the final state and the last loss, eval loss and times."""
        for index in range(self.begin.step, self.plan.steps):
            step = index + 1  # the number of completed updates once this step is done
            loop_actions.run_due(self.before_dispatch, step)
            self.state, self.metrics = self.s.compiled(self.state, self.s.trainer.batch(index))
            flags = self.agree.post((self.s.signals.requested.is_set(), self.s.saver.time_due()))
            self.dispatched, self.fetch_now = (step, self.metrics, flags), False
            loop_actions.run_due(self.step_actions, step)
        self.finish_pending()
        t = self.plan.train
        if t.eval_batches and (not t.eval_every or self.plan.steps % t.eval_every):
            self.evaluate(self.plan.steps)
        return self.state, self.last

    def finish_pending(self) -> None:
        """Fetch the pending step's metrics and agreed flags and run the metric actions on them."""
        if self.pending is None:
            return
        step, metrics, self.fetched_flags = self.pending
        self.pending = None
        self.fetched_values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        loop_actions.run_due(self.metric_actions, step, self.fetched_values)

    def evaluate(self, step: int) -> None:
        """Evaluate, log, and count the time as goodput's eval_s (periodic and final evaluations alike)."""
        t0 = time.perf_counter()
        self.last["eval_loss"] = evaluate(self.s.trainer, self.state["params"])
        self.s.log.write({"step": step, "eval_loss": self.last["eval_loss"]})
        self.s.goodput.add("eval_s", time.perf_counter() - t0)


def evaluate(trainer, params) -> float:
    batches = trainer.plan.train.eval_batches
    losses = [trainer.eval_step(params, trainer.batch(k, split="eval")) for k in range(batches)]
    return float(np.mean(jax.device_get(losses)))
