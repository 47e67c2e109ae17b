"""train.launch's restart rules (train/launch/elastic.py) and the JobSet manifest that gives a cluster the same
rules; the restart itself runs in tests/train/test_multiprocess.py (a lost process relaunched on one)."""
import json
import os
import subprocess

import pytest

from tests.helpers import ROOT
from train import exit_codes
from train.launch import elastic, jobset

ARGS = ("--config=experiments/tiny.py", "--workdir=/w")


def test_restart_rules():
    policy = elastic.Policy(max_restarts=2, min_processes=1, backoff_s=4.0)
    first = elastic.Launch(2, ARGS)
    crashed = policy.next(first, exit_codes.CRASH, lost=False, stopping=False)
    assert crashed == elastic.Launch(2, ARGS, 1) and policy.delay_s(crashed) == 4.0  # same size, plain restart
    lost = policy.next(crashed, 137, lost=True, stopping=False)
    assert lost == elastic.Launch(1, (*ARGS, elastic.REPLAN), 2) and policy.delay_s(lost) == 8.0  # one fewer, planned
    assert policy.next(lost, 137, lost=True, stopping=False) is None  # restarts used up
    again = elastic.Launch(1, ARGS)
    assert policy.next(again, 137, lost=True, stopping=False).processes == 1  # never below min_processes
    for final in elastic.FINAL:  # a restart cannot help: done, user error, not finite, nothing to restore
        assert policy.next(first, final, lost=False, stopping=False) is None
    assert policy.next(first, exit_codes.REQUEUE, lost=False, stopping=False) is not None  # preempted: requeue
    assert policy.next(first, exit_codes.REQUEUE, lost=False, stopping=True) is None  # unless the user stopped it
    laid_out = elastic.Launch(2, (*ARGS, "--config.mesh.data=2", "--config.train.grad_accum_steps=2",
                                  "--config.plan.fixed=tensor:2", "--config.train.steps=9"))
    assert policy.next(laid_out, 137, lost=True, stopping=False).args == (  # the layout of the devices lost goes
        *ARGS, "--config.plan.fixed=tensor:2", "--config.train.steps=9", elastic.REPLAN)


def test_jobset_manifest_runs_the_arguments_under_the_same_rules():
    made = json.loads(jobset.manifest(list(ARGS), processes=4, image="img", gpus=8, max_restarts=3))
    assert made["kind"] == "JobSet" and made["spec"]["failurePolicy"]["maxRestarts"] == 3
    job = made["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 4 and job["completionMode"] == "Indexed"
    final = job["podFailurePolicy"]["rules"][0]
    assert final["action"] == "FailJob" and set(final["onExitCodes"]["values"]) == set(elastic.FINAL) - {0}
    container = job["template"]["spec"]["containers"][0]
    command = container["command"]
    assert command[:5] == ["python", "-m", "train", *ARGS]
    assert "--coordinator_address=spmdtrain-workers-0-0.spmdtrain:8476" in command
    assert "--num_processes=4" in command and "--process_id=$(JOB_COMPLETION_INDEX)" in command
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8


@pytest.mark.parametrize("status, restarts, requeued", [
    (exit_codes.REQUEUE, 9, True), (137, 0, True), (exit_codes.WATCHDOG, 2, True), (137, 3, False),
    (exit_codes.USER_ERROR, 0, False), (exit_codes.NON_FINITE, 0, False), (exit_codes.OK, 0, False)])
def test_slurm_script_requeues_under_the_same_rules(tmp_path, status, restarts, requeued):
    """experiments/slurm/train.sbatch with stand-ins for srun (ends with `status`) and scontrol (records)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", f"exit {status}"), ("scontrol", f'echo "$@" > {tmp_path / "scontrol"}')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(ROOT),
           "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": str(restarts)}
    done = subprocess.run(["bash", str(ROOT / "experiments" / "slurm" / "train.sbatch"), "experiments/tiny.py",
                           str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == status, done.stderr
    assert (tmp_path / "scontrol").exists() == requeued, done.stdout
    if requeued:
        assert (tmp_path / "scontrol").read_text().split() == ["requeue", "7"]
