"""A run's workdir across phases, through `python -m train`: a second run on a workdir in use stops at once
naming the holder while the first finishes untouched; `--workdir=DIR` alone continues with every override the
run had, to the same losses; an allowed change is recorded in config.json's history (a forbidden one is refused:
tests/cli/test_bad_inputs.py)."""
import json
import re
import shutil
import subprocess

from tests.helpers import losses, run_cli, start_cli, wait_for
from train import exit_codes
from train.runtime import lock as lock_lib

FIRST = ["--config=experiments/tiny.py", "--config.data.source=synthetic", "--config.mesh.data=8",
         "--config.model.d_model=64", "--config.model.n_layers=4", "--config.train.steps=6",
         "--config.train.log_every=1", "--config.train.eval_every=0", "--config.optimizer.warmup_steps=2",
         "--config.checkpoint.every_steps=3",
         "--config.fault_injection.step_delay_s=0.5"]  # slow steps: the second run arrives while it trains


def test_one_run_per_workdir_then_resume_by_workdir_alone(tmp_path):
    workdir = tmp_path / "run"
    first = start_cli("train", *FIRST, f"--workdir={workdir}", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for(lambda: (workdir / lock_lib.NAME).exists(), first, timeout=120)
    second = run_cli(*FIRST, f"--workdir={workdir}", timeout=120)
    assert first.poll() is None, "the first run ended before the second reached the lock: slow its steps more"
    assert second.returncode == exit_codes.USER_ERROR, second.stderr[-2000:]
    assert re.fullmatch(rf"error: --workdir={workdir} is in use by another run \(host \S+, pid {first.pid}, "
                        r"started \S+, 1 process\(es\), heartbeat \d+s ago\); wait for it to end, stop it, or "
                        r"choose another --workdir", second.stderr.strip()), second.stderr
    output, _ = first.communicate(timeout=180)
    assert first.returncode == 0, output[-3000:]
    reference = losses(workdir)  # every step once: the second run wrote nothing
    assert sorted(reference) == [1, 2, 3, 4, 5, 6] and not (workdir / lock_lib.NAME).exists()

    shutil.rmtree(workdir / "checkpoints" / "6")  # as if stopped after step 5: resume from step 3
    alone = run_cli(f"--workdir={workdir}", timeout=180)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert "from step 3" in alone.stdout and "this phase changes" not in alone.stdout
    assert losses(workdir) == reference  # d_model, n_layers, mesh, seed, ... all carried over: the same numbers

    longer = run_cli(f"--workdir={workdir}", "--config.train.steps=7", timeout=180)
    assert longer.returncode == 0, longer.stderr[-3000:]
    saved = json.loads((workdir / "config.json").read_text())
    assert [h["changes"] for h in saved["history"]] == [{"train.steps": [6, 7]}]
    assert saved["config_file"] == "experiments/tiny.py" and saved["config"]["model"]["d_model"] == 64
    assert sorted(losses(workdir)) == list(range(1, 8))  # a forbidden change: tests/cli/test_bad_inputs.py
