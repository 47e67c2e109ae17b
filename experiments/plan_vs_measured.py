"""The planner's predictions against measured steps: per layout, the predicted and measured step time and the
predicted and compiled memory per device, their errors, the median absolute error and the rank correlation
(Spearman) of predicted against measured time.

    python -m experiments.plan_vs_measured [--configs=tiny,default,llama3-tiny,moe-tiny] [--steps=30]
        [--topology=local] [--json=FILE] [--profile]

The links are the `--topology` file (default `local`, fitted by `python -m mesh.bench --fit`); the matmul
efficiency curve, the memory bandwidth and the peak come from `python -m train.plan --calibrate`'s sweep, run first
on this machine, every virtual device at once; each config's `step_overhead` from its own reference step
(train/plan/reference_step.py), measured just before the config's layouts run so both see the machine in the same
state. A layout's measured time is its fastest timed step, as the calibration keeps its best repeat. Memory on CPU:
the step does not donate its state, so the prediction is made undonated and set against the compiled arguments +
outputs + temporaries (XLA's CPU temporaries reuse little; see docs). The summary also gives the roofline's own
error (step_overhead 1). With --profile, a second table sets the share of the step the planner gives its matmuls
against the share of the traced kernel time they took, beside the other kinds of kernel
(experiments/kernel_profile.py).
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import numpy as np
from absl import flags

import models
from experiments import kernel_profile
from mesh import use_cpu_devices
from train import cli, exit_codes
from train.plan import auto, calibrate, compile_report, search
from train.plan.candidate import Candidate, mesh_of
from train.trainer import Trainer

# (config, mesh, extras): extras are `sp` (sequence parallelism) or a pipeline (schedule, microbatches, virtual).
LAYOUTS = [
    ("tiny", {"data": 8}, None), ("tiny", {"fsdp": 8}, None), ("tiny", {"tensor": 8}, None),
    ("tiny", {"data": 2, "tensor": 4}, "sp"), ("tiny", {"data": 2, "pipeline": 4}, ("1f1b", 4, 1)),
    ("tiny", {"data": 2, "pipeline": 2, "tensor": 2}, ("interleaved", 4, 2)), ("tiny", {"data": 2, "context": 4}, None),
    ("default", {"data": 8}, None), ("default", {"data": 2, "fsdp": 2, "tensor": 2}, None),
    ("llama3-tiny", {"fsdp": 8}, None), ("llama3-tiny", {"data": 2, "tensor": 4}, None),
    ("llama3-tiny", {"data": 4, "pipeline": 2}, ("1f1b", 4, 1)),
    ("moe-tiny", {"expert": 8}, None), ("moe-tiny", {"data": 2, "expert": 4}, None),
]
FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined only when it runs, so tests can import it beside other commands that
    define a --topology of their own."""
    flags.DEFINE_list("configs", ["tiny", "default", "llama3-tiny", "moe-tiny"], "Configs whose layouts run.")
    flags.DEFINE_integer("steps", 30, "Timed steps per layout (after 2 warm-up steps); the fastest counts.")
    flags.DEFINE_string("topology", "local", "Links: a topology name or file (calibrated on top).")
    flags.DEFINE_string("json", "", "Also write the rows to this JSON file.")
    flags.DEFINE_bool("profile", False, "Also trace 3 steps per layout and print where their kernel time went.")
WARMUP = 2


def _config(name: str, mesh: dict[str, int], extras, topology: str):
    if name in models.PRESETS:
        config = importlib.import_module("experiments.tiny").get_config()
        config.model.preset = name
    else:
        config = importlib.import_module(f"experiments.{name}").get_config()
    config.data.source = "synthetic"
    config.mesh.update({"data": 1, "pipeline": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1, **mesh})
    config.sharding.strategy = "fsdp_tensor"
    config.sharding.sequence_parallel = extras == "sp"
    if isinstance(extras, tuple):
        config.pipeline.update(schedule=extras[0], microbatches=extras[1], virtual_stages=extras[2])
    config.plan.topology = topology
    return config


def _candidate(trainer: Trainer) -> Candidate:
    plan, pipe = trainer.plan, trainer.plan.pipeline
    return Candidate(mesh_of(plan.mesh_sizes), pipe.schedule if pipe else "none", pipe.microbatches if pipe else 1,
                     pipe.virtual_stages if pipe else 1, plan.model.remat, plan.shard_opt_state, plan.grad_accum,
                     "tensor" in plan.rules.get("seq", ()))


def _measure(trainer: Trainer) -> tuple[float, int, dict | None]:
    """(the fastest of the timed steps, compiled arguments + outputs + temporaries per device, the kernel profile
    with --profile). The fastest, as the calibration keeps its best repeat: both then see the machine at an
    unloaded moment."""
    compiled = trainer.compile()
    memory = compile_report.memory_per_device(compiled)
    state = trainer.init_state()
    for i in range(WARMUP):
        state, _ = compiled(state, trainer.batch(i))
    jax.block_until_ready(state)
    best = float("inf")
    for i in range(WARMUP, WARMUP + FLAGS.steps):
        batch = jax.block_until_ready(trainer.batch(i))
        t = time.perf_counter()
        state, metrics = jax.block_until_ready(compiled(state, batch))
        best = min(best, time.perf_counter() - t)
    kernels = kernel_profile.profile(compiled, state, batch) if FLAGS.profile else None
    return best, memory["argument_bytes"] + memory["output_bytes"] + memory["temp_bytes"], kernels


def row(name: str, mesh: dict[str, int], extras, topology: str) -> dict:
    config = _config(name, mesh, extras, topology)
    trainer = Trainer.build(config)
    plan = trainer.plan
    topo = auto.devices_topology(config.plan.topology, jax.device_count(), plan.model.compute_dtype)
    predicted = search.evaluate(plan.model, _candidate(trainer), plan.global_batch, topo, donated=False)
    roofline = search.evaluate(plan.model, _candidate(trainer), plan.global_batch,
                               dataclasses.replace(topo, step_overhead=1.0), donated=False)
    seconds, compiled_bytes, kernels = _measure(trainer)
    layout = ", ".join(f"{a}={s}" for a, s in mesh.items()) + (" sp" if extras == "sp" else "") + \
        (f" {extras[0]} m={extras[1]}" if isinstance(extras, tuple) else "")
    return {"config": name, "layout": layout, "predicted_s": predicted.step_time_s, "measured_s": seconds,
            "time_error": predicted.step_time_s / seconds - 1,
            "roofline_time_error": roofline.step_time_s / seconds - 1, "predicted_bytes": predicted.memory["total"],
            "compiled_bytes": compiled_bytes, "memory_error": predicted.memory["total"] / compiled_bytes - 1,
            "predicted_matmul_share": predicted.compute_s / (predicted.compute_s + predicted.memory_bound_s),
            "kernels": kernels}


def _ranks(values: list[float]) -> np.ndarray:
    """1-based ranks, ties sharing their mean rank."""
    x = np.asarray(values, dtype=float)
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(1, len(x) + 1)
    for value in np.unique(x):
        ranks[x == value] = ranks[x == value].mean()
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the two rank vectors."""
    return float(np.corrcoef(_ranks(a), _ranks(b))[0, 1])


def summary(rows: list[dict]) -> dict:
    time_errors = [abs(r["time_error"]) for r in rows]
    memory_errors = [abs(r["memory_error"]) for r in rows]
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    roofline = statistics.median(abs(r["roofline_time_error"]) for r in rows)
    return {"layouts": len(rows), "median_abs_time_error": statistics.median(time_errors),
            "median_abs_roofline_time_error": roofline,
            "median_abs_memory_error": statistics.median(memory_errors), "spearman": float(rho)}


def print_profiles(rows: list[dict]) -> None:
    """The planner's matmul share of a step's work (matmuls over matmuls + memory-bound work) against the traced
    compute kernels' time by kind, and the collectives' share of all kernel time."""
    print("\n| config | layout | predicted matmul share | " + " | ".join(kernel_profile.KINDS) +
          " | collectives (waits included) | kernels per step (all devices) |")
    print("|---|---|---:|" + "---:|" * (len(kernel_profile.KINDS) + 2))
    for r in rows:
        k = r["kernels"]
        print(f"| {r['config']} | {r['layout']} | {100 * r['predicted_matmul_share']:.0f}% | "
              + " | ".join(f"{100 * k['share'][name]:.0f}%" for name in kernel_profile.KINDS)
              + f" | {100 * k['collective']:.0f}% | {k['kernels_per_step']:,.0f} |")


def calibrated(measured, name: str, tmp: str) -> tuple[str, float]:
    """A topology file: this machine's sweep with `name`'s own reference step on top, as `python -m train.plan
    --calibrate` writes for one config. Taken just before the config's layouts run, so both see the machine in
    the same state (a VM's speed drifts over minutes)."""
    config = _config(name, {}, None, FLAGS.topology)
    cfg, batch = models.from_dict(config.model.to_dict()), int(config.train.global_batch_size)
    topo = calibrate.with_step(measured, cfg, batch)
    path = pathlib.Path(tmp) / f"{name}.json"
    calibrate.save(topo, path, "experiments.plan_vs_measured", cfg, batch)
    return str(path), topo.step_overhead


def main(argv) -> None:
    del argv
    unknown = sorted(set(FLAGS.configs) - {x[0] for x in LAYOUTS})
    if unknown:
        print(f"error: --configs={','.join(FLAGS.configs)}: no layouts for {', '.join(unknown)}; use "
              f"{', '.join(dict.fromkeys(x[0] for x in LAYOUTS))}", file=sys.stderr)
        sys.exit(exit_codes.USER_ERROR)
    use_cpu_devices(8)
    measured = calibrate.measure(FLAGS.topology, "float32")
    device = jax.devices()[0]
    print(f"# {device.platform} x {jax.device_count()}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}, "
          f"links {FLAGS.topology}, calibrated {measured.hbm_gbps} GB/s per device")
    print("| config | layout | predicted ms | measured ms | time error | predicted MiB | compiled MiB | "
          "memory error |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    rows, overheads = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in dict.fromkeys(x[0] for x in LAYOUTS if x[0] in FLAGS.configs):
            topology, overheads[name] = calibrated(measured, name, tmp)
            for _, mesh, extras in [x for x in LAYOUTS if x[0] == name]:
                r = row(name, mesh, extras, topology)
                rows.append(r)
                print(f"| {name} | {r['layout']} | {1e3 * r['predicted_s']:.1f} | {1e3 * r['measured_s']:.1f} | "
                      f"{100 * r['time_error']:+.0f}% | {r['predicted_bytes'] / 2**20:.1f} | "
                      f"{r['compiled_bytes'] / 2**20:.1f} | {100 * r['memory_error']:+.0f}% |", flush=True)
    s = summary(rows)
    s["step_overhead"] = overheads
    print("step_overhead (each config's reference step over its roofline): " +
          ", ".join(f"{name} {v:.2f}" for name, v in overheads.items()))
    print(f"{s['layouts']} layouts: median absolute time error {100 * s['median_abs_time_error']:.0f}% "
          f"({100 * s['median_abs_roofline_time_error']:.0f}% from the roofline alone, step_overhead 1), Spearman "
          f"{s['spearman']:.2f}, median absolute memory error {100 * s['median_abs_memory_error']:.0f}%")
    if FLAGS.profile:
        print_profiles(rows)
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump({"rows": rows, "summary": s}, f, indent=2)


if __name__ == "__main__":
    define_flags()
    cli.run(main)  # a bad flag or setting: one line, exit 2
