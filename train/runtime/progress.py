"""One progress line on stderr, rewritten in place: how much of a known total is done, the rate and the time left.
Quiet for the first seconds, so a short job (or one that fails early) prints only its own lines."""
from __future__ import annotations

import sys
import time


class ProgressLine:
    """`advance(n)` as work completes, `close()` at the end (the last figures, then a newline)."""

    def __init__(self, label: str, total: int, unit: str, every_s: float = 1.0, quiet_s: float = 2.0):
        self.label, self.total, self.unit = label, max(total, 1), unit
        self.every_s, self.done = every_s, 0
        self.t0 = time.perf_counter()
        self.shown = self.t0 + quiet_s - every_s  # the first line after quiet_s
        self.printed = False

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.shown >= self.every_s:
            self.shown = now
            self._show(now, end="")

    def close(self) -> None:
        if self.printed:
            self._show(time.perf_counter(), end="\n")

    def _show(self, now: float, end: str) -> None:
        elapsed = max(now - self.t0, 1e-9)
        rate = self.done / elapsed
        left = (self.total - self.done) / rate if rate else float("inf")
        eta = f"ETA {_duration(left)}" if self.done < self.total else f"done in {_duration(elapsed)}"
        print(f"\r{self.label}: {self.done:,}/{self.total:,} {self.unit} ({100 * self.done / self.total:.0f}%), "
              f"{rate:,.1f} {self.unit}/s, {eta}   ", end=end, file=sys.stderr, flush=True)
        self.printed = True


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
