"""Several processes form one run: same numbers as one process, a one-process checkpoint continues in two,
and a dead process ends the launch. Three training runs in all: one process, and two launches of two."""
import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from tests import helpers
from tests.helpers import run_cli, start_cli

TRAIN = ["--config=experiments/tiny.py", "--config.data.source=synthetic", "--config.train.log_every=1",
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


def test_one_process_checkpoint_continues_in_two_then_killing_one_ends_the_launch_and_a_relaunch_resumes(
        tmp_path, single):
    """The launch starts from the one-process run's step 4 (a checkpoint written by one process continues in
    two); process 1 is killed once it has saved a checkpoint of its own; the relaunch resumes that."""
    shutil.copytree(single, tmp_path / "run")
    run = [*TRAIN, f"--workdir={tmp_path / 'run'}", "--config.checkpoint.every_steps=2"]
    proc = launch(*run, "--config.train.steps=100000")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and max(committed(tmp_path / "run")) <= 4:
        time.sleep(0.5)
    victim = subprocess.run(["pgrep", "-f", f"workdir={tmp_path / 'run'} .*--process_id=1"], capture_output=True,
                            text=True).stdout.split()
    assert victim, "process 1 not found"
    os.kill(int(victim[0]), signal.SIGKILL)
    killed_at = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - killed_at < 60
    assert "from step 4" in out
    saved = max(committed(tmp_path / "run"))
    proc = launch(*run, f"--config.train.steps={saved + 1}")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    assert f"from step {saved}" in out
    assert len(losses(tmp_path / "run")) == saved + 1  # every step logged once, from the one-process run's on
