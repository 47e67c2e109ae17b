"""One run per workdir: `DIR/.lock` names its holder (host, pid, start time) and a heartbeat (its mtime, touched
every HEARTBEAT_S). A second run on the directory stops at once naming the holder; a lock whose holder is gone
(same host: the pid is dead; any host: no heartbeat for STALE_AFTER_S) is taken over with one warning line.

Process 0 of a multi-process run holds the lock for all of them. `filelock` would serialize processes on one
host, but names no holder and cannot tell a dead holder on another host from a live one, hence this file.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import socket
import threading
import time
import uuid
from typing import Any, Callable

from mesh.errors import UserError

NAME = ".lock"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 120.0  # no heartbeat for this long: the holder is gone (a host down, a process frozen)


class WorkdirInUse(UserError):
    """Another live run holds the workdir."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:  # a killed process its parent has not reaped yet still answers kill(0): a zombie runs nothing
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (macOS): trust kill(0)


def _read(path: pathlib.Path) -> tuple[dict[str, Any], float] | None:
    """(the holder's record, seconds since its heartbeat), or None when there is no lock."""
    try:
        age = time.time() - path.stat().st_mtime
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        holder = {}  # torn by a crash while it was written: nobody can be holding it
    return (holder if isinstance(holder, dict) else {}), age


def gone_because(holder: dict[str, Any], age_s: float, host: str | None = None,
                 pid: int | None = None) -> str | None:
    """Why the lock's holder can no longer be running (None: it may be); `host`, `pid`: this process's."""
    host, pid = host or socket.gethostname(), pid or os.getpid()
    if "pid" not in holder:  # torn by a crash, unless a taker is writing it right now
        return "the lock file is unreadable" if age_s > 5 else None
    if age_s > STALE_AFTER_S:
        return f"no heartbeat for {age_s:.0f}s"
    if holder.get("host") == host:
        if holder["pid"] == pid:
            return f"pid {pid} is this process (a restart)"
        if not _pid_alive(int(holder["pid"])):
            return f"pid {holder['pid']} is not running"
    return None


def _in_use(workdir: pathlib.Path, holder: dict[str, Any], age: float) -> str:
    return (f"--workdir={workdir} is in use by another run ({describe(holder)}, heartbeat {age:.0f}s ago); wait "
            f"for it to end, stop it, or choose another --workdir")


def check_free(workdir: str | pathlib.Path) -> None:
    """Raise WorkdirInUse when a live run holds `workdir`; takes nothing (a launcher's check before it starts
    processes: their process 0 takes the lock)."""
    path = pathlib.Path(workdir).expanduser()
    found = _read(path / NAME)
    if found is not None and gone_because(*found) is None:
        raise WorkdirInUse(_in_use(path, *found))


def describe(holder: dict[str, Any]) -> str:
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {holder.get('started', '?')}, "
            f"{holder.get('processes', 1)} process(es)")


class WorkdirLock:
    """Held from acquire() to release(); a daemon thread keeps the heartbeat while held."""

    def __init__(self, workdir: pathlib.Path, processes: int = 1):
        self.path = pathlib.Path(workdir) / NAME
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "processes": processes,
                       "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "token": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, warn: Callable[[str], None]) -> None:
        """Take the lock, or raise WorkdirInUse naming the holder; a gone holder's lock is taken over."""
        for _ in range(3):  # a takeover races at most with another taker; the loser sees the winner's record
            if self._create():
                self._thread = threading.Thread(target=self._beat, daemon=True, name="workdir-lock")
                self._thread.start()
                return
            found = _read(self.path)
            if found is None:
                continue  # released meanwhile
            holder, age = found
            why = gone_because(holder, age)
            if why is None:
                raise WorkdirInUse(_in_use(self.path.parent, holder, age))
            warn(f"warning: --workdir={self.path.parent}: taking over the lock of a run that is gone "
                 f"({describe(holder)}: {why})")
            self._remove_if(holder.get("token"))
        raise WorkdirInUse(f"--workdir={self.path.parent}: could not take {self.path} (other runs keep taking it); "
                           f"make sure one run uses this directory")

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.record, f)
        return True

    def _remove_if(self, token: str | None) -> None:
        """Remove the lock file if it still holds `token` (so a lock just taken by another run stays)."""
        found = _read(self.path)
        if found is not None and found[0].get("token") == token:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass  # the directory went away: the run will fail on its own writes

    def release(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._remove_if(self.record["token"])

    def __enter__(self) -> WorkdirLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
