"""Where evaluation results go: `DIR/eval/step_N.json` (and --json), and the run's own loggers: a record in
metrics.jsonl tagged `"kind": "eval_harness"`, and TensorBoard or W&B when the run logged to them."""
from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import Any

from train.loop.metrics import LOGGERS, MetricsLog

KIND = "eval_harness"
KEPT = ("results", "groups", "versions", "n-shot", "n-samples", "higher_is_better")


def record(results: dict, step: int, tasks: tuple[str, ...], num_fewshot: int | None, limit: int | None) -> dict:
    """What the JSON files hold: the step, the request, and lm_eval's results without the per-example samples."""
    return {"step": step, "tasks": list(tasks), "num_fewshot": num_fewshot, "limit": limit,
            **{k: results[k] for k in KEPT if k in results}}


def scalars(results: dict) -> dict[str, float]:
    """{"eval_harness/TASK/METRIC": value} of every numeric metric (a filter other than `none` joins the name);
    standard errors stay in the JSON."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if "stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)) or not filt:
                continue
            out[f"{KIND}/{task}/{metric}" + ("" if filt == "none" else f"/{filt}")] = float(value)
    return out


def write(path: pathlib.Path, content: dict[str, Any]) -> None:
    """Through a temporary file of its own beside the file (a symlink's target), renamed over it, so a reader never
    sees half a file; what is not a regular file (a device, a pipe) is written through, never replaced."""
    text = json.dumps(content, indent=2, default=str) + "\n"
    path = path.resolve()
    if path.exists() and not path.is_file():
        path.write_text(text)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def log(workdir: pathlib.Path, config: Any, step: int, values: dict[str, float]) -> None:
    """One record in the run's metrics.jsonl and its loggers, at the checkpoint's step."""
    loggers = tuple(n for n in str(config.train.loggers).split(",") if n.strip() in LOGGERS)
    metrics = MetricsLog(workdir, total_steps=step, loggers=loggers, run_config=config.to_dict())
    try:
        metrics.write({"step": step, "kind": KIND, **values})
    finally:
        metrics.close()
