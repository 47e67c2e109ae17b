"""experiments/slurm/train.sbatch on a real one-node SLURM cluster (tests/slurm_cluster.py), as shipped but for the
node's size: 2 tasks of 4 virtual CPU devices join one run from SLURM's variables and compute the losses of
1 process x 8 devices, through a SIGUSR1 save (training goes on), a task killed with SIGKILL (the job fails within
the heartbeat bound and the script requeues it) and a SIGTERM preemption (both tasks save, exit 75, requeue),
each attempt resuming from the newest save. One job, three attempts; the daemons start once per suite run."""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import helpers, slurm_cluster
from tests.helpers import MULTIPROCESS_TRAIN, ROOT, committed, run_cli

STEPS, HEARTBEAT_S = 20, 5  # steps enough that the preemption comes before the last
# --signal=USR1@45 under --time=1: SLURM's timer, which runs every 30 s, sends it 15 to 45 s after the start.
WARN_S = 45
CONFIG, *OVERRIDES = MULTIPROCESS_TRAIN  # the script passes --config=CONFIG itself


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """The running cluster; skips with the reason where it cannot start (not root, SLURM not installed)."""
    reason = slurm_cluster.missing()
    if reason:
        pytest.skip(reason)
    try:
        cluster = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    except RuntimeError as error:
        pytest.skip(f"the SLURM daemons did not start: {error}")
    yield cluster
    slurm_cluster.stop(cluster)


@pytest.fixture(scope="module")
def warned(slurm, tmp_path_factory):
    """One task under a 1-minute limit with --signal=USR1@45 in place of the script's TERM@120. Submitted before
    the other test runs, it waits for its warning meanwhile (the node's CPUs are shared: OverSubscribe)."""
    workdir = tmp_path_factory.mktemp("warned") / "run"
    job = submit(slurm, workdir, "--time=1", f"--signal=USR1@{WARN_S}", tasks=1, steps=100000, delay_s=0.5)
    yield job, workdir
    slurm.run("scancel", job)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """{step: loss} of the same training in one process of 8 devices, outside SLURM."""
    workdir = tmp_path_factory.mktemp("reference") / "run"
    done = run_cli(*MULTIPROCESS_TRAIN, f"--config.train.steps={STEPS}", "--num_cpu_devices=8", f"--workdir={workdir}")
    assert done.returncode == 0, done.stderr[-3000:]
    return helpers.losses(workdir)


def submit(slurm, workdir: pathlib.Path, *sbatch: str, tasks: int = 2, steps: int = STEPS, delay_s: float = 0.3) -> str:
    """sbatch train.sbatch from the repository (its submit directory), the tasks running this interpreter. The
    tasks are sized to the one node; every other #SBATCH line of the script (--requeue, --signal=TERM@120,
    --open-mode=append) is used as shipped unless `sbatch` overrides it."""
    node = ["--nodes=1", f"--ntasks-per-node={tasks}", "--gpus-per-node=0", "--cpus-per-task=1"]
    train = [*OVERRIDES, f"--config.train.steps={steps}", f"--config.fault_injection.step_delay_s={delay_s}",
             f"--num_cpu_devices={8 // tasks}", f"--heartbeat_timeout_s={HEARTBEAT_S}"]
    out = slurm.run("sbatch", "--parsable", *node, f"--output={workdir.parent / 'job.out'}", *sbatch,
                    "experiments/slurm/train.sbatch", CONFIG.removeprefix("--config="), str(workdir), *train,
                    cwd=ROOT, env={"PYTHON": sys.executable})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def wait(condition, slurm, job: str, what: str, timeout: float = 120) -> float:
    """Poll until `condition()` holds; its time in seconds. Fails if the job is gone or time runs out."""
    start = time.monotonic()
    while not condition():
        state = slurm.job(job).get("JobState", "gone")
        if condition():  # it came true while the state was read: a job that just ended is not a failure
            break
        assert state in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"), (what, state)
        assert time.monotonic() - start < timeout, f"timed out waiting for {what}"
        time.sleep(0.1)
    return time.monotonic() - start


def output(workdir: pathlib.Path) -> str:
    path = workdir.parent / "job.out"
    return path.read_text(errors="replace") if path.exists() else ""


def task_pid(workdir: pathlib.Path, task: int) -> int:
    """The pid of SLURM task `task`'s training process in `workdir` (SLURM_PROCID in its environment)."""
    for proc in pathlib.Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"--workdir={workdir}".encode() in (proc / "cmdline").read_bytes() \
                    and f"SLURM_PROCID={task}\0".encode() in (proc / "environ").read_bytes():
                return int(proc.name)
        except OSError:
            continue
    raise AssertionError(f"task {task} of {workdir} not found")


def restarts(slurm, job: str) -> int:
    return int(slurm.job(job).get("Restarts", -1))


def save_and_go_on(slurm, job: str, workdir: pathlib.Path) -> int:
    """SIGUSR1 to the job's tasks (what --signal=USR1@N sends before the time limit): a save, and training goes on."""
    wait(lambda: helpers.last_step(workdir) >= 3, slurm, job, "step 3")
    assert slurm.run("scancel", "--signal=USR1", job).returncode == 0
    wait(lambda: committed(workdir), slurm, job, "the SIGUSR1 save")
    saved = max(committed(workdir))
    wait(lambda: helpers.last_step(workdir) > saved, slurm, job, "a step after the save")
    assert restarts(slurm, job) == 0 and helpers.last_step(workdir) < STEPS
    return saved


def lose_a_task(slurm, job: str, workdir: pathlib.Path, saved: int) -> dict[str, float]:
    """SIGKILL to task 1's process: task 0 misses its heartbeats, the step fails, the script requeues the job
    (not a final status), and the next attempt resumes from the SIGUSR1 save."""
    lost = helpers.last_step(workdir) - saved  # logged steps the next attempt computes again
    os.kill(task_pid(workdir, 1), signal.SIGKILL)
    ended = wait(lambda: restarts(slurm, job) == 1, slurm, job, "the requeue after the lost task")
    assert ended < HEARTBEAT_S + 30, ended
    failed = re.findall(r"failed with status (\d+): requeueing job", output(workdir))
    assert len(failed) == 1 and int(failed[0]) not in (0, 2, 65, 66, 75), output(workdir)[-3000:]
    resumed = wait(lambda: f"resumed from {workdir}/checkpoints/{saved}," in output(workdir), slurm, job,
                   "the resumed attempt")
    return {"kill_to_requeue_s": ended, "requeue_to_resumed_s": resumed, "steps_lost": lost}


def preempt(slurm, job: str, workdir: pathlib.Path, resumed_from: int) -> tuple[int, dict[str, float]]:
    """SIGTERM to the job's tasks (scancel --signal=TERM, as SLURM does before a time limit or a preemption): both
    save one step, exit 75, and the script requeues the job."""
    wait(lambda: helpers.last_step(workdir) > resumed_from + 1, slurm, job, "steps after the resume")
    assert slurm.run("scancel", "--signal=TERM", job).returncode == 0
    ended = wait(lambda: restarts(slurm, job) == 2, slurm, job, "the requeue after the preemption")
    saved = re.findall(r"preempted: saved checkpoint \S+/checkpoints/(\d+); run the same", output(workdir))
    assert len(saved) == 2 and saved[0] == saved[1], output(workdir)[-3000:]  # one line per task, one step
    assert "tasks 0-1: Exited with exit code 75" in output(workdir) or \
        output(workdir).count("Exited with exit code 75") == 2, output(workdir)[-3000:]
    lost = helpers.last_step(workdir) - int(saved[0])
    assert lost == 0, lost  # nothing logged past the save: the tasks agree on the step to stop at
    resumed = wait(lambda: f"resumed from {workdir}/checkpoints/{saved[0]}," in output(workdir), slurm, job,
                   "the attempt after the preemption")
    return int(saved[0]), {"term_to_requeue_s": ended, "requeue_to_resumed_s": resumed, "steps_lost": lost}


def test_sbatch_trains_as_one_process_through_a_save_a_lost_task_and_a_preemption(slurm, warned, reference, tmp_path):
    """One job, three attempts: a SIGUSR1 save, a lost task (requeued by the script), a SIGTERM preemption (saved,
    75, requeued), then the rest; the losses are the reference's. (`warned` only starts that job first.)"""
    workdir = tmp_path / "run"
    job = submit(slurm, workdir, "--time=10")
    usr1 = save_and_go_on(slurm, job, workdir)
    events = lose_a_task(slurm, job, workdir, usr1)
    term, preempted = preempt(slurm, job, workdir, usr1)
    wait(lambda: slurm.job(job).get("JobState") == "COMPLETED", slurm, job, "the last attempt", timeout=180)
    record = slurm.job(job)
    assert record["ExitCode"] == "0:0" and record["Restarts"] == "2", record
    logged = helpers.losses(workdir)
    assert sorted(logged) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([logged[s] for s in range(1, STEPS + 1)],
                               [reference[s] for s in range(1, STEPS + 1)], rtol=1e-5)
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line]
    records = [r for r in records if "loss" in r]
    assert all(len(r["host_step_time_s"]) == 2 for r in records)  # two processes, joined from SLURM's variables
    print(f"\n{slurm.version}: SIGUSR1 saved {usr1}; lost task {events}; SIGTERM saved {term} {preempted}")


def test_signal_usr1_before_the_time_limit_saves_and_training_goes_on(slurm, warned):
    """SLURM sends the warning WARN_S seconds before the limit (its timer's period early, at most): the task saves
    the step reached and trains on; nothing is requeued (a time limit left to USR1 ends the job)."""
    job, workdir = warned
    deadline = time.monotonic() + 120
    while not (committed(workdir) and helpers.last_step(workdir) > min(committed(workdir))):
        assert time.monotonic() < deadline, ("no save after the warning", slurm.job(job), output(workdir)[-2000:])
        time.sleep(0.2)
    saved, record = min(committed(workdir)), slurm.job(job)
    assert output(workdir).count("SIGUSR1: saving a checkpoint after the step in flight; training goes on") == 1
    assert record["Restarts"] == "0" and record["JobState"] in ("RUNNING", "COMPLETING", "TIMEOUT"), record
    started = time.mktime(time.strptime(record["StartTime"], "%Y-%m-%dT%H:%M:%S"))
    after_s = (workdir / "checkpoints" / str(saved)).stat().st_mtime - started
    assert 60 - WARN_S - 5 < after_s < 60, after_s  # before the limit, not before the warning was due
    print(f"\nUSR1@{WARN_S} with --time=1: saved step {saved} {after_s:.0f}s after the start")


def _script(tmp_path, *args: str, srun_status: int = 0, **env: str):
    """train.sbatch run by bash outside SLURM: srun is a stub that exits `srun_status`, scontrol one that says it
    would requeue; (exit status, stdout, stderr)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("srun", f"exit {srun_status}"), ("scontrol", 'echo "requeued $*"')):
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    base = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_ID": "7",
            "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "experiments" / "slurm" / "train.sbatch"), *args],
                          env={k: v for k, v in {**base, **env}.items() if v is not None}, capture_output=True,
                          text=True, timeout=30)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize("args,env,line", [
    ((), {}, "error: usage: sbatch experiments/slurm/train.sbatch CONFIG WORKDIR [train flags...]"),
    (("c.py", "w"), {"SLURM_SUBMIT_DIR": None}, "error: SLURM_SUBMIT_DIR is not set: submit the script with sbatch "
                                                "from the project's directory (the tasks run from there)"),
    (("c.py", "w"), {"MAX_RESTARTS": "abc"}, "error: MAX_RESTARTS=abc: give a whole number >= 0 (how many times a "
                                             "failed job is requeued)"),
    (("c.py", "w"), {"PYTHON": "/no/such/python"}, "error: PYTHON=/no/such/python: no such interpreter in "
                                                   f"{ROOT}; run make install there, or set PYTHON"),
], ids=["no arguments", "no SLURM_SUBMIT_DIR", "MAX_RESTARTS=abc", "no interpreter"])
def test_the_script_checks_how_it_was_started(tmp_path, args, env, line):
    status, out, err = _script(tmp_path, *args, **env)
    assert (status, err.strip(), out) == (2, line, "")


@pytest.mark.parametrize("status,requeued", [(2, False), (127, False), (126, False), (1, True), (75, True)])
def test_the_script_requeues_only_what_a_restart_can_help(tmp_path, status, requeued):
    code, out, _ = _script(tmp_path, "c.py", "w", srun_status=status)
    assert code == status and ("requeued requeue 7" in out) == requeued
