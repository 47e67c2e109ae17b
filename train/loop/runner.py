"""The training run: plan (plan.auto), validate, compile (with the fits-in-memory check and the compile report),
resume or initialize, then hand the loop to train/loop/scheduler.py (checkpoints, preemption, evaluation,
logging, watchdog and goodput as periodic actions, ordered as train/loop/builtin.py documents)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import sys
import time
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

import checkpoint
from mesh.errors import UserError, probe_directory
from train import exit_codes
from train.config.experiment import ConfigError, Plan
from train.loop import actions as actions_lib
from train.loop import phases, preemption, resume
from train.loop.builtin import say
from train.loop.goodput import Goodput
from train.loop.info import Services
from train.loop.metrics import MetricsLog, check_wandb
from train.loop.saver import Saver
from train.loop.scheduler import Outcome, Scheduler
from train.loop.watchdog import Watchdog
from train.plan import audit as audit_lib
from train.plan import auto as planner_auto
from train.plan import compile_report as report_lib
from train.plan import memory as plan_memory
from train.runtime import console, hardware, versions, xla_env
from train.runtime.hardware import GiB
from train.runtime.lock import WorkdirLock
from train.trainer import Trainer


def prepare_workdir(workdir: str) -> pathlib.Path:
    path = pathlib.Path(workdir).expanduser()
    try:
        probe_directory(path, str(os.getpid()))
    except OSError as e:
        raise ConfigError(f"--workdir={workdir}: cannot write there ({e.strerror}); "
                          "choose a writable directory") from None
    return path


PREDICTION_MARGIN = 1.25  # the memory model holds compiled peaks within 15% (tests/planner/test_planner.py)


def check_predicted_memory(plan: Plan, capacity: int | None) -> None:
    """Before compiling: a layout whose arguments and outputs the planner's memory model puts past a device's
    memory stops here, in a second, rather than after the compile or inside it (an allocation XLA cannot make
    aborts the process, as under `ulimit -v`)."""
    donated = jax.devices()[0].platform != "cpu"
    need = plan_memory.resident(plan_memory.predict(plan.model, plan_memory.candidate_of(plan), plan.global_batch,
                                                    donated))
    if capacity and need > PREDICTION_MARGIN * capacity:
        raise ConfigError(
            f"the step needs about {need / GiB:.2f} GiB per device (the planner's memory model) but a device has "
            f"{capacity / GiB:.2f} GiB; shard more (mesh.fsdp, mesh.tensor), set model.remat, lower "
            f"train.global_batch_size or raise train.grad_accum_steps (or set train.memory_check=False)")


def check_memory(memory: dict[str, int]) -> None:
    """Stop before the first step when the compiled step cannot fit in a device's memory."""
    capacity = hardware.memory_per_device()
    if capacity and memory["peak_bytes"] > capacity:
        raise ConfigError(
            f"the compiled step needs {memory['peak_bytes'] / GiB:.2f} GiB per device but a device has "
            f"{capacity / GiB:.2f} GiB; shard more (mesh.fsdp, mesh.tensor), set model.remat, lower "
            f"train.global_batch_size or raise train.grad_accum_steps (or set train.memory_check=False)")


@dataclasses.dataclass(frozen=True)
class Options:
    """The command line's choices beside the config (train/__main__.py)."""
    compile_only: bool = False
    peak_tflops: float = 0.0
    audit: dict[str, Any] | None = None  # {topology, hosts, mfu}
    config_file: str = ""  # the experiment file, recorded in config.json
    logs: bool = False  # the libraries' logs to WORKDIR/logs/ (train/runtime/console.py); a test process keeps its own
    build: Callable[[ml_collections.ConfigDict], Trainer] = Trainer.build  # the run's Trainer (train.rl: RLTrainer's)


@dataclasses.dataclass
class Compiled:
    """A validated run with its compiled step and compile report."""
    trainer: Trainer
    compiled: jax.stages.Compiled
    rep: dict[str, Any]
    peak_tflops: float
    info: dict[str, Any]  # config.json's content: what the loggers record as the run's config


def run(config: ml_collections.ConfigDict, workdir: str, **options: Any) -> dict[str, Any]:
    """Train; `options` are Options' fields: with `compile_only` just compile and report; `audit` = {topology,
    hosts, mfu} adds the communication audit to the report and prints it; `config_file` goes into config.json."""
    chosen = Options(**options)
    # From the start (compilation and restore included), SIGTERM or Ctrl-C means: save, exit 75.
    with preemption.StopSignals(enabled=not chosen.compile_only) as signals:
        return _run(config, workdir, signals, chosen)


def _run(config: ml_collections.ConfigDict, workdir: str, signals: preemption.StopSignals,
         options: Options) -> dict[str, Any]:
    # plan.auto: the planner's layout replaces mesh.* and the layout knobs (printed); the trainer then
    # builds exactly the layout of the config it is given.
    config, planned = planner_auto.apply(config, jax.device_count(), phases.read(pathlib.Path(workdir).expanduser()))
    actions_lib.check_names(config.train)
    if "wandb" in actions_lib.names(config.train.loggers):
        check_wandb()
    trainer = options.build(config)  # every user error is raised here, before the workdir is touched
    if trainer.plan.train.memory_check:  # before the state is initialized or restored, let alone compiled
        check_predicted_memory(trainer.plan, hardware.memory_per_device())
    with claimed(workdir, options.logs) as path:  # created if needed and locked; nothing in it is touched yet
        changed = {}
        if not options.compile_only:
            resume.check_before_compile(trainer, path)  # checkpoint compatibility: nothing moved yet
            changed = _phase_changes(trainer, path)
        goodput = Goodput(path, enabled=jax.process_index() == 0)
        if options.compile_only:
            run = _compile(trainer, path, goodput, options, {"changes": changed, "plan": planned})
            mem = run.rep["memory_per_device"]
            say(f"compiled in {run.rep['compile_seconds']:.1f}s: peak {mem['peak_bytes'] / GiB:.3f} GiB/device, "
                f"{len(run.rep['collectives'])} distinct collectives; wrote {path / 'compile_report.json'}")
            return {"compile_report": run.rep}
        # Restore before compiling: a restore_from checkpoint damaged in its data (found only by reading it) is
        # then a one-line error before the compile, and the restore is needed anyway.
        if jax.process_count() > 1:  # all have looked for checkpoints/ before one creates it (Orbax syncs there)
            multihost_utils.sync_global_devices("workdir checked")
        ckpts, local = _open_checkpoints(trainer.plan, path)
        begin = resume.start(trainer, ckpts, say, local)
        run = _compile(trainer, path, goodput, options, {"changes": changed, "plan": planned})
        return train(run, path, goodput, signals, (ckpts, local, begin))


@contextlib.contextmanager
def claimed(workdir: str, logs: bool = False):
    """The workdir, created if needed, held by this run (process 0 takes the lock for every process) until it
    ends; with `logs`, from then on the libraries write to its logs/process_N.log, not to the console. A start that
    fails on a user error (a setting, a damaged restore_from checkpoint found while restoring) in a directory it
    created removes it, unless it trained there (a checkpoint or a logged step): no empty or half-made run stays."""
    created = not pathlib.Path(workdir).expanduser().exists()
    path = prepare_workdir(workdir)
    lock = WorkdirLock(path, jax.process_count())
    try:
        if jax.process_index() == 0:
            lock.acquire(say)
        if logs:
            _capture_logs(path)
        yield path
    except UserError:
        lock.release()
        logged = (path / "metrics.jsonl").is_file() and (path / "metrics.jsonl").stat().st_size > 0
        if created and not _saved_a_checkpoint(path) and not logged and jax.process_index() == 0:
            shutil.rmtree(path, ignore_errors=True)  # everything in it was written by this start
        raise
    finally:
        lock.release()


def _saved_a_checkpoint(path: pathlib.Path) -> bool:
    return (path / "checkpoints").is_dir() and any(p.name.isdigit() for p in (path / "checkpoints").iterdir())

def _capture_logs(path: pathlib.Path) -> None:
    """The libraries' output to path/logs/process_N.log from now on; where that cannot be written, a warning, and
    it stays on the console."""
    log = path / "logs" / f"process_{jax.process_index()}.log"
    try:
        console.capture(log, jax.process_index())
    except OSError as e:
        print(f"warning: cannot write {log} ({e.strerror or e}); the libraries' logs stay on the console",
              file=sys.stderr, flush=True)


def _phase_changes(trainer: Trainer, path: pathlib.Path) -> dict[str, list[Any]]:
    """The settings this phase changes in the run in `path` (printed; refused unless allowed), {} for a new run."""
    saved = phases.read(path)
    if saved is None:
        return {}
    changed = phases.changes(saved["config"], trainer.config.to_dict(), path, _saved_a_checkpoint(path))
    if changed:
        say("this phase changes " + "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items()))
    return changed


def _compile(trainer: Trainer, path: pathlib.Path, goodput: Goodput, options: Options,
             phase: dict[str, Any]) -> Compiled:
    """Compile (with the memory check and the audit), then write compile_report.json and config.json (with
    the history of the run's phases: phase["changes"] is this one's; phase["plan"]: plan.auto's choice and
    runner-up)."""
    plan, is_main = trainer.plan, jax.process_index() == 0
    peak = hardware.peak_record(plan.model.compute_dtype, options.peak_tflops)  # a CPU's measured before compiling
    t0 = time.perf_counter()
    audit = options.audit
    compiled, xla_log = audit_lib.compile_logged(trainer.compile) if audit else (trainer.compile(), "")
    compile_s = time.perf_counter() - t0
    goodput.add("compile_s", compile_s)
    t0 = time.perf_counter()
    if plan.train.memory_check:
        check_memory(report_lib.memory_per_device(compiled))
    rep = report_lib.build(plan, trainer.mesh, compiled, {"compile_seconds": round(compile_s, 3),
                                                          "predicted_step_s": _predicted(trainer)})
    goodput.add("memory_check_s", time.perf_counter() - t0)
    if audit:
        rep["audit"] = audit_lib.audit(trainer, rep, xla_log, **audit)
        if is_main:
            print(audit_lib.format_table(rep["audit"]), flush=True)
    if is_main:
        report_lib.write(rep, path)
    resolved = {"config": trainer.config.to_dict(), "model": vars(plan.model) | {"param_count": rep["param_count"]},
                "mesh": rep["mesh"], "versions": versions.environment(),
                "runtime_defaults": dict(xla_env.APPLIED),  # GPU XLA flags / memory fraction set for the user
                "peak": peak}  # what MFU divides by
    if phase["plan"]:
        resolved["plan"] = phase["plan"]
    if is_main and not options.compile_only:  # a what-if compile leaves the run's own config.json alone
        record = phases.with_history(resolved, phases.read(path), phase["changes"], options.config_file)
        (path / "config.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
        trainer.write_tokenizer(path)
    return Compiled(trainer, compiled, rep, options.peak_tflops, resolved)


def train(run: Compiled, path: pathlib.Path, goodput: Goodput, signals: preemption.StopSignals,
          started: tuple[checkpoint.Checkpoints, checkpoint.LocalCheckpoints | None, resume.Start]) -> dict[str, Any]:
    """Loop from the restored or initial state (`started`: the run's checkpoints, its local tier if any, and where it
    begins); the exit paths (done, preempted, non-finite, failed save) all wait for the save in flight and record
    goodput."""
    trainer, plan = run.trainer, run.trainer.plan
    ckpts, local, begin = started
    goodput.add("init_s" if begin.origin == "initialized" else "restore_s", begin.seconds)
    if begin.step >= plan.steps:
        say(f"the run in {path} already reached train.steps={plan.steps} ({begin.origin}); nothing to do")
        goodput.flush(exit_codes.OK)
        return {"state": begin.state, "summary": {"workdir": str(path), "step": begin.step}, "compile_report": run.rep}
    log = _open_log(run, path, begin)
    saver = Saver(ckpts, trainer, log, goodput, last_saved=begin.step if begin.resumed else -1, local=local)
    goodput.add("compile_s", saver.warm_up(begin.state, begin.rng))
    peak = hardware.peak_flops_per_device(plan.model.compute_dtype, run.peak_tflops) * jax.device_count()
    with Watchdog(plan.train.step_timeout_s, exit_codes.WATCHDOG,
                  before_exit=lambda: goodput.flush(exit_codes.WATCHDOG)) as dog:
        services = Services(trainer, run.compiled, path, log, saver, goodput, signals, preemption.Agreement(),
                            dog, begin.rng, run.rep, peak, hardware.peak_is_measured(run.peak_tflops))
        outcome = _supervised(Scheduler(services, begin, actions_lib.build(plan.train.actions, trainer.config)))
    summary = _summary(outcome, run.rep, path, services)
    predicted = f" (planner: {run.rep['predicted_step_s']:.3g})" if run.rep.get("predicted_step_s") else ""
    say(f"done: loss {summary['final_loss']:.4f}, eval loss {summary['eval_loss']:.4f}, "
        f"{summary['tokens_per_s']:,.0f} tokens/s, {summary['step_time_s']:.3g} s/step{predicted}, MFU "
        f"{100 * summary['mfu']:.2f}%; {goodput.line()}; outputs in "
        f"{path} ({_listing(path)})")
    sys.stdout.flush()
    return {"state": outcome.state, "summary": summary, "compile_report": run.rep}


def _listing(path: pathlib.Path) -> str:
    """What the run holds, as written: the done line names no logger's folder that was not configured."""
    return ", ".join(p.name + "/" * p.is_dir() for p in sorted(path.iterdir()) if not p.name.startswith("."))


def _open_checkpoints(plan: Plan, path: pathlib.Path) -> tuple[checkpoint.Checkpoints,
                                                                checkpoint.LocalCheckpoints | None]:
    """The run's persistent checkpoints and its local tier (None without checkpoint.local_dir)."""
    enabled = plan.checkpoint.enabled
    if not enabled:
        say(f"warning: checkpoint.enabled=False: this run writes no checkpoint (an existing one in {path} "
            f"is restored, never overwritten); a crash or preemption loses its progress")
    local = checkpoint.LocalCheckpoints(plan.checkpoint.local_dir, path) if plan.checkpoint.local else None
    return checkpoint.Checkpoints(path / "checkpoints", keep=plan.checkpoint.keep,
                                  keep_period=plan.checkpoint.keep_period, read_only=not enabled), local


def _predicted(trainer: Trainer) -> float | None:
    """The planner's step time for this run's layout (planner_auto.own_step_s), or None where it has no topology
    of these devices or cannot price the layout."""
    try:
        return planner_auto.own_step_s(trainer.plan, jax.device_count())
    except (UserError, ValueError, KeyError):  # a layout the planner's models do not cover: no prediction
        return None


def _predicted_text(rep: dict[str, Any]) -> str:
    return f"; the planner predicts {rep['predicted_step_s']:.3g} s/step" if rep.get("predicted_step_s") else ""


def _open_log(run: Compiled, path: pathlib.Path, begin: resume.Start) -> MetricsLog:
    plan, rep = run.trainer.plan, run.rep
    if jax.process_index() == 0:
        if begin.resumed:
            resume.cut_metrics(path, begin.step)  # so every step appears once
        else:
            (path / "metrics.jsonl").write_text("")  # a fresh run starts a fresh log
    log = MetricsLog(path, plan.steps, purge_step=begin.step + 1 if begin.resumed else None,
                     loggers=plan.train.loggers, run_config=run.info,
                     summary={"compile_report": rep})
    log.message(f"training {rep['param_count'] / 1e6:.1f}M parameters on mesh "
                f"{' x '.join(f'{a}={s}' for a, s in rep['mesh'].items() if s > 1) or 'single device'} "
                f"for {plan.steps} steps{report_lib.pipeline_line(plan)} from step {begin.step} ({begin.origin}); "
                f"compiled in {rep['compile_seconds']:.1f}s{_predicted_text(rep)}")
    return log


def _supervised(scheduler: Scheduler) -> Outcome:
    """Run the loop; whatever ends it, let the save in flight commit, close the log, record goodput."""
    saver, log, goodput = scheduler.s.saver, scheduler.s.log, scheduler.s.goodput
    status = exit_codes.CRASH
    try:
        outcome = scheduler.run()
        t0 = time.perf_counter()
        saver.wait()
        goodput.add("final_save_wait_s", time.perf_counter() - t0)
        status = exit_codes.OK
        return outcome
    except BaseException as e:
        status = exit_codes.status_of(e) or exit_codes.CRASH
        if status != exit_codes.SAVE_FAILED:
            try:
                saver.wait()  # the save in flight holds a good state: let it commit
            except checkpoint.SaveFailed as failed:
                say(f"error: {failed}")
        raise
    finally:
        log.close()
        goodput.flush(status)


def _summary(outcome: Outcome, rep: dict[str, Any], path: pathlib.Path, s: Services) -> dict[str, Any]:
    steady = outcome.step_times[1:] or outcome.step_times  # the first step's time includes warm-up
    step_time = float(np.mean(steady)) if steady else float("nan")
    eval_loss = outcome.eval_loss if outcome.eval_loss is not None else float("nan")
    return {"final_loss": outcome.loss, "eval_loss": eval_loss,
            "step_time_s": step_time, "tokens_per_s": rep["tokens_per_step"] / step_time,
            "mfu": hardware.mfu(rep["flops_per_step"], step_time, s.peak, s.peak_measured), "workdir": str(path)}
