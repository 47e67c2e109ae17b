"""A run's console shows the project's own lines; what the libraries say goes to `WORKDIR/logs/process_N.log`.

capture() splits the process's two voices. File descriptors 1 and 2, where native code writes (XLA's and the
coordination service's C++ logging on 2, Gloo's "connected to N peer ranks" on 1, faulthandler's dumps), become a
pipe to a small relay process; so do the Python loggers (Orbax, absl, asyncio, jax), warnings and exceptions raised
in library threads. `sys.stdout` and `sys.stderr`, for the project's lines and for the traceback of a crash of the
project (the main thread), move to copies of the console's descriptors. The relay appends everything to the log
and, because a native abort leaves Python no chance to speak, turns a fatal native line (a peer that stopped sending
heartbeats, a failed check) into one `error:` line on the console. A separate process, not a thread: it outlives an
abort of the training process and drains the pipe.

Run as a script (`python -I -S console.py LOG PROCESS`: stdin the pipe, stdout the log) this file is the relay; it
imports only the standard library.
"""
from __future__ import annotations

import io
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import traceback

FATAL = re.compile(r"^F\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [^\]]*\] ?(.*)")  # absl's FATAL prefix: F1202 18:15:19.71 ...]
LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")
COORDINATION = "Terminating process because the JAX distributed service detected fatal errors"
HEARTBEATS = "stopped sending heartbeats"

_console_fd: int | None = None  # the real stderr once captured
_relay: subprocess.Popen | None = None  # held for the life of the process, never waited for: it ends after it


def fd() -> int:
    """Where the project's own error lines go: the console's stderr descriptor (2 until capture())."""
    return 2 if _console_fd is None else _console_fd


def _text(descriptor: int, like) -> io.TextIOWrapper:
    """A line-buffered text stream on `descriptor`, with the encoding of the stream `like` it replaces."""
    return io.TextIOWrapper(io.FileIO(descriptor, "w"), encoding=getattr(like, "encoding", None) or "utf-8",
                            errors="backslashreplace", line_buffering=True, write_through=True)


# ---------------------------------------------------------------- the relay (its own process)

def unhealthy_tasks(after: str) -> list[int]:
    """The task ids listed after "stopped sending heartbeats": on that line, then one per line ("1" or
    "/job:jax_worker/replica:0/task:1")."""
    rows = after.splitlines() or [""]
    tasks = [int(t) for t in re.findall(r"(?:task:)?(\d+)", rows[0])]
    for row in rows[1:]:
        found = re.fullmatch(r"\s*(?:\S*task:)?(\d+)\s*,?\s*", row)
        if not found:
            break
        tasks.append(int(found.group(1)))
    return sorted(set(tasks))


def translate(text: str, process: int, log: str) -> str:
    """One console line for a fatal native message (its first line and those after it, up to the stack trace)."""
    where = f"the details are in {log}"
    if HEARTBEATS in text:
        tasks = unhealthy_tasks(text.split(HEARTBEATS, 1)[1])
        if process in tasks:
            return (f"error: the run's coordination service declared this process ({process}) dead: it sent no "
                    f"heartbeat within --heartbeat_timeout_s (stopped, or cut off from the network); {where}")
        who = ", ".join(map(str, tasks)) or "another one"
        return (f"error: process {who} of the run stopped sending heartbeats for --heartbeat_timeout_s (stopped, "
                f"hung or cut off from the network); the coordination service ends every process, this one too; "
                f"{where}")
    status = text.split("absl::Status:", 1)[-1].strip()
    first = re.split(r"(?<=\.)\s", status, maxsplit=1)[0][:200] if status else ""  # its first sentence
    if COORDINATION in text:
        return (f"error: the run's coordination service failed ({first}): most likely another process of "
                f"the run died; this process ends too; {where}")
    return f"error: fatal error in native code: {text.strip().splitlines()[0][:300]}; {where}"


class Relay:
    """Reads the training process's native stderr line by line; returns the console lines to print."""

    def __init__(self, process: int, log: str):
        self.process, self.log = process, log
        self.pending: list[str] | None = None  # a fatal message being read
        self.said = False

    def line(self, text: str) -> list[str]:
        out = []
        fatal = FATAL.match(text)
        if self.pending is not None and (fatal or LOG_LINE.match(text) or text.startswith(("***", "Fatal Python"))):
            out.append(self.flush())
        if fatal and not self.said:
            self.pending = [fatal.group(1)]
        elif self.pending is not None:
            self.pending.append(text)
        elif text.startswith("Fatal Python error:") and not self.said:
            self.said = True
            out.append(f"error: {text.strip()} (the process ended in native code); every thread's stack is in "
                       f"{self.log}")
        return [o for o in out if o]

    def flush(self) -> str:
        if self.pending is None:
            return ""
        text, self.pending, self.said = "\n".join(self.pending), None, True
        return translate(text, self.process, self.log)


def relay(log: str, process: int) -> None:
    """Copy stdin to stdout (the log `log`, opened by the training process) until every writer has closed it,
    printing the fatal lines' translations on stderr (the console)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)  # a signal for the run (srun, Ctrl-C) must not cut the log short
    reader, out = Relay(process, log), sys.stdout.buffer
    for raw in iter(sys.stdin.buffer.readline, b""):
        try:
            out.write(raw)
            out.flush()
        except OSError:
            pass  # a full disk loses log lines, never the run's console
        for said in reader.line(raw.decode(errors="replace").rstrip("\n")):
            print(said, file=sys.stderr, flush=True)
    last = reader.flush()
    if last:
        print(last, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the training process's side

PEER_LOST = re.compile(r"gloo|nccl|collective|coordination|heartbeat|connection (reset|refused|closed)|"
                       r"UNAVAILABLE|DEADLINE_EXCEEDED", re.I)


def peer_failure(error: BaseException) -> str:
    """The console line for a runtime error of a collective or of the coordination service, which a process of
    a multi-process run meets when a peer stops, dies or is cut off ("" for any other error)."""
    if type(error).__name__ != "JaxRuntimeError" or not PEER_LOST.search(str(error)):
        return ""
    first = (str(error).strip().splitlines() or [""])[0][:200]
    return (f"a collective with the run's other processes failed ({first}): most likely another process "
            "stopped, died or was cut off")


def _library_stream() -> io.TextIOBase:
    """A text stream on file descriptor 2 (the relay's pipe once captured) that never raises."""
    return open(2, "w", buffering=1, closefd=False, errors="backslashreplace")


def _route_python(stream: io.TextIOBase, log: str) -> None:
    """Python loggers, warnings and exceptions of threads other than the main one -> `stream`."""
    from absl import logging as absl_logging  # late: the relay runs this file with the standard library only

    handler = logging.StreamHandler(stream)
    handler.setFormatter(absl_logging.PythonFormatter())
    handler.handleError = lambda record: None  # a log line that cannot be written is dropped, never printed
    root = logging.getLogger()
    for old in list(root.handlers):  # absl's handler writes to the console
        root.removeHandler(old)
    root.addHandler(handler)
    logging.captureWarnings(True)

    def thread_hook(args) -> None:
        traceback.print_exception(args.exc_type, args.exc_value, args.exc_traceback, file=stream)

    def except_hook(kind, value, tb) -> None:  # native callbacks print their errors through sys.excepthook
        if threading.current_thread() is not threading.main_thread():
            traceback.print_exception(kind, value, tb, file=stream)
        elif peer_failure(value):  # not the project's crash: the relay or a peer says why, the details go to the log
            traceback.print_exception(kind, value, tb, file=stream)
            print(f"error: {peer_failure(value)}; the traceback is in {log}", file=sys.stderr, flush=True)
        else:
            sys.__excepthook__(kind, value, tb)  # a crash of the project: its traceback on the console

    threading.excepthook = thread_hook
    sys.excepthook = except_hook
    sys.unraisablehook = lambda u: traceback.print_exception(u.exc_type, u.exc_value, u.exc_traceback, file=stream)


def capture(log: os.PathLike | str, process: int) -> None:
    """From now on the libraries write to `log` (appended; its folder is created) and the console keeps the
    project's lines. Once per process; the relay ends when this process (and whatever it started) has exited."""
    global _console_fd, _relay
    if _console_fd is not None:
        return
    os.makedirs(os.path.dirname(os.fspath(log)) or ".", exist_ok=True)
    with open(log, "ab") as file:  # opened here: the relay starts later, perhaps after a failed start removed it
        sys.stdout.flush(), sys.stderr.flush()
        out, err = os.dup(1), os.dup(2)
        read, write = os.pipe()
        command = [sys.executable, "-I", "-S", os.path.abspath(__file__), os.fspath(log), str(process)]
        _relay = subprocess.Popen(command, stdin=read, stdout=file, stderr=err, close_fds=True)
    os.close(read)
    for native in (1, 2):
        os.dup2(write, native)
    os.close(write)
    _console_fd = err
    sys.stdout, sys.stderr = _text(out, sys.stdout), _text(os.dup(err), sys.stderr)
    _route_python(_library_stream(), os.fspath(log))


if __name__ == "__main__":
    relay(sys.argv[1], int(sys.argv[2]))
