"""Goodput across restarts: each attempt's wall time split into start-up (imports, device init, validation),
compilation, the memory check with the compile report, restore or init, checkpoint blocking (the final
save's wait apart), evaluation and steps recomputed after a failure, with the saves that failed (step and
cause), kept in DIR/goodput.json.
The file is rewritten atomically as the run goes, so a killed attempt keeps what it last recorded."""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import sys
import time
from typing import Any

PARTS = ("startup_s", "compile_s", "memory_check_s", "restore_s", "init_s", "checkpoint_blocked_s",
         "final_save_wait_s", "eval_s", "productive_s", "recomputed_s")


def process_start_time() -> float:
    """When this process started (Unix time), so imports and backend startup count too (Linux; else now)."""
    try:
        ticks = int(pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(pathlib.Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


def earlier_attempts(path: pathlib.Path) -> list[dict[str, Any]]:
    """The attempts goodput.json records; a damaged file is a record lost, never a reason to stop the run."""
    if not path.exists():
        return []
    try:
        attempts = json.loads(path.read_text()).get("attempts", [])
        if isinstance(attempts, list) and all(isinstance(a, dict) for a in attempts):
            return attempts
    except (OSError, ValueError, AttributeError):
        pass
    print(f"warning: {path} is damaged; its earlier attempts are left out of the goodput, which starts anew "
          f"with this one", file=sys.stderr, flush=True)
    return []


class Goodput:
    def __init__(self, workdir: pathlib.Path, enabled: bool = True):
        self.path = workdir / "goodput.json"
        self.enabled = enabled
        self.started = process_start_time()
        self.attempts: list[dict[str, Any]] = earlier_attempts(self.path)
        # Steps an earlier attempt completed: running them again is recomputation.
        self.done_before = max([a.get("last_step") or 0 for a in self.attempts], default=0)
        self.now: dict[str, Any] = {
            "started": datetime.datetime.fromtimestamp(self.started, datetime.timezone.utc).isoformat(),
            "wall_s": 0.0, **{p: 0.0 for p in PARTS}, "recomputed_steps": 0, "first_step": None,
            "last_step": None, "exit_status": None, "failed_saves": []}
        self.now["startup_s"] = max(0.0, time.time() - self.started)  # the process's life before this run's parts

    def add(self, part: str, seconds: float) -> None:
        self.now[part] += seconds

    def failed_save(self, step: int | None, error: str) -> None:
        self.now["failed_saves"].append({"step": step, "error": error})

    def step(self, step: int, seconds: float) -> None:
        recomputed = step <= self.done_before
        self.now["recomputed_s" if recomputed else "productive_s"] += seconds
        self.now["recomputed_steps"] += int(recomputed)
        self.now["first_step"] = self.now["first_step"] or step
        self.now["last_step"] = step

    def totals(self) -> dict[str, Any]:
        runs = self.attempts + [self.now]
        out = {p: round(sum(a.get(p, 0.0) for a in runs), 3) for p in ("wall_s",) + PARTS}  # older files lack some
        out["attempts"] = len(runs)
        out["failed_saves"] = sum(len(a.get("failed_saves", [])) for a in runs)
        out["goodput"] = round(out["productive_s"] / out["wall_s"], 4) if out["wall_s"] else 0.0
        return out

    def flush(self, exit_status: int | None = None) -> None:
        self.now["wall_s"] = time.time() - self.started
        self.now["exit_status"] = exit_status
        if not self.enabled:
            return
        record = {"totals": self.totals(), "attempts": self.attempts + [self.now]}
        tmp = self.path.with_suffix(f".json.tmp{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, self.path)

    def line(self) -> str:
        t = self.totals()
        other = t["wall_s"] - sum(t[p] for p in PARTS)
        return (f"goodput {100 * t['goodput']:.1f}% over {t['attempts']} attempt(s): "
                f"productive {t['productive_s']:.1f}s of {t['wall_s']:.1f}s wall; "
                f"start-up {t['startup_s']:.1f}s, compile {t['compile_s']:.1f}s, "
                f"memory check {t['memory_check_s']:.1f}s, restore {t['restore_s']:.1f}s, init {t['init_s']:.1f}s, "
                f"checkpoint blocking {t['checkpoint_blocked_s']:.2f}s (+{t['final_save_wait_s']:.2f}s final wait), "
                f"eval {t['eval_s']:.1f}s, recomputed {t['recomputed_s']:.1f}s, other {other:.1f}s"
                + (f"; {t['failed_saves']} failed save(s)" if t["failed_saves"] else ""))
