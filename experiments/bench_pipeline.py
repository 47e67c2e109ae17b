"""Pipeline schedules at equal global batch: step time, temp memory per device and bubble fraction for each
schedule and microbatch count (GPipe, 1F1B, interleaved and the zero-bubble ZB-H1 and ZB-V, measured side by side
in one process), beside the same devices without a pipeline (the pipeline axis folded into data).

    python -m experiments.bench_pipeline --config=default --layout='pipeline=2;data=2;tensor=2' --microbatches=2,4,8
"""
from __future__ import annotations

import importlib
import json
import time

import jax
import numpy as np
from absl import flags

from mesh import use_cpu_devices
from mesh.errors import UserError
from train import cli
from train.plan import compile_report as report
from train.trainer import Trainer

_CONFIG = flags.DEFINE_string("config", "default", "Experiment file in experiments/.")
_LAYOUT = flags.DEFINE_string("layout", "pipeline=2;data=2;tensor=2", "The pipelined mesh, axes separated by ';'.")
_BASELINE = flags.DEFINE_string("baseline", "",
                                 "The unpipelined mesh (default: the layout with pipeline folded into data).")
_SCHEDULES = flags.DEFINE_list("schedules", ["gpipe", "1f1b", "interleaved", "zb_h1", "zb_v"], "Schedules to run.")
_MICROBATCHES = flags.DEFINE_list("microbatches", ["2", "4", "8"], "Microbatch counts per data-parallel replica.")
_VIRTUAL = flags.DEFINE_integer("virtual_stages", 2, "Chunks per stage for the interleaved schedule.")
_BATCH = flags.DEFINE_integer("global_batch_size", 0, "Global batch (0: the config's).")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps per row (after 2 warm-up steps).")
_NUM_CPU_DEVICES = flags.DEFINE_integer("num_cpu_devices", 8, "Virtual devices when the platform is CPU.")
_JSON = flags.DEFINE_string("json", "", "Also write the rows to this JSON file.")
WARMUP = 2


def _mesh(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(";") if kv)}


def _config(mesh: dict[str, int], schedule: str = "1f1b", microbatches: int = 1, virtual_stages: int = 1):
    config = importlib.import_module(f"experiments.{_CONFIG.value}").get_config()
    config.data.source = "synthetic"
    config.mesh.update({"data": 1, "pipeline": 1, "fsdp": 1, "tensor": 1, **mesh})
    config.pipeline.update(schedule=schedule, microbatches=microbatches, virtual_stages=virtual_stages)
    if _BATCH.value:
        config.train.global_batch_size = _BATCH.value
    return config


def measure(config) -> dict:
    """Compile, then time each step to completion. The minimum is reported beside the median: on a shared
    CPU, other processes only ever add time, so the fastest step is the best estimate of the program's own."""
    trainer = Trainer.build(config)
    t = time.perf_counter()
    compiled = trainer.compile()
    compile_s = time.perf_counter() - t
    state = trainer.init_state()
    for i in range(WARMUP):
        state, _ = compiled(state, trainer.batch(i))
    jax.block_until_ready(state)
    times = []
    for i in range(WARMUP, WARMUP + _STEPS.value):
        batch = jax.block_until_ready(trainer.batch(i))
        t = time.perf_counter()
        state, metrics = jax.block_until_ready(compiled(state, batch))
        times.append(time.perf_counter() - t)
    rep = report.build(trainer.plan, trainer.mesh, compiled)
    pipe = rep.get("pipeline") or {}
    return {"step_time_s": min(times), "median_step_time_s": float(np.median(times)), "compile_s": compile_s,
            "temp_bytes": rep["memory_per_device"]["temp_bytes"],
            "bubble_fraction": pipe.get("bubble_fraction", 0.0), "slots": pipe.get("slots", 0),
            "loss": float(metrics["loss"])}


def main(argv):
    del argv
    use_cpu_devices(_NUM_CPU_DEVICES.value)
    layout = _mesh(_LAYOUT.value)
    baseline = _mesh(_BASELINE.value) if _BASELINE.value else {
        **{k: v for k, v in layout.items() if k != "pipeline"}, "data": layout.get("data", 1) * layout["pipeline"]}
    runs = [("none", 1, 1, baseline)]
    for schedule in _SCHEDULES.value:
        for m in (int(x) for x in _MICROBATCHES.value):
            v = {"interleaved": _VIRTUAL.value, "zb_v": 2}.get(schedule, 1)  # zb_v: two chunks per stage, always
            runs.append((schedule, m, v, layout))
    device = jax.devices()[0]
    print(f"# {_CONFIG.value} config, {device.platform} ({device.device_kind}) x {jax.device_count()}, "
          f"jax {jax.__version__}, {time.strftime('%Y-%m-%d')}")
    print("| layout | schedule | microbatches | v | slots | bubble | step ms (min) | median | temp MiB/device "
          "| compile s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for schedule, m, v, mesh in runs:
        label = ",".join(f"{k}={s}" for k, s in mesh.items() if s > 1)
        try:
            row = measure(_config(mesh, schedule if schedule != "none" else "1f1b", m, v))
        except UserError as e:  # a layout this config cannot run: skip its row
            print(f"| {label} | {schedule} | {m} | {v} | skipped: {e} ||||||")
            continue
        rows.append({"layout": label, "schedule": schedule, "microbatches": m, "virtual_stages": v, **row})
        print(f"| {label} | {schedule} | {m if schedule != 'none' else '-'} | {v} | {row['slots'] or '-'} | "
              f"{100 * row['bubble_fraction']:.1f}% | {1e3 * row['step_time_s']:.0f} | "
              f"{1e3 * row['median_step_time_s']:.0f} | "
              f"{row['temp_bytes'] / 2**20:.2f} | {row['compile_s']:.1f} |", flush=True)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    cli.run(main)  # a bad flag or setting: one line, exit 2
