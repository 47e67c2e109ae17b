"""Several processes form one run: two compute what one does, a preemption of one process stops both at the
same step, a one-process checkpoint continues in two, a lost process makes the launcher start the run again on
one process (which resumes what two saved), and a stopped (silent) process ends the launch within the heartbeat
timeout, leaving a local tier that a launch of two resumes after one process's copy is gone. Six runs in all: one
process, four launches of two, and one relaunch of one."""
import json
import os
import re
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from tests import helpers
from tests.helpers import MULTIPROCESS_TRAIN, committed, run_cli, start_cli, wait_for
from train import exit_codes

TRAIN = MULTIPROCESS_TRAIN


def launch(*args: str, **kwargs) -> subprocess.Popen:
    return start_cli("train.launch", "--num_processes=2", "--num_cpu_devices=4", "--", *args,
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)


def losses(workdir) -> list[float]:
    return list(helpers.losses(workdir).values())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, 4 steps, checkpoints 2 and 4: the numbers two processes must match, and the checkpoint
    two processes continue from."""
    workdir = tmp_path_factory.mktemp("single") / "one"
    # data=2 is the outermost axis, so its two halves live in different processes.
    single = run_cli(*TRAIN, f"--workdir={workdir}", "--config.train.steps=4", "--config.checkpoint.every_steps=2")
    assert single.returncode == 0, single.stderr[-3000:]
    return workdir


def kill_process_1(workdir, signum: int) -> None:
    """Send `signum` to process 1 of the launch training in `workdir` (train.launch passes --process_id)."""
    victim = subprocess.run(["pgrep", "-f", f"workdir={workdir} .*--process_id=1"], capture_output=True,
                            text=True).stdout.split()
    assert victim, "process 1 not found"
    os.kill(int(victim[0]), signum)


def test_two_processes_match_one_and_a_preemption_stops_both_at_one_step(tmp_path, single):
    """Two processes from scratch compute the one-process run's losses. SIGTERM to process 1: the stop flag is
    agreed by an all-reduce, both processes save one step, the same, and the launch exits 75."""
    workdir = tmp_path / "two"
    proc = launch(*TRAIN, f"--workdir={workdir}", "--config.train.steps=100000", "--config.checkpoint.every_steps=0")
    wait_for(lambda: helpers.last_step(workdir) >= 5, proc, timeout=180)
    kill_process_1(workdir, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == exit_codes.REQUEUE, out[-3000:]
    # Gloo's lines went to each process's log, not to the console.
    assert "Gloo" not in out and all("[Gloo]" in (workdir / "logs" / f"process_{i}.log").read_text() for i in (0, 1))
    saved = re.findall(r"\[p(\d)\] preempted: saved checkpoint .*/checkpoints/(\d+)", out)
    assert sorted(p for p, _ in saved) == ["0", "1"] and len({s for _, s in saved}) == 1, saved
    step = int(saved[0][1])
    assert committed(workdir) == [step]
    np.testing.assert_allclose(losses(workdir)[:4], losses(single), rtol=1e-5)
    assert sorted(helpers.losses(workdir)) == list(range(1, step + 1))  # only process 0 writes metrics
    records = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert all(len(r["host_step_time_s"]) == 2 for r in records if "loss" in r)  # per-host step times
    one = [json.loads(l) for l in (single / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["mfu"] < 1 for r in records + one if "loss" in r)  # the measured peak in one process and two


def test_one_process_checkpoint_continues_in_two_and_a_lost_process_relaunches_on_one(tmp_path, single):
    """The launch starts from the one-process run's step 4 (a checkpoint written by one process continues in
    two). Process 1 is killed (SIGKILL, as when its node goes) once the two have saved a checkpoint of their own
    and logged a step past it. The launcher (--max_restarts=1 --min_processes=1) starts the run again on one
    process of 4 devices, where the planner lays it out; it resumes the two-process checkpoint, recomputes the
    steps the two had logged after it to within 1e-5, and finishes."""
    workdir, steps = tmp_path / "run", 14
    shutil.copytree(single, workdir)
    proc = start_cli("train.launch", "--num_processes=2", "--num_cpu_devices=4", "--max_restarts=1",
                     "--min_processes=1", "--restart_backoff_s=0", "--grace_s=2", "--", *TRAIN,
                     f"--workdir={workdir}", "--config.checkpoint.every_steps=4", f"--config.train.steps={steps}",
                     "--config.fault_injection.step_delay_s=0.3", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for(lambda: max(committed(workdir)) > 4 and helpers.last_step(workdir) > max(committed(workdir)), proc,
             timeout=180)
    kill_process_1(workdir, signal.SIGKILL)
    before = helpers.losses(workdir)  # what the two processes logged
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == exit_codes.OK, out[-3000:]
    assert "from step 4" in out
    assert "launch: a process was lost (status 137); restart 1 of 1 on 1 process(es)" in out, out[-3000:]
    assert "plan.auto: " in out  # the 4 devices left were laid out by the planner
    restored = int(re.findall(r"from step (\d+)", out)[-1])
    after = helpers.losses(workdir)
    redone = [s for s in before if s > restored]
    assert restored > 4 and redone and sorted(after) == list(range(1, steps + 1))
    np.testing.assert_allclose([after[s] for s in redone], [before[s] for s in redone], rtol=1e-5)


def local_steps(node) -> list[int]:
    """The committed steps in one folder (own/ or peer/) of a process's local tier."""
    return sorted(int(p.parent.name) for p in node.glob("*/manifest.json") if p.parent.name.isdigit())


def test_a_stopped_process_ends_the_launch_and_a_lost_local_tier_comes_back_from_its_peer(tmp_path, single):
    """Process 1 is stopped (SIGSTOP: alive but silent, as behind a cut network path): the coordination service
    misses its heartbeats, process 0 aborts within --heartbeat_timeout_s, and the launcher wakes the stopped
    process to end it at once, long before the step watchdog (train.step_timeout_s) or the launcher's grace.
    The run kept a local tier, each process with a copy of its neighbour's: with process 1's local folder
    deleted (its node replaced), two processes restore the newest local step, process 1 from process 0's copy, and
    verify every checksum."""
    workdir, local_dir = tmp_path / "run", tmp_path / "shm"
    shutil.copytree(single, workdir)
    tiers = (f"--config.checkpoint.local_dir={local_dir}", "--config.checkpoint.local_every_steps=1")
    heartbeat, grace = 5, 60  # a stopped process left to the grace period would take over 60 s
    proc = start_cli("train.launch", "--num_processes=2", "--num_cpu_devices=4", f"--grace_s={grace}", "--",
                     *TRAIN, f"--workdir={workdir}", "--config.train.steps=100000", *tiers,
                     "--config.checkpoint.every_steps=0", f"--heartbeat_timeout_s={heartbeat}",
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for(lambda: helpers.last_step(workdir) >= 6, proc, timeout=180)
    kill_process_1(workdir, signal.SIGSTOP)
    stopped_at = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    took = time.monotonic() - stopped_at
    assert proc.returncode not in (0, exit_codes.REQUEUE), out[-3000:]
    assert "\nerror: process 1 of the run stopped sending heartbeats" in out, out[-3000:]
    assert not re.search(r"Fatal Python error|Check failure|Traceback|^\[p\d\] [IWEF]\d{4} ", out, re.M), out[-3000:]
    assert took < grace - 15, (took, out[-3000:])

    node0, node1 = (next(local_dir.glob(f"*/process_{i}_of_2")) for i in (0, 1))
    step = max(set(local_steps(node0 / "own")) & set(local_steps(node0 / "peer")))
    both = max(set(local_steps(node1 / "own")) & set(local_steps(node0 / "peer")))
    assert step > 4 and (node0 / "peer" / str(both) / "shards.bin").read_bytes() == \
        (node1 / "own" / str(both) / "shards.bin").read_bytes()  # process 0 holds process 1's shards
    shutil.rmtree(node1)
    # train.steps = the local step: both processes restore and verify it, then have nothing left to train.
    proc = launch(*TRAIN, f"--workdir={workdir}", f"--config.train.steps={step}", *tiers)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    assert re.search(rf"already reached train.steps={step} \(resumed from {node0}/own/{step}, local tier\)", out), \
        out[-3000:]
    assert re.search(rf"\[p1\] local checkpoint {node1}/own/{step} is missing here; its copy on process 0 "
                     rf"restores it", out), out[-3000:]
