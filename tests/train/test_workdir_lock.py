"""One run per workdir (train/runtime/lock.py): a live holder stops a second run naming it, a gone one (dead pid
on this host, no heartbeat from another host, a torn file) is taken over with one warning, release removes only
the lock's own file, and the heartbeat keeps a long run's lock fresh. In-process, no training: milliseconds."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from train.runtime import lock as lock_lib
from train.runtime.lock import WorkdirInUse, WorkdirLock


def write_holder(workdir, host: str, pid: int, age_s: float = 0.0):
    path = workdir / lock_lib.NAME
    path.write_text(json.dumps({"host": host, "pid": pid, "processes": 2, "started": "2026-12-01T10:00:00+00:00",
                                "token": "theirs"}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


@pytest.fixture(scope="module")
def live_pid():
    """A process of this host that stays alive for the module's tests."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_holder_stops_a_second_run_naming_it(tmp_path, live_pid):
    for host in (socket.gethostname(), "other-host"):  # a live pid here; a fresh heartbeat from elsewhere
        path = write_holder(tmp_path, host, live_pid)
        before = path.read_text()
        warnings = []
        with pytest.raises(WorkdirInUse) as error:
            WorkdirLock(tmp_path).acquire(warnings.append)
        assert str(error.value).startswith(f"--workdir={tmp_path} is in use by another run (host {host}, pid "
                                           f"{live_pid}, started 2026-12-01T10:00:00+00:00, 2 process(es), heartbeat ")
        assert path.read_text() == before and warnings == []


@pytest.mark.parametrize("case", ["dead pid here", "silent other host", "torn file", "own pid: a restart"])
def test_a_gone_holder_is_taken_over_with_one_warning(tmp_path, case):
    if case == "dead pid here":
        write_holder(tmp_path, socket.gethostname(), dead_pid())
    elif case == "silent other host":
        write_holder(tmp_path, "other-host", 1, age_s=lock_lib.STALE_AFTER_S + 5)
    elif case == "own pid: a restart":
        write_holder(tmp_path, socket.gethostname(), os.getpid())
    else:
        path = tmp_path / lock_lib.NAME
        path.write_text('{"host": "h')
        os.utime(path, (time.time() - 10, time.time() - 10))
    warnings = []
    with WorkdirLock(tmp_path, processes=4) as held:
        held.acquire(warnings.append)
        record = json.loads((tmp_path / lock_lib.NAME).read_text())
        assert record["pid"] == os.getpid() and record["processes"] == 4 and record["token"] == held.record["token"]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: --workdir={tmp_path}: taking over the lock")
    assert not (tmp_path / lock_lib.NAME).exists()  # released


def test_release_leaves_another_runs_lock_and_the_heartbeat_keeps_it_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_lib, "HEARTBEAT_S", 0.05)
    held = WorkdirLock(tmp_path)
    held.acquire(print)
    path = tmp_path / lock_lib.NAME
    os.utime(path, (time.time() - 100, time.time() - 100))
    deadline = time.monotonic() + 10
    while time.time() - path.stat().st_mtime > 50:
        assert time.monotonic() < deadline, "no heartbeat"
        time.sleep(0.02)
    write_holder(tmp_path, "other-host", 7)  # replaced behind its back (e.g. by hand)
    held.release()
    assert json.loads(path.read_text())["token"] == "theirs"


def test_a_killed_but_unreaped_process_counts_as_gone():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert lock_lib._pid_alive(proc.pid)
    proc.kill()
    deadline = time.monotonic() + 10
    while lock_lib._pid_alive(proc.pid):  # a zombie until wait() below
        assert time.monotonic() < deadline, "a zombie still counts as running"
        time.sleep(0.01)
    proc.wait()
