"""Communication audit of the compiled step: the collectives XLA emitted (mesh.hlo) against those the
layout needs by construction (sharding.expected), with anything unexpected flagged, then the predicted
communication time per axis on a chosen cluster (mesh.cost) against the step's compute time.

The audit's parts stay where the import rule puts them, each naming its part in its docstring:
mesh/hlo.py (what XLA emitted), sharding/expected.py (what the layout must communicate: it knows the
model and the strategy), mesh/placement.py and mesh/cost.py (where each axis's traffic travels, what it
costs), mesh/chips.py (the compute side's peak), train/plan/compile_report.py (the compile report carrying the found
collectives) and this module, which joins them.
"""
from __future__ import annotations

import contextlib
import math
import os
import tempfile
from typing import Any

import jax
import numpy as np

import models
from mesh import chips, cost, placement
from mesh import topology as topology_lib
from models.stack import KINDS_SCOPE
from sharding import slot_program
from sharding.expected import expected_traffic
from train.config.experiment import ConfigError

REMAT_WARNING = "Involuntary full rematerialization"
TOLERANCE = 0.05
# The accelerator of each topology preset, as JAX names it: its bf16 peak (mesh/chips.py) gives the
# compute side of the projection.
PRESET_DEVICE_KIND = {"dgx-h100": "NVIDIA H100 80GB HBM3", "dgx-a100": "NVIDIA A100-SXM4-80GB",
                      "tpu-v5p": "TPU v5", "tpu-v5e": "TPU v5 lite"}


@contextlib.contextmanager
def _stderr_to(path: str):
    """Redirect file descriptor 2 (where XLA's C++ logging goes) into `path`."""
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def compile_logged(compile_fn) -> tuple[Any, str]:
    """Run `compile_fn()` with XLA's log captured; the persistent cache is bypassed, since a cache hit
    skips the partitioner and with it the warnings we look for."""
    previous = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
        try:
            with _stderr_to(log.name):
                compiled = compile_fn()
        finally:
            jax.config.update("jax_enable_compilation_cache", previous)
        text = log.read()
    os.write(2, "".join(l + "\n" for l in text.splitlines() if REMAT_WARNING not in l).encode())
    return compiled, text


def weigh_branches(records: list[dict], slot_counts, slots: int) -> list[dict]:
    """Records of the pipeline's slot switch counted by how often a device really runs their branch.

    mesh.hlo counts a collective inside a `lax.switch` branch on every trip of the slot loop (an upper
    bound). `slot_counts` (int [stages, branches], sharding.slot_program.branch_slot_counts) says in how many
    of the `slots` trips each stage runs each branch; a record's count becomes its count per trip times
    the mean over stages. The mean, not the busiest stage, because rows are per-device bytes that sum
    over the devices to the axis's traffic, the figure the expectations state and the projection costs;
    stages differ only in the embedding's (first stage) and the head's (last stage) collectives, the
    layers' being the same on every stage.
    A record belongs to the slot switch when its conditional has that many branches and runs a multiple
    of `slots` times a step (gradient accumulation repeats the loop); anything else (an unrolled slot
    loop, a conditional nested in a cell) keeps its upper bound and its row says so.
    """
    slot_counts = np.asarray(slot_counts)
    share = slot_counts.mean(axis=0) / slots  # per branch: the fraction of trips a device runs it
    out = []
    for r in records:
        outer = (r.get("branch") or [None])[0]
        sends = slot_program.send_channel(r.get("op_name", ""))  # a send switch's permute: weigh_sends
        if (not sends and outer and len(r["branch"]) == 1 and outer["index"] is not None
                and outer["count"] % slots == 0 and outer["branches"] == slot_counts.shape[1]):
            r = dict(r, count=r["count"] * float(share[outer["index"]]), exact=r.get("trips_known", True))
        out.append(r)
    return out


def weigh_layer_kinds(records: list[dict], shares: list[float]) -> list[dict]:
    """Records inside the switch between a model's attention windows (models/stack.KINDS_SCOPE, one branch per
    window) counted as the layers really take it: mesh.hlo counts each branch on every layer, and branch i runs
    in `shares[i]` of them (the layers of that window, models/layer_spec.py). The switch then leaves the record's
    branch path, so an enclosing pipeline switch is weighed as usual (weigh_branches)."""
    out = []
    for r in records:
        inner = (r.get("branch") or [None])[-1]
        if (inner and KINDS_SCOPE in inner.get("op_name", "") and inner["index"] is not None
                and inner["branches"] == len(shares)):
            rest = r["branch"][:-1]
            r = dict(r, count=r["count"] * shares[inner["index"]], branch=rest,
                     exact=r.get("trips_known", True) and not rest)
        out.append(r)
    return out


def window_shares(cfg) -> list[float]:
    """Per distinct attention window (sorted, as models/stack.AttentionHalves switches), its share of the layers."""
    windows = [s.window for s in models.layer_specs(cfg)]
    return [windows.count(w) / len(windows) for w in sorted(set(windows))]


def weigh_sends(records: list[dict], send_counts: dict, slots: int, devices: int) -> list[dict]:
    """Permutes of the pipeline's send switches counted as the devices really send them.

    Each channel's switch (sharding.slot_program.send_patterns, named after the channel in the op_name) takes its
    branch i in `send_counts[channel][i]` of the `slots` trips, and that branch's permute sends from `senders`
    of the mesh's `devices` (its pairs); a record's count becomes its count per trip times both shares: the mean
    over the devices of what each sends, as weigh_branches counts the cells' collectives. A record that cannot
    be placed (nested deeper, an index XLA renumbered) keeps its upper bound and its row says so.
    """
    out = []
    for r in records:
        channel = slot_program.send_channel(r.get("op_name", ""))
        outer = (r.get("branch") or [None])[0]
        taken = send_counts.get(channel)
        if (taken is not None and r["op"] == "collective_permute" and outer and len(r["branch"]) == 1
                and outer["index"] is not None and outer["count"] % slots == 0 and outer["branches"] == len(taken)):
            share = taken[outer["index"]] / slots * r["senders"] / devices
            r = dict(r, count=r["count"] * float(share), exact=r.get("trips_known", True))
        out.append(r)
    return out


def attribute(records: list[dict], expected: list, sizes: dict[str, int]) -> list[dict]:
    """One row per expected collective and per unexpected one, with found bytes and flags.

    A record counts towards the row of its op and exact axes. Otherwise, an all-reduce over (data, fsdp)
    where the layout reduce-scatters over fsdp and all-reduces over data counts as both: S towards the
    fsdp reduce-scatter, S / |fsdp| towards the data all-reduce. A row is exact when every record in it
    has an exact count (not an upper bound).
    """
    rows = {(e.op, e.axes): {"purpose": e.purpose, "op": e.op, "axes": list(e.axes), "expected_bytes": e.bytes,
                             "found_bytes": 0.0, "found_ops": set(), "exact": True, "notes": []} for e in expected}
    scalars = {"purpose": "scalars (loss, norms)", "op": "all_reduce", "axes": [], "expected_bytes": None,
               "found_bytes": 0.0, "found_ops": set(), "exact": True, "notes": []}

    def add(key, nbytes, found_op, exact):
        row = rows.setdefault(key, {"purpose": "unexpected", "op": key[0], "axes": list(key[1]), "expected_bytes": 0.0,
                                    "found_bytes": 0.0, "found_ops": set(), "exact": True, "notes": []})
        row["found_bytes"] += nbytes
        row["found_ops"].add(found_op)
        row["exact"] = row["exact"] and exact

    for r in records:
        if not r["axes"]:
            continue
        total, exact, key = r["bytes"] * r["count"], r.get("exact", True), (r["op"], tuple(r["axes"]))
        if r["scalar"]:
            scalars["found_bytes"] += total
            scalars["axes"] = sorted(set(scalars["axes"]) | set(r["axes"]))
            scalars["exact"] = scalars["exact"] and exact
            continue
        if r["op"] != "all_reduce" or key in rows:
            add(key, total, r["op"], exact)
            continue
        scattered = [a for a in r["axes"] if ("reduce_scatter", (a,)) in rows]
        rest = tuple(a for a in r["axes"] if a not in scattered)
        if len(scattered) == 1:
            add(("reduce_scatter", (scattered[0],)), total, "all_reduce", exact)
            total /= sizes[scattered[0]]
        if rest:
            add(("all_reduce", rest), total, "all_reduce", exact)
    return [_annotate(row) for row in list(rows.values()) + ([scalars] if scalars["found_bytes"] else [])]


def _annotate(row: dict) -> dict:
    """Add the ratio found/expected and the notes that explain a mismatch to one row of `attribute`."""
    exp, found = row["expected_bytes"], row["found_bytes"]
    row["ratio"] = found / exp if exp else None
    if row["purpose"] == "unexpected":
        row["notes"].append("resharding all-to-all" if row["op"] == "all_to_all" else "not required by the layout")
    elif exp is not None and abs(found / exp - 1) > TOLERANCE:
        row["notes"].append(f"{found / exp:.2f}x the bytes the layout needs"
                            + (" (repeated gathers)" if row["op"] == "all_gather" and found > exp else ""))
    if row["op"] == "reduce_scatter" and "all_reduce" in row["found_ops"]:
        row["notes"].append("all-reduce + slice where a reduce-scatter would do (2x bus traffic)")
    if not row["exact"]:
        row["notes"].append("count not exact (conditional branches counted on every trip, or a loop of "
                            "unknown trip count)")
    row["found_ops"] = sorted(row["found_ops"])
    return row


def project(records: list[dict], sizes: dict[str, int], topology_name: str, hosts: int,
            flops_per_device: float, mfu: float) -> dict[str, Any]:
    """Predicted communication per step on `hosts` hosts of a topology preset (or file), scaling the
    `data` axis to fill the cluster with the per-device work unchanged (weak scaling)."""
    topo = topology_lib.get_topology(topology_name, hosts=hosts)  # a TopologyError names --topology
    others = math.prod(s for a, s in sizes.items() if a != "data")
    if topo.num_devices % others:
        raise ConfigError(f"--hosts={hosts}: {topo.num_devices} devices cannot hold the non-data axes "
                          f"({others} devices per replica); change --hosts or the mesh")
    target = {**sizes, "data": topo.num_devices // others}
    per_axis = cost.time_by_axes(records, target, topo)
    peak = chips.peak_flops(PRESET_DEVICE_KIND.get(topology_name, ""), "bfloat16") or 0.0
    compute_us = flops_per_device / (peak * mfu) * 1e6 if peak else None
    return {"topology": topology_name, "hosts": hosts, "devices": topo.num_devices, "mesh": target,
            "warnings": placement.placement_warnings(target, topo),
            "links": {axis: p.level for axis, p in placement.axis_links(target, topo, warn=False).items()},
            "comm_us_per_axis": per_axis, "comm_us": sum(per_axis.values()), "mfu": mfu,
            "compute_us": compute_us}


def audit(trainer, report: dict, xla_log: str, topology: str, hosts: int, mfu: float) -> dict[str, Any]:
    layout, plan = trainer.layout, trainer.plan
    pipe = plan.pipeline
    expected = expected_traffic(plan.model, layout.abstract_state["params"], layout.param_specs, plan.rules,
                                plan.mesh_sizes, plan.global_batch,
                                {"schedule": pipe.schedule, "microbatches": pipe.microbatches,
                                 "virtual_stages": pipe.virtual_stages}
                                if pipe else None)
    records = weigh_layer_kinds(report["collectives"], window_shares(plan.model))
    if plan.pipeline:
        schedule = plan.pipeline.build()
        records = weigh_branches(records, slot_program.branch_slot_counts(schedule), schedule.num_slots)
        records = weigh_sends(records, slot_program.send_slot_counts(schedule), schedule.num_slots,
                              math.prod(plan.mesh_sizes.values()))
    rows = attribute(records, expected, plan.mesh_sizes)
    remats = xla_log.count(REMAT_WARNING)
    result = {"rows": rows, "involuntary_rematerializations": remats}
    if topology:
        devices = math.prod(plan.mesh_sizes.values())
        result["projection"] = project(records, plan.mesh_sizes, topology, hosts,
                                       report["flops_per_step"] / devices, mfu)
    return result


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:,.2f}"


def format_table(result: dict[str, Any]) -> str:
    lines = ["| purpose | op | axes | expected MB | found MB | ratio | notes |", "|---|---|---|---:|---:|---:|---|"]
    for r in result["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"| {r['purpose']} | {r['op']} | {','.join(r['axes']) or '-'} | {_mb(r['expected_bytes'])} | "
                     f"{_mb(r['found_bytes'])} | {ratio} | {'; '.join(r['notes'])} |")
    if result["involuntary_rematerializations"]:
        lines.append(f"XLA: {result['involuntary_rematerializations']} involuntary full rematerialization(s)")
    proj = result.get("projection")
    if proj:
        mesh_text = " x ".join(f"{a}={s}" for a, s in proj["mesh"].items() if s > 1)
        lines += ["", f"on {proj['topology']} x {proj['hosts']} hosts ({proj['devices']} devices, mesh {mesh_text}):",
                  "| axes | link | predicted us/step |", "|---|---|---:|"]
        for axes, us in sorted(proj["comm_us_per_axis"].items()):
            link = "+".join(sorted({proj["links"].get(a, "?") for a in axes.split("+")}))
            lines.append(f"| {axes} | {link} | {us:,.1f} |")
        if proj["compute_us"]:
            lines.append(f"communication {proj['comm_us']:,.1f} us/step (not overlapped) vs compute "
                         f"{proj['compute_us']:,.1f} us/step at {100 * proj['mfu']:.0f}% MFU: ratio "
                         f"{proj['comm_us'] / proj['compute_us']:.2f}")
        lines += [f"warning: {w}" for w in proj["warnings"]]
    return "\n".join(lines)
