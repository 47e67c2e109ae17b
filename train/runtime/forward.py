"""The launcher's copy of its processes' output: each line after its process's `[pN] `, an `error:` line once.

Every process of a run that fails on one cause (a bad setting, a failed save, a peer gone) prints the same
`error:` line; the user reads it once, without a prefix, as from a single-process run. Standard library only, so
tests import it without train.launch's flags."""
from __future__ import annotations

import threading


class Errors:
    """The `error:` lines already forwarded, shared by the forwarding threads of one launch."""

    def __init__(self):
        self.seen: set[str] = set()
        self._lock = threading.Lock()

    def first(self, line: str) -> bool:
        with self._lock:
            new = line not in self.seen
            self.seen.add(line)
            return new


def forward(stream, prefix: str, out, errors: Errors | None = None) -> None:
    """Copy `stream` to `out` line by line, each line after `prefix`; an `error:` line once across processes,
    without the prefix."""
    for line in iter(stream.readline, ""):
        if errors is not None and line.startswith("error: "):
            if errors.first(line):
                out.write(line)
                out.flush()
            continue
        out.write(f"{prefix}{line}")
        out.flush()
