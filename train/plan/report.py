"""The planner's printed answer: a ranked table, where the best layout's time and memory go and why it beats
the runner-up, the flags that run it, and the checkpoint cadence."""
from __future__ import annotations

import pathlib
import shlex
from typing import Any, Mapping

import models
from models import paged
from train.plan.candidate import Prediction

# What the chosen layout sets (Candidate.overrides), so the user's own values for them are not repeated.
LAYOUT_KEYS = ("mesh.", "pipeline.", "sharding.strategy", "sharding.shard_opt_state", "model.remat",
               "train.grad_accum_steps", "plan.")


def mesh_text(sizes: dict[str, int]) -> str:
    return " x ".join(f"{a}={s}" for a, s in sizes.items() if s > 1) or "one device"


def knobs(p: Prediction) -> str:
    c = p.candidate
    pipe = f"{c.schedule} m={c.microbatches} v={c.virtual_stages}" if c.sizes["pipeline"] > 1 else "-"
    return f"{pipe} | {c.remat} | {'yes' if c.shard_opt_state else 'no'} | {c.grad_accum_steps}"


def table(ranked: list[Prediction], top: int) -> str:
    lines = ["| # | mesh | pipeline | remat | shard opt | accum | GB/device | step s | TFLOP/s/device | MFU "
             "| tokens/s |",
             "|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for i, p in enumerate([p for p in ranked if p.fits][:top], 1):
        lines.append(f"| {i} | {mesh_text(p.candidate.sizes)} | {knobs(p)} | {p.memory['total'] / 1e9:,.1f} | "
                     f"{p.step_time_s:.4g} | {p.tflops_per_device:,.1f} | {100 * p.mfu:.1f}% | {p.tokens_per_s:,.0f} |")
    return "\n".join(lines)


def run_line(config_file: str, overrides: Mapping[str, Any], best: Prediction, auto: bool) -> str:
    """`python -m train` with the user's --config file and own overrides (those the layout does not set), then
    the chosen layout's (and plan.auto off if the file turns it on), and a fresh --workdir named after the file
    (never a run that exists, such as make train's runs/default), shell-quoted, so the line runs as printed."""
    own = [f"--config.{k}={v}" for k, v in overrides.items() if not k.startswith(LAYOUT_KEYS)]
    workdir = f"--workdir={fresh_workdir(pathlib.Path(config_file.split(':', 1)[0]).stem + '-planned')}"
    words = ["python", "-m", "train", f"--config={config_file}", *own, *best.candidate.overrides(), workdir]
    return "run it: " + " ".join(shlex.quote(w) for w in words + ["--config.plan.auto=False"] * auto)


def kv_cache(cfg: models.ModelConfig) -> str:
    """The KV cache a served sequence of the model's seq_len holds (models/paged.cache_bytes), and what its sliding
    layers save, or '' for a family that does not decode."""
    if models.family_of(cfg).block is None:
        return ""
    kv = models.family_of(cfg).parallel.kv_heads(cfg)
    held, whole = (paged.cache_bytes(cfg, cfg.seq_len, kv, windows) for windows in (True, False))
    sliding = sum(1 for s in models.layer_specs(cfg) if s.window)
    saved = f" ({sliding} sliding layers hold their window: {whole / 2 ** 20:,.1f} MiB without)" if sliding else ""
    return f"serving: KV cache {held / 2 ** 20:,.1f} MiB per sequence of {cfg.seq_len:,} tokens{saved}"


def fresh_workdir(name: str) -> str:
    """runs/NAME, or runs/NAME-2, -3, ... : the first that does not exist yet."""
    candidates = (f"runs/{name}" + (f"-{i}" if i > 1 else "") for i in range(1, 1000))
    return next(c for c in candidates if not pathlib.Path(c).exists())


def _parts(by_part: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3g}" for k, v in by_part.items() if v) or "no hbm_gbps in the topology"


def breakdown(best: Prediction, runner_up: Prediction | None) -> str:
    m = best.memory
    lines = [f"best: {mesh_text(best.candidate.sizes)}, {knobs(best).replace(' | ', ', ')}",
             f"  time  {best.step_time_s:.4g} s = matmuls {best.compute_s:.4g} + memory-bound "
             f"{best.memory_bound_s:.4g} ({_parts(best.memory_bound_by_part)}) + exposed communication "
             f"{best.communication_s:.4g} (of {best.communication_total_s:.4g}) + bubble {best.bubble_s:.4g}",
             "  memory " + ", ".join(f"{k} {v / 1e9:,.2f}" for k, v in m.items() if k != "total")
             + f" = {m['total'] / 1e9:,.2f} GB per device"]
    for purpose, s in sorted(best.comm_by_purpose.items(), key=lambda x: -x[1]):
        if s > 0:
            lines.append(f"  comm  {purpose}: {s:.4g} s (before overlap)")
    if runner_up is not None:
        diffs = {"matmuls": best.compute_s - runner_up.compute_s,
                 "memory-bound work": best.memory_bound_s - runner_up.memory_bound_s,
                 "exposed communication": best.communication_s - runner_up.communication_s,
                 "bubble": best.bubble_s - runner_up.bubble_s}
        why = min(diffs, key=diffs.get)
        lines.append(f"runner-up: {mesh_text(runner_up.candidate.sizes)}, {knobs(runner_up).replace(' | ', ', ')}: "
                     f"{runner_up.step_time_s:.4g} s; the best saves most on {why} "
                     f"({-diffs[why]:.3g} s), memory {m['total'] / 1e9:,.1f} vs "
                     f"{runner_up.memory['total'] / 1e9:,.1f} GB")
    return "\n".join(lines)
