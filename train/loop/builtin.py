"""The loop's built-in periodic actions, each an object with `due(step)` and `run(step, ...)`, and the one
place that orders them (`metric_actions`, `step_actions`). They act on the loop (train/loop/scheduler.py: the
state, the pending step, the agreed flags) through the services it holds; every process runs them, and
only process 0 writes files (MetricsLog, the saver and goodput check it)."""
from __future__ import annotations

import math
import time
from typing import Any

import jax
import numpy as np

from train.loop import exit_codes


def say(text: str) -> None:
    if jax.process_index() == 0:
        print(text, flush=True)


def host_step_times(seconds: float) -> list[float]:
    """Each process's mean step time, so a straggling host shows in metrics.jsonl."""
    from jax.experimental import multihost_utils
    return [float(t) for t in multihost_utils.process_allgather(np.float32(seconds))]


class Action:
    """A built-in action bound to the loop; due at every step unless it says otherwise."""

    def __init__(self, loop: Any):
        self.loop = loop

    def due(self, step: int) -> bool:
        return True


# ---------------------------------------------------------------- metric actions: step s's metrics fetched

class StepClock(Action):
    """Step time (for the progress line and the summary) and goodput's productive time."""

    def run(self, step: int, values: dict[str, float]) -> None:
        loop, now = self.loop, time.perf_counter()
        loop.last["times"].append(now - loop.t_prev)
        loop.s.goodput.step(step, now - loop.t_prev)
        loop.t_prev = now
        loop.last["loss"] = values["loss"]


class WatchdogKick(Action):
    def run(self, step: int, values: dict[str, float]) -> None:
        self.loop.s.dog.kick(f"step {step}")


class StopSaveAgreement(Action):
    """Every process's stop request and time-based save wish, OR-ed across processes when step s is read."""

    def run(self, step: int, values: dict[str, float]) -> None:
        stop, time_save = self.loop.agree.read(self.loop.fetched_flags)
        self.loop.decided["stop"] |= stop
        self.loop.decided["time_save"] |= time_save


class NonFiniteGuard(Action):
    def due(self, step: int) -> bool:
        values = self.loop.fetched_values
        return not (math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"]))

    def run(self, step: int, values: dict[str, float]) -> None:
        non_finite(self.loop.plan.train.on_nonfinite, step, values, self.loop.s.saver.last_saved)


class MetricsLogging(Action):
    """metrics.jsonl, the loggers of train.loggers and the progress line, every train.log_every steps."""

    def due(self, step: int) -> bool:
        return step % self.loop.plan.train.log_every == 0 or step == self.loop.plan.steps

    def run(self, step: int, values: dict[str, float]) -> None:
        loop, every, rep = self.loop, self.loop.plan.train.log_every, self.loop.s.rep
        recent = float(np.mean(loop.last["times"][-every:]))
        tps = rep["tokens_per_step"] / recent
        mfu = rep["flops_per_step"] / recent / loop.s.peak if loop.s.peak else 0.0
        record = {"step": step, **values, "step_time_s": recent, "tokens_per_s": tps, "mfu": mfu,
                  **loop.s.trainer.source.progress(step, loop.plan.global_batch, loop.plan.model.seq_len + 1)}
        if jax.process_count() > 1:  # every process logs at the same steps, so this gather cannot hang
            record["host_step_time_s"] = host_step_times(recent)
        loop.s.log.write(record)
        loop.s.log.progress(step, values["loss"], tps, mfu, recent * (loop.plan.steps - step))
        loop.s.goodput.flush()


# ---------------------------------------------------------------- step actions: step s dispatched

class FaultInjection(Action):
    """Test-only faults (fault_injection.*) while step s runs; in the list only when one is set."""

    def run(self, step: int) -> None:
        fi = self.loop.plan.faults
        if fi.step_delay_s:
            time.sleep(fi.step_delay_s)
        if fi.hang_at_step == step:
            time.sleep(fi.hang_s)


class FetchPending(Action):
    """Step s-1's metrics, fetched now that step s is dispatched, through the metric actions; step s
    becomes the pending one."""

    def run(self, step: int) -> None:
        self.loop.finish_pending()
        self.loop.pending = self.loop.dispatched


class SavePoll(Action):
    """A background save that failed is raised here, on the main thread; committed saves are logged."""

    def run(self, step: int) -> None:
        self.loop.s.saver.poll()


class ProfileStart(Action):
    """Opens the trace at train.profile_steps' first step (also when resumed mid-range), before dispatch."""

    def due(self, step: int) -> bool:
        window = self.loop.plan.profile_steps
        return bool(window) and window[0] <= step <= window[1] and not self.loop.tracing

    def run(self, step: int) -> None:
        jax.profiler.start_trace(str(self.loop.s.path / "profile"))
        self.loop.tracing = True


class ProfileStop(Action):
    def due(self, step: int) -> bool:
        return self.loop.tracing and step == self.loop.plan.profile_steps[1]

    def run(self, step: int) -> None:
        jax.block_until_ready(self.loop.state)
        jax.profiler.stop_trace()
        self.loop.tracing = False


class CheckpointSave(Action):
    """Step-based, time-based (agreed), preemption and final saves of a state whose metrics were read."""

    def due(self, step: int) -> bool:
        d, saver = self.loop.decided, self.loop.s.saver
        return saver.policy.step_due(step) or d["time_save"] or d["stop"] or step == self.loop.plan.steps

    def run(self, step: int) -> None:
        loop = self.loop
        loop.s.saver.save(step, loop.state, loop.begin.rng)
        loop.decided["time_save"] = False
        loop.s.dog.kick(f"checkpoint at step {step}")
        loop.t_prev = time.perf_counter()  # blocked save time is accounted separately


class SavePrepare(CheckpointSave):
    """First save decision: dispatch the checksums while step s still runs."""

    def run(self, step: int) -> None:
        self.loop.s.saver.prepare(step, self.loop.state, self.loop.begin.rng)
        self.loop.fetch_now = True


class Evaluation(Action):
    def due(self, step: int) -> bool:
        t = self.loop.plan.train
        return bool(t.eval_every and step % t.eval_every == 0 and t.eval_batches)

    def run(self, step: int) -> None:
        loop = self.loop
        loop.evaluate(step)
        loop.s.dog.kick(f"eval at step {step}")
        loop.t_prev = time.perf_counter()  # evaluation time is not step time


class FetchNow(Action):
    """Before an evaluation or a save, step s's metrics are read at once: its agreed flags join the save
    decision and a non-finite state stops the run before it is evaluated or saved."""

    def __init__(self, loop: Any, evaluation: Evaluation):
        super().__init__(loop)
        self.evaluation = evaluation

    def due(self, step: int) -> bool:
        return loop_pending(self.loop, step) and (self.loop.fetch_now or self.evaluation.due(step))

    def run(self, step: int) -> None:
        self.loop.finish_pending()


def loop_pending(loop: Any, step: int) -> bool:
    return loop.pending is not None and loop.pending[0] == step


class UserActions(Action):
    """The actions of train.actions (train/loop/actions.py), each at its own cadence."""

    def __init__(self, loop: Any, actions: list):
        super().__init__(loop)
        self.actions = actions

    def run(self, step: int) -> None:
        for action in self.actions:
            if action.due(step):
                record = action.run(step, self.loop.state, self.loop.metrics)
                if record:
                    self.loop.s.log.write({"step": step, **record})


class PreemptionStop(Action):
    """The agreed stop: the checkpoint of step s was saved just before; exit 75 (at the last step the run
    is done anyway)."""

    def due(self, step: int) -> bool:
        return self.loop.decided["stop"] and step < self.loop.plan.steps

    def run(self, step: int) -> None:
        loop = self.loop
        if loop.tracing:  # keep the part of the trace that was taken
            jax.profiler.stop_trace()
        loop.s.saver.wait()
        if not loop.s.saver.enabled:
            raise exit_codes.Stop(exit_codes.REQUEUE, f"preempted at step {step}; checkpoint.enabled=False, so "
                                                      f"nothing was saved (exit status 75)")
        raise exit_codes.Stop(exit_codes.REQUEUE, f"preempted: saved checkpoint {loop.s.saver.ckpts.step_dir(step)}; "
                                                  f"run the same command again to resume (exit status 75)")


# ---------------------------------------------------------------- the order (the contract)

def metric_actions(loop: Any) -> list[Action]:
    """Run, in this order, when step s's metrics are fetched (after step s+1 is dispatched, or at once
    before an evaluation or a save): the clock must see the fetch time; the agreement is read before the
    guard and before any save decision that follows; a non-finite step stops before it is logged."""
    return [StepClock(loop), WatchdogKick(loop), StopSaveAgreement(loop), NonFiniteGuard(loop), MetricsLogging(loop)]


def step_actions(loop: Any, user_actions: list) -> list[Action]:
    """Run, in this order, after step s is dispatched (ProfileStart runs before the dispatch):
      1. fault injection (tests only), while step s runs;
      2. step s-1's metrics through `metric_actions`;
      3. a failed background save is raised; the profiling window closes at its last step;
      4. the first save decision prepares the checksums; when a save or an evaluation is due, step s's
         metrics are fetched at once (FetchNow), so its agreed stop/save flags are read BEFORE the final
         save decision and a non-finite state is never evaluated or saved;
      5. evaluation, then the checkpoint save (decided again: step s's agreed flags may ask for it);
      6. user actions (train.actions), then the preemption stop.
    """
    evaluation = Evaluation(loop)
    faults = [FaultInjection(loop)] if loop.plan.faults.in_loop else []
    saves = loop.plan.checkpoint.enabled  # checkpoint.enabled=False: no save is ever decided
    return [*faults, FetchPending(loop), SavePoll(loop), ProfileStop(loop), *([SavePrepare(loop)] if saves else []),
            FetchNow(loop, evaluation), evaluation, *([CheckpointSave(loop)] if saves else []),
            UserActions(loop, user_actions), PreemptionStop(loop)]


def run_due(actions: list[Action], step: int, *args: Any) -> None:
    for action in actions:
        if action.due(step):
            action.run(step, *args)


def non_finite(policy: str, step: int, values: dict[str, float], last_saved: int) -> None:
    what = f"loss {values['loss']} and gradient norm {values['grad_norm']} at step {step}"
    if policy == "skip":
        say(f"warning: {what}: update skipped (train.on_nonfinite=skip)")
        return
    newest = f"the newest checkpoint is step {last_saved}" if last_saved > 0 else "no checkpoint was saved"
    raise exit_codes.Stop(exit_codes.NON_FINITE,
                          f"{what}: not finite; stopped without saving it ({newest}). Lower optimizer.lr or "
                          f"optimizer.clip_norm, or set train.on_nonfinite=skip to skip such updates")
