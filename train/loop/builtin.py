"""The loop's built-in actions and the one place that orders them (`before_dispatch`, `metric_actions`,
`step_actions`). Each sees a frozen StepInfo and returns the Update it asks of the scheduler
(train/loop/scheduler.py, the one owner of the loop's state); they act on the world only through the run's
services. Every process runs them; only process 0 writes files (MetricsLog, the saver and goodput check it)."""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from train import exit_codes
from train.loop import faults
from train.loop.info import Action as ActionProtocol
from train.loop.info import Decision, Services, StepInfo, Update
from train.runtime import hardware
from train.trainer import Trainer


def say(text: str) -> None:
    if jax.process_index() == 0:
        print(text, flush=True)


def host_step_times(seconds: float) -> list[float]:
    """Each process's mean step time, so a straggling host shows in metrics.jsonl."""
    return [float(t) for t in multihost_utils.process_allgather(np.float32(seconds))]


class Action:
    """A built-in action acting through the run's services; due at every step unless it says otherwise."""

    def __init__(self, s: Services):
        self.s = s

    def due(self, info: StepInfo) -> bool:
        return True

    def run(self, info: StepInfo) -> Update | None:
        raise NotImplementedError


# ---------------------------------------------------------------- metric actions: step s's metrics read

class StepClock(Action):
    """Step time (for the progress line and the summary) and goodput's productive time."""

    def run(self, info: StepInfo) -> Update:
        self.s.goodput.step(info.step, info.since_clock_s)
        return Update(step_time_s=info.since_clock_s)


class WatchdogKick(Action):
    def run(self, info: StepInfo) -> None:
        self.s.dog.kick(f"step {info.step}")


class StopSaveAgreement(Action):
    """Every process's stop request and save wish (time-based or SIGUSR1), OR-ed across processes when step s
    is read. A single process has no one to agree with, so a stop asked while step s ran counts at once: only
    the step already queued behind it runs before the save (the flags posted at dispatch would add one more)."""

    def run(self, info: StepInfo) -> Update:
        stop, time_save = self.s.agreement.read(info.flags)
        if not self.s.agreement.collective:
            stop = stop or self.s.signals.requested.is_set()
        return Update(decision=Decision(info.decision.stop or stop, info.decision.time_save or time_save))


class NonFiniteGuard(Action):
    def due(self, info: StepInfo) -> bool:
        return not (math.isfinite(info.values["loss"]) and math.isfinite(info.values["grad_norm"]))

    def run(self, info: StepInfo) -> None:
        non_finite(self.s.plan.train.on_nonfinite, info.step, info.values, self.s.saver.last_saved)


class MetricsLogging(Action):
    """metrics.jsonl, the loggers of train.loggers and the progress line, every train.log_every steps."""

    def due(self, info: StepInfo) -> bool:
        return info.step % self.s.plan.train.log_every == 0 or info.step == self.s.plan.steps

    def run(self, info: StepInfo) -> None:
        s, plan, step = self.s, self.s.plan, info.step
        recent = float(np.mean(info.recent_step_times))
        tps = s.rep["tokens_per_step"] / recent
        mfu = hardware.mfu(s.rep["flops_per_step"], recent, s.peak, s.peak_measured)
        record = {"step": step, **info.values, "step_time_s": recent, "tokens_per_s": tps, "mfu": mfu,
                  **s.trainer.tokens.progress(step, plan.global_batch, plan.model.seq_len + 1)}
        if jax.process_count() > 1:  # every process logs at the same steps, so this gather cannot hang
            record["host_step_time_s"] = host_step_times(recent)
        s.log.write(record)
        s.log.progress(step, info.values["loss"], tps, mfu, recent * (plan.steps - step))
        s.goodput.flush()


# ---------------------------------------------------------------- step actions: step s dispatched

class FaultInjection(Action):
    """Test-only faults (fault_injection.*), in the lists only when one is set. Before step k is dispatched
    its parameters become NaN (train/loop/faults.py); once it is dispatched, a delay or a hang while it
    runs, and under train.on_nonfinite=skip the clean parameters, held here from the poisoning, return."""

    def __init__(self, s: Services):
        super().__init__(s)
        self._clean = None  # this action's own: the parameters step k's poisoning replaced

    def due(self, info: StepInfo) -> bool:
        return info.dispatched or info.step == self.s.plan.faults.nan_at_step

    def run(self, info: StepInfo) -> Update | None:
        fi = self.s.plan.faults
        if not info.dispatched:
            self._clean = info.state["params"] if self.s.plan.train.on_nonfinite == "skip" else None
            return Update(state=faults.poisoned(info.state))
        if fi.step_delay_s:
            time.sleep(fi.step_delay_s)
        if fi.hang_at_step == info.step:
            time.sleep(fi.hang_s)
        if self._clean is None or info.step != fi.nan_at_step:
            return None
        clean, self._clean = self._clean, None
        return Update(state=faults.restored(info.state, clean))


class FetchPending(Action):
    """Step s-1's metrics, read now that step s is dispatched, through the metric actions."""

    def run(self, info: StepInfo) -> Update:
        return Update(read_through=info.step - 1)


class SavePoll(Action):
    """A background save that failed is raised here, on the main thread; committed saves are logged."""

    def run(self, info: StepInfo) -> None:
        self.s.saver.poll()


class ProfileStart(Action):
    """Opens the trace at train.profile_steps' first step (also when resumed mid-range), before dispatch."""

    def due(self, info: StepInfo) -> bool:
        window = self.s.plan.profile_steps
        return bool(window) and window[0] <= info.step <= window[1] and not info.tracing

    def run(self, info: StepInfo) -> Update:
        jax.profiler.start_trace(str(self.s.path / "profile"))
        return Update(tracing=True)


class ProfileStop(Action):
    def due(self, info: StepInfo) -> bool:
        return info.tracing and info.step == self.s.plan.profile_steps[1]

    def run(self, info: StepInfo) -> Update:
        jax.block_until_ready(info.state)
        jax.profiler.stop_trace()
        return Update(tracing=False)


class CheckpointSave(Action):
    """Step-based, time-based or SIGUSR1 (agreed), preemption and final saves of a state whose metrics were read;
    a step-based local-tier save when no persistent one is due."""

    def due(self, info: StepInfo) -> bool:
        d = info.decision
        return self.s.saver.step_due(info.step) or d.time_save or d.stop or info.step == self.s.plan.steps

    def run(self, info: StepInfo) -> Update:
        d = info.decision  # preemption and the final step save persistently: the node may go with its local tier
        persistent = self.s.saver.policy.step_due(info.step) or d.time_save or d.stop or info.step == self.s.plan.steps
        self.s.saver.save(info.step, info.state, self.s.rng, persistent=persistent)
        self.s.dog.kick(f"checkpoint at step {info.step}")
        # The save wish is served; blocked save time is accounted separately, not as step time.
        return Update(decision=dataclasses.replace(info.decision, time_save=False), restart_clock=True)


class SavePrepare(CheckpointSave):
    """First save decision: dispatch the checksums while step s still runs."""

    def run(self, info: StepInfo) -> Update:
        self.s.saver.prepare(info.step, info.state, self.s.rng)
        return Update(save_prepared=True)


class Evaluation(Action):
    def due(self, info: StepInfo) -> bool:
        t = self.s.plan.train
        return bool(t.eval_every and info.step % t.eval_every == 0 and t.eval_batches)

    def run(self, info: StepInfo) -> Update:
        loss = evaluate_logged(self.s, info.step, info.state["params"])
        self.s.dog.kick(f"eval at step {info.step}")
        return Update(eval_loss=loss, restart_clock=True)  # evaluation time is not step time


class FetchNow(Action):
    """Before an evaluation or a save, step s's metrics are read at once: its agreed flags join the save
    decision and a non-finite state stops the run before it is evaluated or saved."""

    def __init__(self, s: Services, evaluation: Evaluation):
        super().__init__(s)
        self.evaluation = evaluation

    def due(self, info: StepInfo) -> bool:
        return info.read_through < info.step and (info.save_prepared or self.evaluation.due(info))

    def run(self, info: StepInfo) -> Update:
        return Update(read_through=info.step)


class UserActions(Action):
    """The actions of train.actions (train/loop/actions.py), each at its own cadence, in the order listed;
    each sees the state the one before it left. Their records and state are taken, nothing else."""

    def __init__(self, s: Services, actions: list[ActionProtocol]):
        super().__init__(s)
        self.actions = actions

    def run(self, info: StepInfo) -> Update | None:
        records, state = [], info.state
        for action in self.actions:
            seen = info if state is info.state else dataclasses.replace(info, state=state)
            update = action.run(seen) if action.due(seen) else None
            if update is not None:
                records += update.records
                state = update.state if update.state is not None else state
        if not records and state is info.state:
            return None
        return Update(records=tuple(records), state=None if state is info.state else state)


class PreemptionStop(Action):
    """The agreed stop: the checkpoint of step s was saved just before; exit 75 (at the last step the run
    is done anyway)."""

    def due(self, info: StepInfo) -> bool:
        return info.decision.stop and info.step < self.s.plan.steps

    def run(self, info: StepInfo) -> None:
        saver = self.s.saver
        if info.tracing:  # keep the part of the trace that was taken
            jax.profiler.stop_trace()
        saver.wait()
        if not saver.enabled:
            raise exit_codes.Stop(exit_codes.REQUEUE, f"preempted at step {info.step}; checkpoint.enabled=False, "
                                                      f"so nothing was saved (exit status 75)")
        raise exit_codes.Stop(exit_codes.REQUEUE, f"preempted: saved checkpoint {saver.ckpts.step_dir(info.step)}; "
                                                  f"run the same command again to resume (exit status 75)")


# ---------------------------------------------------------------- the order (the contract)

def fault_injection(s: Services) -> FaultInjection | None:
    """The one FaultInjection of a run whose config sets a fault (it acts before and after dispatch)."""
    return FaultInjection(s) if s.plan.faults.in_loop else None


def before_dispatch(s: Services, fault: FaultInjection | None = None) -> list[Action]:
    """Run before step s is dispatched: the profiling window opens; nan_at_step poisons step k's state."""
    poisons = fault is not None and bool(s.plan.faults.nan_at_step)
    return [ProfileStart(s), *([fault] if poisons else [])]


def metric_actions(s: Services) -> list[Action]:
    """Run, in this order, when step s's metrics are read (after step s+1 is dispatched, or at once
    before an evaluation or a save): the clock must see the read time; the agreement is read before the
    guard and before any save decision that follows; a non-finite step stops before it is logged."""
    return [StepClock(s), WatchdogKick(s), StopSaveAgreement(s), NonFiniteGuard(s), MetricsLogging(s)]


def step_actions(s: Services, user_actions: list[ActionProtocol],
                 fault: FaultInjection | None = None) -> list[Action]:
    """Run, in this order, after step s is dispatched (`before_dispatch` runs before it):
      1. fault injection (tests only), while step s runs;
      2. step s-1's metrics through `metric_actions`;
      3. a failed background save is raised; the profiling window closes at its last step;
      4. the first save decision prepares the checksums; when a save or an evaluation is due, step s's
         metrics are read at once (FetchNow), so its agreed stop/save flags are read BEFORE the final
         save decision and a non-finite state is never evaluated or saved;
      5. evaluation, then the checkpoint save (decided again: step s's agreed flags may ask for it);
      6. user actions (train.actions), then the preemption stop.
    """
    fault = fault or fault_injection(s)
    evaluation = Evaluation(s)
    saves = s.plan.checkpoint.enabled  # checkpoint.enabled=False: no save is ever decided
    return [*([fault] if fault else []), FetchPending(s), SavePoll(s), ProfileStop(s),
            *([SavePrepare(s)] if saves else []), FetchNow(s, evaluation), evaluation,
            *([CheckpointSave(s)] if saves else []), UserActions(s, user_actions), PreemptionStop(s)]


def evaluate(trainer: Trainer, params: Any) -> float:
    batches = trainer.plan.train.eval_batches
    losses = [trainer.eval_step(params, trainer.batch(k, split="eval")) for k in range(batches)]
    return float(np.mean(jax.device_get(losses)))


def evaluate_logged(s: Services, step: int, params: Any) -> float:
    """Evaluate, log, and count the time as goodput's eval_s (periodic and final evaluations alike)."""
    t0 = time.perf_counter()
    loss = evaluate(s.trainer, params)
    s.log.write({"step": step, "eval_loss": loss})
    s.log.evaluated(step, loss)
    s.goodput.add("eval_s", time.perf_counter() - t0)
    return loss


def non_finite(policy: str, step: int, values: Mapping[str, float], last_saved: int) -> None:
    what = f"loss {values['loss']} and gradient norm {values['grad_norm']} at step {step}"
    if policy == "skip":
        say(f"warning: {what}: update skipped (train.on_nonfinite=skip)")
        return
    newest = f"the newest checkpoint is step {last_saved}" if last_saved > 0 else "no checkpoint was saved"
    raise exit_codes.Stop(exit_codes.NON_FINITE,
                          f"{what}: not finite; stopped without saving it ({newest}). Lower optimizer.lr or "
                          f"optimizer.clip_norm, or set train.on_nonfinite=skip to skip such updates")
