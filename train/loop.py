"""The training run: validate, compile (with the fits-in-memory check and the compile report), resume or
initialize, then loop with checkpoints, preemption, a watchdog and goodput accounting. Metrics of step
s are fetched only after step s+1 is dispatched, so logging never stalls the device."""
from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np

import checkpoint
from train import audit as audit_lib, data as data_lib, exit_codes, hardware, preemption, report as report_lib, resume
from train.config import ConfigError
from train.goodput import Goodput
from train.metrics import MetricsLog
from train.saver import Saver
from train.trainer import Trainer
from train.watchdog import Watchdog

GiB = 1 << 30


def prepare_workdir(workdir: str) -> pathlib.Path:
    path = pathlib.Path(workdir).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--workdir={workdir}: cannot write there ({e.strerror}); choose a writable directory") from None
    return path


def check_memory(memory: dict[str, int]) -> None:
    """Stop before the first step when the compiled step cannot fit in a device's memory."""
    capacity = hardware.memory_per_device()
    if capacity and memory["peak_bytes"] > capacity:
        raise ConfigError(
            f"the compiled step needs {memory['peak_bytes'] / GiB:.2f} GiB per device but a device has "
            f"{capacity / GiB:.2f} GiB; shard more (mesh.fsdp, mesh.tensor), set model.remat, lower "
            f"train.global_batch_size or raise train.grad_accum_steps (or set train.memory_check=False)")


def versions() -> dict[str, str]:
    import flax
    import jaxlib
    import optax
    import orbax.checkpoint as ocp
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
            "optax": optax.__version__, "orbax_checkpoint": ocp.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "platform": jax.devices()[0].platform,
            "device_kind": jax.devices()[0].device_kind, "device_count": jax.device_count(),
            "process_count": jax.process_count()}


def evaluate(trainer: Trainer, params) -> float:
    batches = trainer.config.train.eval_batches
    losses = [trainer.eval_step(params, trainer.batch(k, split="eval")) for k in range(batches)]
    return float(np.mean(jax.device_get(losses)))


def run(config: ml_collections.ConfigDict, workdir: str, *, compile_only: bool = False,
        peak_tflops: float = 0.0, audit: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train (or with `compile_only` just compile and report); `audit` = {topology, hosts, mfu} adds
    the communication audit to the report and prints it."""
    # From the start (compilation and restore included), SIGTERM or Ctrl-C means: save, exit 75.
    with preemption.StopSignals(enabled=not compile_only) as signals:
        return _run(config, workdir, signals, compile_only=compile_only, peak_tflops=peak_tflops, audit=audit)


def _run(config: ml_collections.ConfigDict, workdir: str, signals: preemption.StopSignals, *,
         compile_only: bool, peak_tflops: float, audit: dict[str, Any] | None) -> dict[str, Any]:
    trainer = Trainer.build(config)  # every user error is raised here, before the workdir is touched
    resume.validate(config)
    plan = trainer.plan
    path = prepare_workdir(workdir)  # only creates the directory; nothing in it is touched yet
    if not compile_only:
        resume.check_before_compile(config, trainer, path)  # checkpoint compatibility: nothing moved yet
    is_main = jax.process_index() == 0
    goodput = Goodput(path, enabled=is_main)
    t0 = time.perf_counter()
    compiled, xla_log = audit_lib.compile_logged(trainer.compile) if audit else (trainer.compile(), "")
    compile_s = time.perf_counter() - t0
    goodput.add("compile_s", compile_s)
    memory = report_lib.memory_per_device(compiled)
    if config.train.memory_check:
        check_memory(memory)
    rep = report_lib.build(plan, trainer.mesh, compiled, {"compile_seconds": round(compile_s, 3)})
    if audit:
        rep["audit"] = audit_lib.audit(trainer, rep, xla_log, **audit)
        if is_main:
            print(audit_lib.format_table(rep["audit"]), flush=True)
    if is_main:
        report_lib.write(rep, path)
    if is_main and not compile_only:  # a what-if compile leaves the run's own config.json alone
        resolved = {"config": config.to_dict(), "model": vars(plan.model) | {"param_count": rep["param_count"]},
                    "mesh": rep["mesh"], "versions": versions()}
        (path / "config.json").write_text(json.dumps(resolved, indent=2, default=str) + "\n")
        data_lib.copy_tokenizer(plan.data, path)
    if compile_only:
        mem = rep["memory_per_device"]
        if is_main:
            print(f"compiled in {compile_s:.1f}s: peak {mem['peak_bytes'] / GiB:.3f} GiB/device, "
                  f"{len(rep['collectives'])} distinct collectives; wrote {path / 'compile_report.json'}")
        return {"compile_report": rep}
    return train(config, trainer, compiled, rep, path, goodput, signals, peak_tflops)


def host_step_times(seconds: float) -> list[float]:
    """Each process's mean step time, so a straggling host shows in metrics.jsonl."""
    from jax.experimental import multihost_utils
    return [float(t) for t in multihost_utils.process_allgather(np.float32(seconds))]


def say(text: str) -> None:
    if jax.process_index() == 0:
        print(text, flush=True)


def train(config: ml_collections.ConfigDict, trainer: Trainer, compiled, rep: dict[str, Any], path: pathlib.Path,
          goodput: Goodput, signals: preemption.StopSignals, peak_tflops: float) -> dict[str, Any]:
    """Resume (or start), then loop; the exit paths (done, preempted, non-finite, failed save) all wait
    for the save in flight and record goodput."""
    plan = trainer.plan
    ckpts = checkpoint.Checkpoints(path / "checkpoints", keep=config.checkpoint.keep,
                                   keep_period=config.checkpoint.keep_period)
    begin = resume.start(config, trainer, ckpts, say)
    goodput.add("init_s" if begin.origin == "initialized" else "restore_s", begin.seconds)
    if begin.step >= plan.steps:
        say(f"the run in {path} already reached train.steps={plan.steps} ({begin.origin}); nothing to do")
        goodput.flush(exit_codes.OK)
        return {"state": begin.state, "summary": {"workdir": str(path), "step": begin.step}, "compile_report": rep}
    if jax.process_index() == 0:
        if begin.resumed:
            resume.cut_metrics(path, begin.step)  # so every step appears once
        else:
            (path / "metrics.jsonl").write_text("")  # a fresh run starts a fresh log
    log = MetricsLog(path, plan.steps, purge_step=begin.step + 1 if begin.resumed else None)
    log.message(f"training {rep['param_count'] / 1e6:.1f}M parameters on mesh "
                f"{' x '.join(f'{a}={s}' for a, s in rep['mesh'].items() if s > 1) or 'single device'} "
                f"for {plan.steps} steps{report_lib.pipeline_line(plan)} from step {begin.step} ({begin.origin}); "
                f"compiled in {rep['compile_seconds']:.1f}s")
    saver = Saver(ckpts, config, trainer, log, goodput, last_saved=begin.step if begin.resumed else -1)
    goodput.add("compile_s", saver.warm_up(begin.state, begin.rng))
    status = exit_codes.CRASH
    with Watchdog(config.train.step_timeout_s, exit_codes.WATCHDOG,
                  before_exit=lambda: goodput.flush(exit_codes.WATCHDOG)) as dog:
        try:
            state, last = _loop(config, trainer, compiled, rep, path, begin, log, saver, goodput, signals, dog,
                                peak_tflops)
            saver.wait()
            status = exit_codes.OK
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
    summary = _summary(last, rep, path, peak_tflops, plan)
    say(f"done: loss {summary['final_loss']:.4f}, eval loss {summary['eval_loss']:.4f}, "
        f"{summary['tokens_per_s']:,.0f} tokens/s, MFU {100 * summary['mfu']:.2f}%; {goodput.line()}; outputs in "
        f"{path} (metrics.jsonl, goodput.json, checkpoints/, compile_report.json, config.json, tensorboard/)")
    sys.stdout.flush()
    return {"state": state, "summary": summary, "compile_report": rep}


def _summary(last: dict[str, Any], rep: dict[str, Any], path: pathlib.Path, peak_tflops: float, plan) -> dict:
    peak = hardware.peak_flops_per_device(plan.model.compute_dtype, peak_tflops) * jax.device_count()
    steady = last["times"][1:] or last["times"]
    step_time = float(np.mean(steady)) if steady else float("nan")
    return {"final_loss": last["loss"], "eval_loss": last["eval_loss"] if last["eval_loss"] is not None else float("nan"),
            "step_time_s": step_time, "tokens_per_s": rep["tokens_per_step"] / step_time,
            "mfu": rep["flops_per_step"] / step_time / peak if peak else 0.0, "workdir": str(path)}


def _loop(config, trainer: Trainer, compiled, rep, path: pathlib.Path, begin: resume.Start, log: MetricsLog,
          saver: Saver, goodput: Goodput, signals: preemption.StopSignals, dog: Watchdog, peak_tflops: float):
    """Steps begin.step+1 .. train.steps. Metrics of step s (and the agreed stop/save flags posted after
    it) are fetched after step s+1 is dispatched, so logging never stalls the device; they are fetched
    at once before an eval or a save, so a non-finite state is never saved."""
    plan, fi = trainer.plan, config.fault_injection
    peak = hardware.peak_flops_per_device(plan.model.compute_dtype, peak_tflops) * jax.device_count()
    agree = preemption.Agreement()
    last: dict[str, Any] = {"loss": float("nan"), "eval_loss": None, "times": []}
    times = last["times"]
    t_prev = time.perf_counter()
    decided = {"stop": False, "time_save": False}

    def finish_step(step: int, metrics, flags) -> None:
        """Fetch step `step`'s metrics and flags, check they are finite, log them."""
        nonlocal t_prev
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        times.append(now - t_prev)
        goodput.step(step, now - t_prev)
        t_prev = now
        dog.kick(f"step {step}")
        last["loss"] = values["loss"]
        stop, time_save = agree.read(flags)
        decided["stop"] |= stop
        decided["time_save"] |= time_save
        if not (math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"])):
            _non_finite(config, step, values, saver.last_saved)
        if step % config.train.log_every == 0 or step == plan.steps:
            recent = float(np.mean(times[-config.train.log_every:]))
            tps = rep["tokens_per_step"] / recent
            mfu = rep["flops_per_step"] / recent / peak if peak else 0.0
            record = {"step": step, **values, "step_time_s": recent, "tokens_per_s": tps, "mfu": mfu,
                      **trainer.source.progress(step, plan.global_batch, plan.model.seq_len + 1)}
            if jax.process_count() > 1:  # every process logs at the same steps, so this gather cannot hang
                record["host_step_time_s"] = host_step_times(recent)
            log.write(record)
            log.progress(step, values["loss"], tps, mfu, recent * (plan.steps - step))
            goodput.flush()

    state = begin.state
    profile = plan.profile_steps
    tracing = False
    pending = None
    step = begin.step
    for index in range(begin.step, plan.steps):
        step = index + 1  # the number of completed updates once this step is done
        if profile and profile[0] <= step <= profile[1] and not tracing:  # also when resumed mid-range
            jax.profiler.start_trace(str(path / "profile"))
            tracing = True
        state, metrics = compiled(state, trainer.batch(index))
        flags = agree.post((signals.requested.is_set(), saver.time_due()))
        if fi.step_delay_s:
            time.sleep(fi.step_delay_s)
        if fi.hang_at_step == step:
            time.sleep(fi.hang_s)
        if pending:
            finish_step(*pending)
        pending = (step, metrics, flags)
        saver.poll()  # a background save that failed is raised here, on the main thread
        if tracing and step == profile[1]:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            tracing = False
        eval_due = bool(config.train.eval_every and step % config.train.eval_every == 0 and config.train.eval_batches)
        save_due = _save_due(saver, decided, step, plan.steps)
        if save_due:
            saver.prepare(step, state, begin.rng)
        if eval_due or save_due:
            finish_step(*pending)  # also checks the state about to be saved is finite
            pending = None
        if eval_due:
            t0 = time.perf_counter()
            last["eval_loss"] = evaluate(trainer, state["params"])
            log.write({"step": step, "eval_loss": last["eval_loss"]})
            goodput.add("eval_s", time.perf_counter() - t0)
            dog.kick(f"eval at step {step}")
            t_prev = time.perf_counter()  # evaluation time is not step time
        if _save_due(saver, decided, step, plan.steps):
            saver.save(step, state, begin.rng)
            decided["time_save"] = False
            dog.kick(f"checkpoint at step {step}")
            t_prev = time.perf_counter()  # blocked save time is accounted separately
        if decided["stop"] and step < plan.steps:  # at the last step the run is done anyway
            if tracing:  # keep the part of the trace that was taken
                jax.profiler.stop_trace()
            saver.wait()
            raise exit_codes.Stop(exit_codes.REQUEUE, f"preempted: saved checkpoint {saver.ckpts.step_dir(step)}; "
                                                      f"run the same command again to resume (exit status 75)")
    if pending:
        finish_step(*pending)
    if config.train.eval_batches and (not config.train.eval_every or plan.steps % config.train.eval_every):
        last["eval_loss"] = evaluate(trainer, state["params"])
        log.write({"step": plan.steps, "eval_loss": last["eval_loss"]})
    return state, last


def _save_due(saver: Saver, decided: dict[str, bool], step: int, final: int) -> bool:
    return saver.policy.step_due(step) or decided["time_save"] or decided["stop"] or step == final


def _non_finite(config, step: int, values: dict[str, float], last_saved: int) -> None:
    what = f"loss {values['loss']} and gradient norm {values['grad_norm']} at step {step}"
    if config.train.on_nonfinite == "skip":
        say(f"warning: {what}: update skipped (train.on_nonfinite=skip)")
        return
    newest = f"the newest checkpoint is step {last_saved}" if last_saved > 0 else "no checkpoint was saved"
    raise exit_codes.Stop(exit_codes.NON_FINITE,
                          f"{what}: not finite; stopped without saving it ({newest}). Lower optimizer.lr or "
                          f"optimizer.clip_norm, or set train.on_nonfinite=skip to skip such updates")
