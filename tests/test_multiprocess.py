"""Several processes form one run: same numbers as one process, a one-process checkpoint continues in two,
a preemption of one process stops both at the same step, a dead process ends the launch, and one process
resumes what two saved. Five runs in all: one process, three launches of two, and one process again."""
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
from tests.helpers import run_cli, start_cli
from train import exit_codes

TRAIN = ["--config=experiments/tiny.py", "--config.data.source=synthetic", "--config.train.log_every=1",
         "--config.model.d_model=64", "--config.model.n_layers=4",  # half size: faster, the same properties
         "--config.train.eval_every=0", "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]


def launch(*args: str, **kwargs) -> subprocess.Popen:
    return start_cli("train.launch", "--num_processes=2", "--num_cpu_devices=4", "--", *args,
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)


def losses(workdir) -> list[float]:
    return list(helpers.losses(workdir).values())


def committed(workdir) -> list[int]:
    """Steps of the checkpoints that finished committing (Orbax renames a save's folder to its step)."""
    folder = workdir / "checkpoints"
    return [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.is_dir() else []


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, 4 steps, checkpoints 2 and 4: the numbers two processes must match, and the checkpoint
    two processes continue from."""
    workdir = tmp_path_factory.mktemp("single") / "one"
    # data=2 is the outermost axis, so its two halves live in different processes.
    single = run_cli(*TRAIN, f"--workdir={workdir}", "--config.train.steps=4", "--config.checkpoint.every_steps=2")
    assert single.returncode == 0, single.stderr[-3000:]
    return workdir


def test_two_processes_match_one(tmp_path, single):
    proc = launch(*TRAIN, f"--workdir={tmp_path / 'two'}", "--config.train.steps=4")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(single), rtol=1e-5)
    assert len(losses(tmp_path / "two")) == 4  # only process 0 writes metrics
    records = [json.loads(l) for l in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert all(len(r["host_step_time_s"]) == 2 for r in records if "loss" in r)  # per-host step times


def kill_process_1(workdir, signum: int) -> None:
    """Send `signum` to process 1 of the launch training in `workdir` (train.launch passes --process_id)."""
    victim = subprocess.run(["pgrep", "-f", f"workdir={workdir} .*--process_id=1"], capture_output=True,
                            text=True).stdout.split()
    assert victim, "process 1 not found"
    os.kill(int(victim[0]), signum)


def test_one_process_checkpoint_continues_in_two_then_preempting_or_killing_one_and_resuming_in_one(
        tmp_path, single):
    """1. The launch starts from the one-process run's step 4 (a checkpoint written by one process continues
    in two). SIGTERM to process 1: the stop flag is agreed by an all-reduce, both processes save one step, the
    same, and the launch exits 75. 2. A relaunch resumes that step; process 1 is killed once it has saved a
    checkpoint of its own, which ends the launch. 3. One process resumes the two-process checkpoint."""
    workdir = tmp_path / "run"
    shutil.copytree(single, workdir)
    run = [*TRAIN, f"--workdir={workdir}", "--config.train.steps=100000"]
    proc = launch(*run, "--config.checkpoint.every_steps=0")
    helpers.wait_for(lambda: max(helpers.losses(workdir)) >= 5, proc, timeout=180)
    kill_process_1(workdir, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == exit_codes.REQUEUE, out[-3000:]
    assert "from step 4" in out
    saved = re.findall(r"\[p(\d)\] preempted: saved checkpoint .*/checkpoints/(\d+)", out)
    assert sorted(p for p, _ in saved) == ["0", "1"] and len({s for _, s in saved}) == 1, saved
    step = int(saved[0][1])
    assert sorted(committed(workdir)) == [2, 4, step]  # the one-process run's two, and the preemption's

    proc = launch(*run, "--config.checkpoint.every_steps=2")
    helpers.wait_for(lambda: max(committed(workdir)) > step, proc, timeout=180)
    kill_process_1(workdir, signal.SIGKILL)
    killed_at = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - killed_at < 60
    assert f"from step {step}" in out

    saved = max(committed(workdir))
    result = run_cli(*TRAIN, f"--workdir={workdir}", f"--config.train.steps={saved + 1}")
    assert result.returncode == exit_codes.OK, result.stderr[-3000:]
    assert f"from step {saved}" in result.stdout
    assert len(losses(workdir)) == saved + 1  # every step logged once, from the one-process run's on
