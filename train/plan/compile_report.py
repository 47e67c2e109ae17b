"""`compile_report.json`: what the compiled step will cost before it runs: mesh, parameter bytes,
analytic FLOPs, per-device memory from XLA's buffer assignment, and the collectives in the HLO.
Audit part (the compile report that carries the found collectives); train/plan/audit.py maps the parts of `--audit`.
"""
from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import jax

import models
from mesh import hlo
from mesh.layout import axis_sizes
from sharding import pipeline as pipeline_lib
from sharding import schedules
from train.config.experiment import Plan


def memory_per_device(compiled) -> dict[str, int]:
    ma = compiled.memory_analysis()
    out = {
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "alias_bytes": int(ma.alias_size_in_bytes),
        "temp_bytes": int(ma.temp_size_in_bytes),
    }
    peak = int(getattr(ma, "peak_memory_in_bytes", 0) or 0)
    # Donated outputs reuse their arguments' buffers, so they are not counted twice.
    out["peak_bytes"] = peak or (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"])
    return out


def param_bytes(plan: Plan) -> int:
    """Global (unsharded) bytes of all parameters in the parameter dtype."""
    abstract, _ = models.abstract_params(plan.model)
    return int(sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(abstract)))


def build(plan: Plan, mesh: jax.sharding.Mesh, compiled, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    tokens = plan.global_batch * plan.model.seq_len
    report = {
        "mesh": axis_sizes(mesh),
        "param_count": models.param_count(plan.model),
        "param_bytes": param_bytes(plan),
        "tokens_per_step": tokens,
        "flops_per_step": models.flops_per_token(plan.model) * tokens,
        "memory_per_device": memory_per_device(compiled),
        "collectives": hlo.collectives(compiled.as_text(), mesh),
    }
    if plan.pipeline:
        report["pipeline"] = pipeline_summary(plan)
    report.update(extra or {})
    return report


def pipeline_summary(plan: Plan) -> dict[str, Any] | None:
    """The schedule's shape and its bubble: idle cells of the table (equal to the paper's closed form)."""
    if not plan.pipeline:
        return None
    table = plan.pipeline.build()
    return {"schedule": table.name, "stages": table.stages, "microbatches": table.microbatches,
            "virtual_stages": table.virtual_stages, "slots": table.num_slots,
            "bubble_fraction": schedules.bubble_fraction(table),
            "closed_form_bubble": schedules.closed_form_bubble(table.name, table.stages, table.microbatches,
                                                               table.virtual_stages),
            "max_in_flight": [int(n) for n in schedules.max_in_flight(table)],
            "fsdp_gather": pipeline_lib.FSDP_GATHER}


def pipeline_line(plan: Plan) -> str:
    """'; pipeline 1f1b p=2 m=8 v=1, bubble 11.1%' for the start-of-run log line ('' without a pipeline)."""
    info = pipeline_summary(plan)
    if not info:
        return ""
    return (f"; pipeline {info['schedule']} p={info['stages']} m={info['microbatches']} "
            f"v={info['virtual_stages']}, bubble {100 * info['bubble_fraction']:.1f}%")


def write(report: dict[str, Any], workdir: pathlib.Path) -> pathlib.Path:
    path = workdir / "compile_report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
