"""A thread that ends a hung run: when no step completes within `timeout_s` of the last one (counted
from the first completed step, so compilation is never a hang), it prints every thread's stack and
exits with `status`, so a supervisor restarts the job instead of waiting forever."""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Callable


class Watchdog:
    def __init__(self, timeout_s: float, status: int, before_exit: Callable[[], None] | None = None):
        self.timeout_s = float(timeout_s)
        self.status = status
        self.before_exit = before_exit  # e.g. record goodput: the main thread is stuck
        self._last = 0.0
        self._what = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def kick(self, what: str) -> None:
        """Progress was made (`what`, e.g. 'step 12'); the first call arms the watchdog."""
        self._last, self._what = time.monotonic(), what
        if self._thread is None and self.timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
            self._thread.start()

    def __enter__(self) -> "Watchdog":
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(self.timeout_s / 4, 5.0)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        sys.stderr.write(f"\nwatchdog: no progress for {idle:.0f}s since {self._what} (train.step_timeout_s="
                         f"{self.timeout_s:g}); stacks of all threads follow, then exit status {self.status}\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.before_exit:
            try:
                self.before_exit()
            except Exception as e:  # noqa: BLE001  (exiting matters more)
                sys.stderr.write(f"watchdog: {e}\n")
        sys.stderr.write(f"watchdog: exiting with status {self.status} (hang after {self._what})\n")
        sys.stderr.flush()
        os._exit(self.status)
