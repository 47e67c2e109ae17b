"""The training run: validate, compile (with the fits-in-memory check and the compile report),
initialize, then loop. Metrics of step s are fetched only after step s+1 is dispatched, so logging
never stalls the device."""
from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from train import audit as audit_lib, hardware, report as report_lib
from train.config import ConfigError
from train.metrics import MetricsLog
from train.trainer import Trainer

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
    trainer = Trainer.build(config)  # every user error is raised here, before the workdir is touched
    plan = trainer.plan
    path = prepare_workdir(workdir)  # only creates the directory; nothing in it is touched yet
    t0 = time.perf_counter()
    compiled, xla_log = audit_lib.compile_logged(trainer.compile) if audit else (trainer.compile(), "")
    compile_s = time.perf_counter() - t0
    memory = report_lib.memory_per_device(compiled)
    if config.train.memory_check:
        check_memory(memory)
    rep = report_lib.build(plan, trainer.mesh, compiled, {"compile_seconds": round(compile_s, 3)})
    is_main = jax.process_index() == 0
    if audit:
        rep["audit"] = audit_lib.audit(trainer, rep, xla_log, **audit)
        if is_main:
            print(audit_lib.format_table(rep["audit"]), flush=True)
    if is_main:
        report_lib.write(rep, path)
        resolved = {"config": config.to_dict(), "model": vars(plan.model) | {"param_count": rep["param_count"]},
                    "mesh": rep["mesh"], "versions": versions()}
        (path / "config.json").write_text(json.dumps(resolved, indent=2, default=str) + "\n")
    if compile_only:
        mem = rep["memory_per_device"]
        if is_main:
            print(f"compiled in {compile_s:.1f}s: peak {mem['peak_bytes'] / GiB:.3f} GiB/device, "
                  f"{len(rep['collectives'])} distinct collectives; wrote {path / 'compile_report.json'}")
        return {"compile_report": rep}

    peak = hardware.peak_flops_per_device(plan.model.compute_dtype, peak_tflops) * jax.device_count()
    flops_per_step = rep["flops_per_step"]
    tokens_per_step = rep["tokens_per_step"]
    log = MetricsLog(path, plan.steps)
    state = trainer.init_state()
    start = int(jax.device_get(state["step"]))
    if start == 0 and is_main:
        (path / "metrics.jsonl").write_text("")  # a fresh run starts a fresh log
    log.message(f"training {rep['param_count'] / 1e6:.1f}M parameters on mesh "
                f"{' x '.join(f'{a}={s}' for a, s in rep['mesh'].items() if s > 1) or 'single device'} "
                f"for {plan.steps} steps{report_lib.pipeline_line(plan)}; compiled in {compile_s:.1f}s")

    times: list[float] = []
    last = {"loss": float("nan"), "eval_loss": None}
    t_prev = time.perf_counter()

    def finish_step(step: int, metrics) -> None:
        """Fetch step `step`'s metrics (its successor is already queued) and log them."""
        nonlocal t_prev
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        times.append(now - t_prev)
        t_prev = now
        last["loss"] = values["loss"]
        if step % config.train.log_every == 0 or step == plan.steps:
            recent = float(np.mean(times[-config.train.log_every:]))
            tps = tokens_per_step / recent
            mfu = flops_per_step / recent / peak if peak else 0.0
            log.write({"step": step, **values, "step_time_s": recent, "tokens_per_s": tps, "mfu": mfu})
            log.progress(step, values["loss"], tps, mfu, recent * (plan.steps - step))

    profile = plan.profile_steps
    pending = None
    for index in range(start, plan.steps):
        step = index + 1  # the number of completed updates once this step is done
        if profile and step == profile[0]:
            jax.profiler.start_trace(str(path / "profile"))
        state, metrics = compiled(state, trainer.batch(index))
        if pending:
            finish_step(*pending)
        pending = (step, metrics)
        if profile and step == profile[1]:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
        if config.train.eval_every and step % config.train.eval_every == 0 and config.train.eval_batches:
            finish_step(*pending)
            pending = None
            last["eval_loss"] = evaluate(trainer, state["params"])
            log.write({"step": step, "eval_loss": last["eval_loss"]})
            t_prev = time.perf_counter()  # evaluation time is not step time
    if pending:
        finish_step(*pending)
    if config.train.eval_batches and (not config.train.eval_every or plan.steps % config.train.eval_every):
        last["eval_loss"] = evaluate(trainer, state["params"])
        log.write({"step": plan.steps, "eval_loss": last["eval_loss"]})
    log.close()

    steady = times[1:] or times
    step_time = float(np.mean(steady)) if steady else float("nan")
    summary = {"final_loss": last["loss"], "eval_loss": last["eval_loss"], "step_time_s": step_time,
               "tokens_per_s": tokens_per_step / step_time, "mfu": flops_per_step / step_time / peak if peak else 0.0,
               "workdir": str(path)}
    if is_main:
        print(f"done: loss {summary['final_loss']:.4f}, eval loss {summary['eval_loss']:.4f}, "
              f"{summary['tokens_per_s']:,.0f} tokens/s, MFU {100 * summary['mfu']:.2f}%; outputs in {path} "
              f"(metrics.jsonl, compile_report.json, config.json, tensorboard/)", flush=True)
    sys.stdout.flush()
    return {"state": state, "summary": summary, "compile_report": rep}
