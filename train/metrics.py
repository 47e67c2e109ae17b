"""Where a run's numbers go: `metrics.jsonl` (one JSON object per record), TensorBoard event files and
a live progress line. Only process 0 writes; the others keep quiet."""
from __future__ import annotations

import json
import math
import pathlib
import sys
from typing import Any

import jax


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class MetricsLog:
    def __init__(self, workdir: pathlib.Path, total_steps: int, purge_step: int | None = None):
        """`purge_step`: a resumed run's first step; TensorBoard drops events of that step and later
        that the interrupted run had written."""
        self.enabled = jax.process_index() == 0
        self.total_steps = total_steps
        self.live = sys.stdout.isatty()
        self._jsonl = self._tb = None
        if self.enabled:
            self._jsonl = open(workdir / "metrics.jsonl", "a", buffering=1)
            from tensorboardX import SummaryWriter  # imported late: it is slow to import
            self._tb = SummaryWriter(str(workdir / "tensorboard"), purge_step=purge_step)

    def write(self, record: dict[str, Any]) -> None:
        """One record: `step` plus scalars. Written at once, so a crash loses nothing logged."""
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self._tb.add_scalar(key, value, record["step"])

    def progress(self, step: int, loss: float, tokens_per_s: float, mfu: float, seconds_left: float) -> None:
        if not self.enabled:
            return
        line = (f"step {step}/{self.total_steps} | loss {loss:.4f} | {tokens_per_s / 1e3:,.1f}k tok/s | "
                f"MFU {100 * mfu:.1f}% | ETA {_fmt_duration(seconds_left)}")
        if self.live:
            print("\r" + line.ljust(100), end="" if step < self.total_steps else "\n", flush=True)
        else:
            print(line, flush=True)

    def message(self, text: str) -> None:
        if self.enabled:
            print(("\n" if self.live else "") + text, flush=True)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
            self._tb.close()
