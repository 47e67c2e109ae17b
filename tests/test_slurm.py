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
import sys
import time

import numpy as np
import pytest

from tests import helpers, slurm_cluster
from tests.helpers import ROOT, run_cli
from tests.test_multiprocess import TRAIN, committed

STEPS, HEARTBEAT_S = 16, 5
# Tasks sized to the one node; every other #SBATCH line of the script (--requeue, --signal=TERM@120,
# --open-mode=append) is used as shipped.
NODE = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10"]
CONFIG, *OVERRIDES = TRAIN  # the script passes --config=CONFIG itself
RUN = [*OVERRIDES, f"--config.train.steps={STEPS}", "--config.fault_injection.step_delay_s=0.3",
       "--num_cpu_devices=4", f"--heartbeat_timeout_s={HEARTBEAT_S}"]


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
def reference(tmp_path_factory) -> dict[int, float]:
    """{step: loss} of the same training in one process of 8 devices, outside SLURM."""
    workdir = tmp_path_factory.mktemp("reference") / "run"
    done = run_cli(*TRAIN, f"--config.train.steps={STEPS}", "--num_cpu_devices=8", f"--workdir={workdir}")
    assert done.returncode == 0, done.stderr[-3000:]
    return helpers.losses(workdir)


def submit(slurm, workdir: pathlib.Path, *sbatch: str) -> str:
    """sbatch train.sbatch from the repository (its submit directory), the tasks running this interpreter."""
    out = slurm.run("sbatch", "--parsable", *NODE, f"--output={workdir.parent / 'job.out'}", *sbatch,
                    "experiments/slurm/train.sbatch", CONFIG.removeprefix("--config="), str(workdir), *RUN,
                    cwd=ROOT, env={"PYTHON": sys.executable})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def wait(condition, slurm, job: str, what: str, timeout: float = 120) -> float:
    """Poll until `condition()` holds; its time in seconds. Fails if the job is gone or time runs out."""
    start = time.monotonic()
    while not condition():
        state = slurm.job(job).get("JobState", "gone")
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


def preempt(slurm, job: str, workdir: pathlib.Path, resumed_from: int) -> int:
    """SIGTERM to the job's tasks (scancel --signal=TERM, as SLURM does before a time limit or a preemption): both
    save one step, exit 75, and the script requeues the job."""
    wait(lambda: helpers.last_step(workdir) > resumed_from + 1, slurm, job, "steps after the resume")
    assert slurm.run("scancel", "--signal=TERM", job).returncode == 0
    wait(lambda: restarts(slurm, job) == 2, slurm, job, "the requeue after the preemption")
    saved = re.findall(r"preempted: saved checkpoint \S+/checkpoints/(\d+); run the same", output(workdir))
    assert len(saved) == 2 and saved[0] == saved[1], output(workdir)[-3000:]  # one line per task, one step
    assert "tasks 0-1: Exited with exit code 75" in output(workdir) or \
        output(workdir).count("Exited with exit code 75") == 2, output(workdir)[-3000:]
    return int(saved[0])


def test_sbatch_trains_as_one_process_through_a_save_a_lost_task_and_a_preemption(slurm, reference, tmp_path):
    workdir = tmp_path / "run"
    job = submit(slurm, workdir)
    usr1 = save_and_go_on(slurm, job, workdir)
    events = lose_a_task(slurm, job, workdir, usr1)
    term = preempt(slurm, job, workdir, usr1)
    wait(lambda: slurm.job(job).get("JobState") == "COMPLETED", slurm, job, "the last attempt", timeout=180)
    record = slurm.job(job)
    assert record["ExitCode"] == "0:0" and record["Restarts"] == "2", record
    assert f"resumed from {workdir}/checkpoints/{term}," in output(workdir)
    logged = helpers.losses(workdir)
    assert sorted(logged) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([logged[s] for s in range(1, STEPS + 1)],
                               [reference[s] for s in range(1, STEPS + 1)], rtol=1e-5)
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line]
    records = [r for r in records if "loss" in r]
    assert all(len(r["host_step_time_s"]) == 2 for r in records)  # two processes, joined from SLURM's variables
    print(f"\n{slurm.version}: SIGUSR1 saved {usr1}; {events}; SIGTERM saved {term}")
