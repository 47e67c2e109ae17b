"""Step time, tokens/s and MFU of the train step on several layouts, beside a minimal hand-written
jit + optax step of the same model on one device (the framework's overhead).

    python -m experiments.bench_train --num_cpu_devices=8 --configs=tiny,default --steps=20
    python -m experiments.bench_train --configs=llama3-tiny --layouts='data=8,data=2;tensor=4'
    python -m experiments.bench_train --configs=tiny --layouts='data=2;tensor=4;sp,data=2;context=4'

A layout is mesh axes separated by ';'; the token `sp` turns on sequence parallelism (sharding.sequence_parallel).
"""
from __future__ import annotations

import importlib
import json
import pathlib
import time

import jax
import optax
from absl import flags

import models
from mesh import use_cpu_devices
from mesh.errors import UserError
from train import cli
from train.plan import compile_report as report
from train.runtime import hardware
from train.state import make_optimizer
from train.trainer import Trainer

_CONFIGS = flags.DEFINE_list("configs", ["tiny", "default"],
                              "Experiment files in experiments/, or model presets (e.g. llama3-tiny, llama3.2-1b) "
                              "on experiments/tiny.py's settings.")
_LAYOUTS = flags.DEFINE_list("layouts", ["data=8", "fsdp=8", "data=2;fsdp=2;tensor=2", "data=2;tensor=4",
                                         "data=2;pipeline=2;tensor=2", "data=2;tensor=4;sp", "data=2;context=4",
                                         "data=2;context=2;tensor=2;sp"],
                             "Meshes, axes separated by ';' (`sp`: sequence parallelism on).")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps per row (after 3 warm-up steps).", lower_bound=1)
_NUM_CPU_DEVICES = flags.DEFINE_integer("num_cpu_devices", 8, "Virtual devices when the platform is CPU.")
_SOURCE = flags.DEFINE_enum("source", "synthetic", ["text", "tokens", "synthetic"], "data.source for every run.")
_JSON = flags.DEFINE_string("json", "", "Also write the rows to this JSON file.")
WARMUP = 3
flags.register_validator(
    "configs", lambda names: all(n in models.PRESETS or (pathlib.Path(__file__).parent / f"{n}.py").is_file()
                                 for n in names),
    "each must be an experiment file of experiments/ (without .py) or a model preset")


def _parse_layout(text: str) -> tuple[dict[str, int], bool]:
    """'data=2;tensor=4;sp' -> ({'data': 2, 'tensor': 4}, True)."""
    tokens = [t for t in text.split(";") if t]
    return {k: int(v) for k, v in (t.split("=") for t in tokens if t != "sp")}, "sp" in tokens


def _config(name: str, layout: dict[str, int], sequence_parallel: bool = False):
    if name in models.PRESETS:
        config = importlib.import_module("experiments.tiny").get_config()
        config.model.preset = name
    else:
        config = importlib.import_module(f"experiments.{name}").get_config()
    config.data.source = _SOURCE.value
    config.mesh.update({"data": 1, "pipeline": 1, "fsdp": 1, "tensor": 1, **layout})
    config.sharding.sequence_parallel = sequence_parallel
    return config


def _time_steps(step_fn, state, batches) -> float:
    """Mean seconds per step over the timed steps; one sync at the end, as a training loop would."""
    for i in range(WARMUP):
        state, _ = step_fn(state, batches(i))
    jax.block_until_ready(state)
    t = time.perf_counter()
    for i in range(WARMUP, WARMUP + _STEPS.value):
        state, metrics = step_fn(state, batches(i))
    jax.block_until_ready((state, metrics))
    return (time.perf_counter() - t) / _STEPS.value


def minimal_step_time(config) -> float:
    """The same model and optimizer in the plainest JAX: one device, no mesh, no annotations."""
    reference = Trainer.build(config, num_devices=1)  # only for its data source and plan
    cfg = reference.plan.model
    tx, _ = make_optimizer(config.optimizer, reference.plan.decay_steps)

    @jax.jit
    def step(state, tokens):
        params, opt_state = state
        loss, grads = jax.value_and_grad(models.loss)(params, tokens, cfg)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    params = models.init_params(cfg, config.train.seed)
    batch = lambda i: jax.device_put(reference.tokens.rows(  # noqa: E731
        config.train.seed, i, reference.plan.global_batch, cfg.seq_len + 1, slice(None)))
    return _time_steps(step, (params, tx.init(params)), batch)


def framework_row(config, num_devices: int | None, peak_per_device: float) -> dict:
    trainer = Trainer.build(config, num_devices=num_devices)
    compiled = trainer.compile()
    seconds = _time_steps(compiled, trainer.init_state(), trainer.batch)
    rep = report.build(trainer.plan, trainer.mesh, compiled)
    devices = num_devices or jax.device_count()
    return {"step_time_s": seconds, "tokens_per_s": rep["tokens_per_step"] / seconds,
            "mfu": hardware.mfu(rep["flops_per_step"], seconds, peak_per_device * devices, hardware.peak_is_measured()),
            "temp_bytes": rep["memory_per_device"]["temp_bytes"]}


def main(argv):
    del argv
    use_cpu_devices(_NUM_CPU_DEVICES.value)
    rows = []
    device = jax.devices()[0]
    print(f"# {device.platform} ({device.device_kind}) x {jax.device_count()}, jax {jax.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")
    print("| config | layout | step ms | tokens/s | MFU | temp MiB/device | vs minimal 1-device step |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in _CONFIGS.value:
        base = _config(name, {})
        peak = hardware.peak_flops_per_device(hardware.compute_dtype(base))
        minimal = minimal_step_time(base)
        layouts = [("single device", ({}, False), 1)] + [
            (text.replace(";", ","), _parse_layout(text), None) for text in _LAYOUTS.value]
        for label, (layout, sp), n in layouts:
            try:
                row = framework_row(_config(name, layout, sp), n, peak * (jax.device_count() if n == 1 else 1))
            except UserError as e:  # a layout this config cannot run: skip its row
                print(f"| {name} | {label} | skipped: {e} |||||")
                continue
            overhead = row["step_time_s"] / minimal - 1 if n == 1 else None
            rows.append({"config": name, "layout": label, **row, "minimal_step_time_s": minimal,
                         "overhead": overhead})
            print(f"| {name} | {label} | {1e3 * row['step_time_s']:.1f} | {row['tokens_per_s']:,.0f} | "
                  f"{100 * row['mfu']:.1f}% | {row['temp_bytes'] / 2**20:.1f} | "
                  + (f"{1e3 * minimal:.1f} ms minimal: {100 * overhead:+.1f}% |" if overhead is not None else "|"),
                  flush=True)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    cli.run(main)  # a bad flag or setting: one line, exit 2
