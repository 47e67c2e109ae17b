"""The loop body as a scheduler: dispatch step s, fetch step s-1's metrics, run the actions that are due
(their order is documented in train/actions.py). Metrics of step s are fetched after step s+1 is
dispatched, so logging never stalls the device."""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import numpy as np

from train import actions as actions_lib, exit_codes, preemption


def host_step_times(seconds: float) -> list[float]:
    """Each process's mean step time, so a straggling host shows in metrics.jsonl."""
    from jax.experimental import multihost_utils
    return [float(t) for t in multihost_utils.process_allgather(np.float32(seconds))]


def say(text: str) -> None:
    if jax.process_index() == 0:
        print(text, flush=True)


@dataclasses.dataclass
class Services:
    """What the actions act through, built once per run by train/loop.py."""
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
    def __init__(self, services: Services, begin, user_actions: list):
        self.s, self.begin = services, begin
        self.config, self.plan = services.trainer.config, services.trainer.plan
        self.user_actions = user_actions
        self.agree = preemption.Agreement()
        self.state = begin.state
        self.last: dict[str, Any] = {"loss": float("nan"), "eval_loss": None, "times": []}
        self.decided = {"stop": False, "time_save": False}
        self.t_prev = time.perf_counter()
        self.pending = None   # (step, metrics, flags) dispatched but not yet fetched
        self.metrics = None   # step s's metrics (device arrays), for user actions
        self.tracing = False

    def run(self) -> tuple[Any, dict[str, Any]]:
        """Steps begin.step+1 .. train.steps; returns the final state and the last loss, eval loss and times."""
        for index in range(self.begin.step, self.plan.steps):
            step = index + 1  # the number of completed updates once this step is done
            self._profile_start(step)
            self.state, self.metrics = self.s.compiled(self.state, self.s.trainer.batch(index))
            flags = self.agree.post((self.s.signals.requested.is_set(), self.s.saver.time_due()))
            self._inject_faults(step)
            if self.pending:
                self._finish(*self.pending)
            self.pending = (step, self.metrics, flags)
            self._after_step(step)
        if self.pending:
            self._finish(*self.pending)
        t = self.config.train
        if t.eval_batches and (not t.eval_every or self.plan.steps % t.eval_every):
            self._timed_evaluate(self.plan.steps)
        return self.state, self.last

    def _after_step(self, step: int) -> None:
        """Steps 3-6 of the order in train/actions.py."""
        self.s.saver.poll()  # a background save that failed is raised here, on the main thread
        self._profile_stop(step)
        t = self.config.train
        eval_due = bool(t.eval_every and step % t.eval_every == 0 and t.eval_batches)
        save_due = self._save_due(step)  # first decision: prepare the checksums while the step runs
        if save_due:
            self.s.saver.prepare(step, self.state, self.begin.rng)
        if eval_due or save_due:
            self._finish(*self.pending)  # reads step s's agreed flags and checks the state is finite
            self.pending = None
        if eval_due:
            self._timed_evaluate(step)
        if self._save_due(step):  # decided again: step s's flags (just read) may ask for a save
            self._save(step)
        self._user_actions(step)
        if self.decided["stop"] and step < self.plan.steps:  # at the last step the run is done anyway
            self._stop(step)

    # ------------------------------------------------------------------ metric actions (step 2)

    def _finish(self, step: int, metrics, flags) -> None:
        """Fetch step `step`'s metrics and flags; clock, kick, agree, guard, log."""
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        self.last["times"].append(now - self.t_prev)
        self.s.goodput.step(step, now - self.t_prev)
        self.t_prev = now
        self.s.dog.kick(f"step {step}")
        self.last["loss"] = values["loss"]
        stop, time_save = self.agree.read(flags)
        self.decided["stop"] |= stop
        self.decided["time_save"] |= time_save
        if not (math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"])):
            non_finite(self.config.train.on_nonfinite, step, values, self.s.saver.last_saved)
        if step % self.config.train.log_every == 0 or step == self.plan.steps:
            self._log(step, values)

    def _log(self, step: int, values: dict[str, float]) -> None:
        times, every, rep = self.last["times"], self.config.train.log_every, self.s.rep
        recent = float(np.mean(times[-every:]))
        tps = rep["tokens_per_step"] / recent
        mfu = rep["flops_per_step"] / recent / self.s.peak if self.s.peak else 0.0
        record = {"step": step, **values, "step_time_s": recent, "tokens_per_s": tps, "mfu": mfu,
                  **self.s.trainer.source.progress(step, self.plan.global_batch, self.plan.model.seq_len + 1)}
        if jax.process_count() > 1:  # every process logs at the same steps, so this gather cannot hang
            record["host_step_time_s"] = host_step_times(recent)
        self.s.log.write(record)
        self.s.log.progress(step, values["loss"], tps, mfu, recent * (self.plan.steps - step))
        self.s.goodput.flush()

    # ------------------------------------------------------------------ step actions (steps 1, 3-6)

    def _inject_faults(self, step: int) -> None:
        """Test-only faults (fault_injection.*), while the step runs; all zero in a real run."""
        fi = self.config.fault_injection
        if fi.step_delay_s:
            time.sleep(fi.step_delay_s)
        if fi.hang_at_step == step:
            time.sleep(fi.hang_s)

    def _profile_start(self, step: int) -> None:
        profile = self.plan.profile_steps
        if profile and profile[0] <= step <= profile[1] and not self.tracing:  # also when resumed mid-range
            jax.profiler.start_trace(str(self.s.path / "profile"))
            self.tracing = True

    def _profile_stop(self, step: int) -> None:
        if self.tracing and step == self.plan.profile_steps[1]:
            jax.block_until_ready(self.state)
            jax.profiler.stop_trace()
            self.tracing = False

    def _evaluate(self, step: int) -> None:
        self.last["eval_loss"] = evaluate(self.s.trainer, self.state["params"])
        self.s.log.write({"step": step, "eval_loss": self.last["eval_loss"]})

    def _timed_evaluate(self, step: int) -> None:
        t0 = time.perf_counter()
        self._evaluate(step)
        self.s.goodput.add("eval_s", time.perf_counter() - t0)
        self.s.dog.kick(f"eval at step {step}")
        self.t_prev = time.perf_counter()  # evaluation time is not step time

    def _save_due(self, step: int) -> bool:
        d = self.decided
        return self.s.saver.policy.step_due(step) or d["time_save"] or d["stop"] or step == self.plan.steps

    def _save(self, step: int) -> None:
        self.s.saver.save(step, self.state, self.begin.rng)
        self.decided["time_save"] = False
        self.s.dog.kick(f"checkpoint at step {step}")
        self.t_prev = time.perf_counter()  # blocked save time is accounted separately

    def _user_actions(self, step: int) -> None:
        for action in self.user_actions:
            if action.due(step):
                record = action.run(step, self.state, self.metrics)
                if record:
                    self.s.log.write({"step": step, **record})

    def _stop(self, step: int) -> None:
        if self.tracing:  # keep the part of the trace that was taken
            jax.profiler.stop_trace()
        self.s.saver.wait()
        if not self.s.saver.enabled:
            raise exit_codes.Stop(exit_codes.REQUEUE, f"preempted at step {step}; checkpoint.enabled=False, so "
                                                      f"nothing was saved (exit status 75)")
        raise exit_codes.Stop(exit_codes.REQUEUE, f"preempted: saved checkpoint {self.s.saver.ckpts.step_dir(step)}; "
                                                  f"run the same command again to resume (exit status 75)")


def evaluate(trainer, params) -> float:
    batches = trainer.config.train.eval_batches
    losses = [trainer.eval_step(params, trainer.batch(k, split="eval")) for k in range(batches)]
    return float(np.mean(jax.device_get(losses)))


def non_finite(policy: str, step: int, values: dict[str, float], last_saved: int) -> None:
    what = f"loss {values['loss']} and gradient norm {values['grad_norm']} at step {step}"
    if policy == "skip":
        say(f"warning: {what}: update skipped (train.on_nonfinite=skip)")
        return
    newest = f"the newest checkpoint is step {last_saved}" if last_saved > 0 else "no checkpoint was saved"
    raise exit_codes.Stop(exit_codes.NON_FINITE,
                          f"{what}: not finite; stopped without saving it ({newest}). Lower optimizer.lr or "
                          f"optimizer.clip_norm, or set train.on_nonfinite=skip to skip such updates")
