"""Preemption. SIGTERM or a first SIGINT asks the run to stop after the step in flight and save it; a
second SIGINT kills the process at once; SIGUSR1 asks for a save after the step in flight, and training goes
on. Host-side decisions (stop, a save is wished: time-based or SIGUSR1) are made identical on every process
by a max over processes of each one's flags, dispatched after a step and read one step later like the
metrics: all processes act at the same step, with no extra barrier. This needs no `jax.distributed`
preemption service: one process skips the collective altogether."""
from __future__ import annotations

import os
import signal
import threading
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from train.runtime import console


class StopSignals:
    """Context manager: installs the SIGTERM/SIGINT/SIGUSR1 handlers (main thread only) and restores the old ones."""

    def __init__(self, enabled: bool = True):
        self.requested = threading.Event()
        self.save_now = threading.Event()  # SIGUSR1: save after the step in flight, then go on
        self.enabled = enabled
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if self.enabled and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
            self._previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._save)
        return self

    def take_save_request(self) -> bool:
        """Whether SIGUSR1 came since the last call (each request is posted once)."""
        asked = self.save_now.is_set()
        self.save_now.clear()
        return asked

    def _save(self, signum: int, frame) -> None:
        if not self.save_now.is_set():
            os.write(console.fd(), b"\nSIGUSR1: saving a checkpoint after the step in flight; training goes on\n")
        self.save_now.set()

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C kills at once, even mid-call
        if not self.requested.is_set():
            # os.write, not print: a handler may interrupt a print on the main thread.
            again = " (Ctrl-C again aborts at once)" if signum == signal.SIGINT else ""
            os.write(console.fd(), f"\n{name}: finishing the step in flight, saving a checkpoint, then exiting with "
                                   f"status 75{again}\n".encode())
        self.requested.set()


class Agreement:
    """post(flags) after dispatching a step, read(handle) when that step's metrics are fetched: the
    element-wise OR of every process's flags, the same on all of them."""

    def __init__(self, collective: bool | None = None):
        self.collective = jax.process_count() > 1 if collective is None else collective
        if self.collective:
            devices = np.asarray(jax.devices())
            mesh = Mesh(devices, ("all",))
            self._rows = NamedSharding(mesh, P("all"))  # one row of flags per device
            self._any = jax.jit(lambda flags: jnp.max(flags, axis=0), out_shardings=NamedSharding(mesh, P()))

    def post(self, flags: Sequence[bool]) -> Any:
        if not self.collective:
            return tuple(bool(f) for f in flags)
        local = np.asarray([flags], np.int32)
        rows = jax.make_array_from_callback((jax.device_count(), len(flags)), self._rows, lambda index: local)
        return self._any(rows)

    def read(self, handle: Any) -> tuple[bool, ...]:
        if not self.collective:
            return handle
        return tuple(bool(v) for v in np.asarray(handle))
