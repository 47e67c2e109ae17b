"""The mixture of experts' dispatch and combine all-to-alls: bytes per step by construction (sharding/expected.py)
and as compiled (the audit), the cost model's time for them on a `dgx-h100` host, and one all-to-all of that
size measured on this machine's devices beside the fitted `local` topology's prediction.

    python -m experiments.bench_moe --num_cpu_devices=8 --layouts='expert=8,expert=4;data=2,expert=2;data=2;tensor=2'
    python -m experiments.bench_moe --presets=mixtral-8x7b --layouts=expert=8 --capacity_factors=0,1.25 --batch=8
"""
from __future__ import annotations

import importlib
import time

import jax
from absl import flags

import models
from mesh import (
    bench,  # defines --num_cpu_devices (and the sweep's flags), shared here
    cost,
    topology,
    use_cpu_devices,
)
from mesh.errors import UserError
from train import cli
from train.plan import audit
from train.plan import compile_report as report
from train.trainer import Trainer

_PRESETS = flags.DEFINE_list("presets", ["moe-tiny"], "Mixture-of-experts presets, on experiments/tiny.py's settings.")
_LAYOUTS = flags.DEFINE_list("layouts", ["expert=8", "expert=4;data=2", "expert=2;data=2;tensor=2"],
                             "Meshes over every device, axes separated by ';'.")
_CAPACITY = flags.DEFINE_list("capacity_factors", ["0"], "model.capacity_factor values (0: dropless).")
_BATCH = flags.DEFINE_integer("batch", 16, "Global batch (rows).")
_MEASURE_MAX = flags.DEFINE_integer("measure_max_mb", 16, "Measure one all-to-all locally only up to this S (MB).")


def _trainer(preset: str, layout: dict[str, int], capacity_factor: float):
    config = importlib.import_module("experiments.tiny").get_config()
    config.model.update(preset=preset, capacity_factor=capacity_factor)
    config.data.source = "synthetic"
    config.train.update(global_batch_size=_BATCH.value, memory_check=False)
    config.mesh.update({"data": 1, **layout})
    return Trainer.build(config)


def row(preset: str, layout: dict[str, int], capacity_factor: float) -> dict:
    """Construction, compiled, dgx-h100 and local figures of one layout's all-to-alls."""
    trainer = _trainer(preset, layout, capacity_factor)
    rep = report.build(trainer.plan, trainer.mesh, trainer.compile())
    rows = audit.audit(trainer, rep, "", "", 1, 0.4)["rows"]
    a2a = next(r for r in rows if r["op"] == "all_to_all" and r["purpose"] != "unexpected")
    records = [r for r in rep["collectives"] if r["op"] == "all_to_all" and r["axes"] == ["expert"]]
    ops = sum(r["count"] for r in records)
    per_op = a2a["expected_bytes"] / ops  # the construction's S, in the compute dtype
    sizes = trainer.plan.mesh_sizes
    dgx = cost.predict_us("all_to_all", per_op, ["expert"], sizes, topology.get_topology("dgx-h100", hosts=1))
    out = {"preset": preset, "capacity_factor": capacity_factor,
           "layout": ",".join(f"{a}={s}" for a, s in sizes.items() if s > 1), "ops": ops, "per_op_mb": per_op / 1e6,
           "expected_mb": a2a["expected_bytes"] / 1e6, "found_mb": a2a["found_bytes"] / 1e6, "ratio": a2a["ratio"],
           "dgx_us_per_step": dgx * ops, "measured_us": None, "local_us": None}
    if per_op <= _MEASURE_MAX.value * 1e6:
        found_s = a2a["found_bytes"] / ops  # what this backend moves (XLA:CPU sends bfloat16 as float32)
        measured = [r for r in bench.sweep(trainer.mesh, [int(found_s)], ["all_to_all"]) if r["axis"] == "expert"]
        bench.predict(measured, sizes, topology.get_topology("local"))
        out.update(measured_us=measured[0]["time_us"], local_us=measured[0]["predicted_us"])
    return out


def _us(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _check_presets() -> None:
    """Every --presets name a mixture of experts (a dense model has no all-to-all to measure), before any work."""
    mixtures = [n for n in models.PRESETS if models.from_dict({"preset": n}).n_experts > 0]
    wrong = [p for p in _PRESETS.value if p not in mixtures]
    if wrong:
        raise UserError(f"--presets={','.join(_PRESETS.value)}: {', '.join(wrong)}: not a mixture-of-experts preset; "
                        f"use some of {', '.join(mixtures)}")


def main(argv):
    del argv
    _check_presets()
    use_cpu_devices(flags.FLAGS.num_cpu_devices or 8)
    device = jax.devices()[0]
    print(f"# {device.platform} ({device.device_kind}) x {jax.device_count()}, jax {jax.__version__}, "
          f"{time.strftime('%Y-%m-%d')}, global batch {_BATCH.value}")
    print("| preset | capacity factor | layout | all-to-alls/step | S per op MB | expected MB/step | found MB/step | "
          "ratio | dgx-h100 predicted us/step | one all-to-all here: measured us | local model us |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for preset in _PRESETS.value:
        for cf in _CAPACITY.value:
            for text in _LAYOUTS.value:
                layout = {k: int(v) for k, v in (kv.split("=") for kv in text.split(";"))}
                r = row(preset, layout, float(cf))
                print(f"| {r['preset']} | {r['capacity_factor']:g} | {r['layout']} | {r['ops']:.0f} | "
                      f"{r['per_op_mb']:,.2f} | {r['expected_mb']:,.1f} | {r['found_mb']:,.1f} | {r['ratio']:.2f} | "
                      f"{_us(r['dgx_us_per_step'])} | {_us(r['measured_us'])} | {_us(r['local_us'])} |", flush=True)


if __name__ == "__main__":
    cli.run(main)  # a bad flag or setting: one line, exit 2
