"""Local launcher: N training processes on this machine, joined over loopback.

    python -m train.launch --num_processes=2 --num_cpu_devices=4 -- --config=experiments/tiny.py --workdir=DIR

Output is forwarded line by line with a `[pN]` prefix; SIGTERM/SIGINT are forwarded to every process.
The first process to fail stops the others (a stopped one, SIGSTOP, is woken to receive the SIGTERM) and its
status becomes the launcher's; a process that exits with the requeue status (75, after a coordinated
preemption save) is not a failure: the launcher waits for the others to finish their save and passes 75 on.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

from train import cli
from train.loop.exit_codes import REQUEUE
from train.runtime import lock

_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "Processes to start.")
_NUM_CPU_DEVICES = flags.DEFINE_integer("num_cpu_devices", 4, "Virtual CPU devices per process.")
_GRACE = flags.DEFINE_float("grace_s", 30.0, "After a failure, seconds the others get to exit before SIGKILL; "
                                             "also how long a requeue waits for the others' saves.")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forward(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"{prefix}{line}")
        out.flush()


def start(num_processes: int, num_cpu_devices: int, train_args: list[str]) -> list[subprocess.Popen]:
    address = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(num_processes):
        cmd = [sys.executable, "-m", "train", *train_args, f"--coordinator_address={address}",
               f"--num_processes={num_processes}", f"--process_id={i}", f"--num_cpu_devices={num_cpu_devices}"]
        # A session of its own: a terminal's Ctrl-C reaches the process once, forwarded by the launcher,
        # not also directly (a second SIGINT would abort it before its preemption save).
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                start_new_session=True)
        for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            threading.Thread(target=_forward, args=(stream, f"[p{i}] ", out), daemon=True).start()
        procs.append(proc)
    return procs


def stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
            os.kill(p.pid, signal.SIGCONT)  # a stopped process (SIGSTOP) would hold the SIGTERM until SIGKILL
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _status(code: int) -> int:
    """A process killed by signal N reports -N; a shell would say 128 + N."""
    return 128 - code if code < 0 else code


def supervise(procs: list[subprocess.Popen], grace_s: float) -> int:
    """Wait for the processes; return the launch's exit status."""
    requeue_since = None
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0, REQUEUE)]
        if failed:
            stop(procs, grace_s)
            return _status(failed[0])
        if all(c is not None for c in codes):
            return REQUEUE if REQUEUE in codes else 0
        if REQUEUE in codes:
            requeue_since = requeue_since or time.monotonic()
            if time.monotonic() - requeue_since > grace_s:  # a peer never finished its save
                stop(procs, grace_s)
                return REQUEUE
        time.sleep(0.1)


def main(argv: list[str]) -> int:
    train_args = argv[1:]
    for flag, low in ((_NUM_PROCESSES, 1), (_NUM_CPU_DEVICES, 1), (_GRACE, 0)):
        if flag.value < low:
            raise app.UsageError(f"--{flag.name}={flag.value}: must be >= {low}")
    if not train_args:
        raise app.UsageError("give the training arguments after '--', e.g. "
                             "-- --config=experiments/tiny.py --workdir=DIR")
    workdir = next((a.split("=", 1)[1] for a in train_args if a.startswith("--workdir=")), None)
    if workdir:
        lock.check_free(workdir)  # a second launch on a workdir in use ends before starting anything
    procs = start(_NUM_PROCESSES.value, _NUM_CPU_DEVICES.value, train_args)

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = supervise(procs, _GRACE.value)
    for p in procs:
        p.wait()
    time.sleep(0.2)  # let the forwarding threads drain the last lines
    return code


if __name__ == "__main__":
    cli.run(main)
