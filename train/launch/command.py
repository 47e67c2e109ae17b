"""Local launcher: N training processes on this machine, joined over loopback, restarted when they fail.

    python -m train.launch --num_processes=2 --num_cpu_devices=4 [--max_restarts=3 --min_processes=1] \
        -- --config=experiments/tiny.py --workdir=DIR
    python -m train.launch --emit=jobset --num_processes=4 -- --config=... --workdir=/shared/DIR > jobset.yaml
    python -m train.launch --module=train.rl --num_processes=2 -- --config=experiments/rl_tiny.py --workdir=DIR

Output is forwarded line by line with a `[pN]` prefix; an `error:` line, which every process of a run that fails
on one cause prints, once and without the prefix (each process's libraries write to WORKDIR/logs/process_N.log).
SIGTERM/SIGINT are forwarded to every process.
The first process to fail stops the others (a stopped one, SIGSTOP, is woken to receive the SIGTERM) and its
status becomes the launch's; a process that exits with the requeue status (75, after a coordinated
preemption save) is not a failure: the launcher waits for the others to finish their save and passes 75 on.
With --max_restarts the launch is started again after a failure (train/launch/elastic.py says which statuses
and how), from the run's last checkpoint; after a lost process (one killed by a signal) on one process fewer,
down to --min_processes, with the layout chosen again by the planner for the devices left.
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

from train.exit_codes import REQUEUE
from train.launch import elastic, jobset
from train.runtime import lock
from train.runtime.forward import Errors, forward

_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "Processes to start.")
_NUM_CPU_DEVICES = flags.DEFINE_integer("num_cpu_devices", 4, "Virtual CPU devices per process.")
_GRACE = flags.DEFINE_float("grace_s", 30.0, "After a failure, seconds the others get to exit before SIGKILL; "
                                             "also how long a requeue waits for the others' saves.")
_MAX_RESTARTS = flags.DEFINE_integer("max_restarts", 0, "Start a failed launch again this many times at most.")
_MIN_PROCESSES = flags.DEFINE_integer("min_processes", 0, "After a lost process, restart on one fewer, down to "
                                                          "this many (0: always --num_processes).")
_BACKOFF = flags.DEFINE_float("restart_backoff_s", 5.0, "Seconds before the first restart; doubled each time.")
_EMIT = flags.DEFINE_enum("emit", "", ["", "jobset"], "Print a cluster manifest for these arguments and exit: "
                                                     "jobset (a Kubernetes JobSet).")
_IMAGE = flags.DEFINE_string("image", "spmdtrain:latest", "With --emit: the container image holding this project.")
_GPUS = flags.DEFINE_integer("gpus_per_process", 8, "With --emit: GPUs each process (pod) drives.")
_MODULE = flags.DEFINE_enum("module", "train", ["train", "train.rl"], "The command each process runs: "
                            "train, or train.rl (reinforcement learning).")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(num_processes: int, num_cpu_devices: int, train_args: list[str]) -> list[subprocess.Popen]:
    address = f"127.0.0.1:{free_port()}"
    procs, errors = [], Errors()
    for i in range(num_processes):
        cmd = [sys.executable, "-m", _MODULE.value, *train_args, f"--coordinator_address={address}",
               f"--num_processes={num_processes}", f"--process_id={i}", f"--num_cpu_devices={num_cpu_devices}"]
        # A session of its own: a terminal's Ctrl-C reaches the process once, forwarded by the launcher,
        # not also directly (a second SIGINT would abort it before its preemption save).
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                start_new_session=True)
        proc.forwarders = [threading.Thread(target=forward, args=(stream, f"[p{i}] ", out, errors), daemon=True)
                           for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
        for thread in proc.forwarders:
            thread.start()
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


def supervise(procs: list[subprocess.Popen], grace_s: float) -> tuple[int, bool]:
    """Wait for the processes; return (the launch's exit status, whether the first failure was a process
    killed by a signal: a lost process, as when its node goes)."""
    requeue_since = None
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0, REQUEUE)]
        if failed:
            stop(procs, grace_s)
            return _status(failed[0]), failed[0] < 0
        if all(c is not None for c in codes):
            return (REQUEUE if REQUEUE in codes else 0), False
        if REQUEUE in codes:
            requeue_since = requeue_since or time.monotonic()
            if time.monotonic() - requeue_since > grace_s:  # a peer never finished its save
                stop(procs, grace_s)
                return REQUEUE, False
        time.sleep(0.1)


def _check(train_args: list[str]) -> None:
    for flag, low in ((_NUM_PROCESSES, 1), (_NUM_CPU_DEVICES, 1), (_GRACE, 0), (_MAX_RESTARTS, 0),
                      (_MIN_PROCESSES, 0), (_BACKOFF, 0), (_GPUS, 1)):
        if flag.value < low:
            raise app.UsageError(f"--{flag.name}={flag.value}: must be >= {low}")
    if _MIN_PROCESSES.value > _NUM_PROCESSES.value:
        raise app.UsageError(f"--min_processes={_MIN_PROCESSES.value}: must be <= --num_processes="
                             f"{_NUM_PROCESSES.value}")
    if _MODULE.value != "train" and 0 < _MIN_PROCESSES.value < _NUM_PROCESSES.value:
        raise app.UsageError(f"--min_processes={_MIN_PROCESSES.value}: a restart on fewer processes lets the planner "
                             f"lay the run out, which {_MODULE.value} does not (its layout is mesh.*); leave it out")
    if _EMIT.value and _MODULE.value != "train":
        raise app.UsageError(f"--emit={_EMIT.value}: manifests run python -m train; launch --module="
                             f"{_MODULE.value} directly")
    if not train_args:
        raise app.UsageError("give the training arguments after '--', e.g. "
                             "-- --config=experiments/tiny.py --workdir=DIR")


def run_once(num_processes: int, train_args: list[str], stopping: threading.Event) -> tuple[int, bool]:
    """One launch: start, supervise (forwarding SIGTERM/SIGINT, which also mark the launch as stopping), drain."""
    procs = start(num_processes, _NUM_CPU_DEVICES.value, train_args)

    def forward(signum, _frame):
        stopping.set()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    result = supervise(procs, _GRACE.value)
    deadline = time.monotonic() + 10
    for p in procs:
        p.wait()
        for thread in p.forwarders:  # the last lines, some from the process's log relay (train/runtime/console.py)
            thread.join(max(deadline - time.monotonic(), 0.1))
    return result


def main(argv: list[str]) -> int:
    train_args = argv[1:]
    _check(train_args)
    if _EMIT.value == "jobset":
        print(jobset.manifest(train_args, _NUM_PROCESSES.value, _IMAGE.value, _GPUS.value, _MAX_RESTARTS.value),
              end="")
        return 0
    workdir = next((a.split("=", 1)[1] for a in train_args if a.startswith("--workdir=")), None)
    if workdir:
        lock.check_free(workdir)  # a second launch on a workdir in use ends before starting anything
    policy = elastic.Policy(_MAX_RESTARTS.value, _MIN_PROCESSES.value or _NUM_PROCESSES.value, _BACKOFF.value)
    launch, stopping = elastic.Launch(_NUM_PROCESSES.value, train_args), threading.Event()
    while True:
        code, lost = run_once(launch.processes, launch.args, stopping)
        nxt = policy.next(launch, code, lost, stopping.is_set())
        if nxt is None:
            return code
        print(f"launch: {policy.reason(code, lost)}; restart {nxt.restarts} of {policy.max_restarts} on "
              f"{nxt.processes} process(es) in {policy.delay_s(nxt):.0f}s", flush=True)
        time.sleep(policy.delay_s(nxt))
        launch = nxt
