"""A run's console keeps the project's lines and a crash's traceback, the libraries' output goes to the run's log
(train/runtime/console.py), a fatal native message becomes one line, and train.launch prints an error once.
No training: one small subprocess."""
import io
import re
import subprocess
import sys
import textwrap

from tests.helpers import ROOT
from train.runtime import progress
from train.runtime.console import Relay
from train.runtime.forward import Errors, forward

# What a process of a run printed (recorded from a 2-process launch whose process 1 was stopped with SIGSTOP).
NATIVE = """\
F1202 18:15:19.712966    6526 client.h:80] Terminating process because the JAX distributed service detected fatal \
errors. This most likely indicates that another task died; see the other task logs for more details. absl::Status: \
UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to \
debug further.

RPC: /xla.coordination.CoordinationService/PollForError [type.googleapis.com/tensorflow.CoordinationServiceError='']
*** Check failure stack trace: ***
    @     0x7f3824040634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
Fatal Python error: Aborted
"""


def relayed(process: int, text: str) -> list[str]:
    relay = Relay(process, "LOG")
    out = [said for line in text.splitlines() for said in relay.line(line)]
    return out + ([relay.flush()] if relay.pending is not None else [])


def test_a_stopped_peer_is_one_line_on_each_side():
    assert relayed(0, NATIVE) == [
        "error: process 1 of the run stopped sending heartbeats for --heartbeat_timeout_s (stopped, hung or cut off "
        "from the network); the coordination service ends every process, this one too; the details are in LOG"]
    assert relayed(1, NATIVE) == [
        "error: the run's coordination service declared this process (1) dead: it sent no heartbeat within "
        "--heartbeat_timeout_s (stopped, or cut off from the network); the details are in LOG"]
    assert relayed(0, "I1202 18:15:19.7 1 gloo.cc:1] connected\n[Gloo] Rank 0 is connected to 1 peer ranks.") == []
    assert relayed(0, "Fatal Python error: Segmentation fault\n\nThread 0x1 (most recent call first):") == [
        "error: Fatal Python error: Segmentation fault (the process ended in native code); every thread's stack "
        "is in LOG"]


CAPTURED = """
import logging, os, sys, threading, warnings
from train.runtime import console
console.capture(sys.argv[1], 0)
os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks\\n")
os.write(2, b"E1202 18:15:19.712437 6515 coordination_service.cc:1549] native\\n")
logging.getLogger("orbax").error("an Orbax error line")
warnings.warn("a library warning")
thread = threading.Thread(target=lambda: 1 / 0)
thread.start(), thread.join()
print("step 1/2 | loss 1.0")
print("warning: the project's own line", file=sys.stderr)
raise RuntimeError("a crash of the project")
"""


def test_the_console_keeps_the_projects_lines_and_a_crashs_traceback(tmp_path):
    log = tmp_path / "logs" / "process_0.log"
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(CAPTURED), str(log)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 1
    assert run.stdout == "step 1/2 | loss 1.0\n"
    err = run.stderr.splitlines()
    assert err[0] == "warning: the project's own line" and err[1].startswith("Traceback"), run.stderr
    assert err[-1] == "RuntimeError: a crash of the project" and "ZeroDivision" not in run.stderr, run.stderr
    text = log.read_text()
    for said in ("[Gloo] Rank 0", "coordination_service.cc:1549] native", "an Orbax error line", "a library warning",
                 "ZeroDivisionError"):
        assert said in text, (said, text)


def test_launch_prints_an_error_line_once_for_all_processes():
    errors, out = Errors(), io.StringIO()
    for i in range(2):
        forward(io.StringIO("warning: w\nerror: the same cause\npreempted: saved\n"), f"[p{i}] ", out, errors)
    assert out.getvalue().splitlines() == ["[p0] warning: w", "error: the same cause", "[p0] preempted: saved",
                                           "[p1] warning: w", "[p1] preempted: saved"]


def test_a_collective_failed_by_a_lost_peer_is_one_line_not_a_traceback():
    from jax.errors import JaxRuntimeError

    from train.runtime.console import peer_failure

    lost = JaxRuntimeError("INTERNAL: Gloo all-reduce failed: Connection closed by peer [127.0.0.1]:4242")
    assert peer_failure(lost).startswith("a collective with the run's other processes failed (INTERNAL: Gloo")
    assert peer_failure(JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")) == ""
    assert peer_failure(RuntimeError("gloo")) == ""


def test_a_progress_line_says_done_of_total_and_the_time_left(capsys):
    line = progress.ProgressLine("eval: scoring", 40, "requests", every_s=0.0, quiet_s=0.0)
    line.advance(10)
    assert re.fullmatch(r"\reval: scoring: 10/40 requests \(25%\), [\d,.]+ requests/s, ETA \d+s   ",
                        capsys.readouterr().err)
    line.advance(30)
    line.close()
    last = capsys.readouterr().err.split("\r")[-1]  # each update rewrites the line; the last one ends it
    assert re.fullmatch(r"eval: scoring: 40/40 requests \(100%\), [\d,.]+ requests/s, done in \d+s   \n", last)
    quiet = progress.ProgressLine("eval: scoring", 40, "requests")  # the first seconds print nothing
    quiet.advance(40)
    quiet.close()
    assert capsys.readouterr().err == ""
