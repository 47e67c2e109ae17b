"""Fault tolerance end to end, through `python -m train` subprocesses on a half-size tiny model: SIGKILL
chaos with exact replay, SIGTERM requeue, SIGUSR1 save-and-go-on, damaged checkpoints, a model-shape change,
resharding, failing saves (retried, then stopping the run), the non-finite stop, the watchdog, bad inputs and
restore_from (test_multiprocess.py preempts one of two processes). Every run but the reference shares the tests'
compilation cache."""
import json
import random
import re
import resource
import shutil
import signal
import subprocess
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.helpers import ROOT, last_step, losses, run_cli, start_cli, wait_for
from train import exit_codes
from train.prepare import command as prepare

STEPS = 12
# Half the tiny model's width and layers (4 still splits into 2 stages x 2 virtual stages): a warm run then
# takes about half the CPU time, and what these tests check does not depend on the model's size.
BASE = ["--config=experiments/tiny.py", "--config.data.source=tokens", "--config.data.path=", "--config.mesh.data=8",
        "--config.model.d_model=64", "--config.model.n_layers=4",
        f"--config.train.steps={STEPS}", "--config.train.log_every=1", "--config.train.eval_every=6",
        "--config.train.eval_batches=1", "--config.optimizer.warmup_steps=2",
        f"--config.optimizer.decay_steps={STEPS}",  # fixed, so runs stopped early share the schedule
        "--config.checkpoint.every_steps=2", "--config.checkpoint.keep=3"]


@pytest.fixture(scope="module", autouse=True)
def prepared_datadir(tmp_path_factory):
    """Every run reads a DATADIR made by train.prepare (the bytes of this repository's train/ sources)."""
    out = tmp_path_factory.mktemp("data") / "train-sources"
    prepare.prepare([str(ROOT / "train")], str(out), "bytes", val_percent=25)
    BASE[2] = f"--config.data.path={out}"
    return out


def train(workdir, *extra, timeout=180, env=None):
    return run_cli(*BASE, f"--workdir={workdir}", *extra, timeout=timeout, env=env)


def start(workdir, *extra):
    """A run in the background; its output goes to WORKDIR.out (appended)."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = open(workdir.with_suffix(".out"), "a")
    return start_cli("train", *BASE, f"--workdir={workdir}", *extra, stdout=out, stderr=subprocess.STDOUT)


def state_arrays(workdir, step=STEPS) -> dict[str, np.ndarray]:
    """The saved state as numpy arrays, read by a plain Orbax client."""
    tree = ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "state")
    flat, _ = __import__("jax").tree_util.tree_flatten_with_path(tree)
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v) for path, v in flat}


def assert_bitwise_equal(workdir, reference):
    ours, ref = state_arrays(workdir), state_arrays(reference)
    assert ours.keys() == ref.keys()
    for name in ref:
        np.testing.assert_array_equal(ours[name], ref[name], err_msg=name)
    assert losses(workdir) == losses(reference)


def listing(path):
    return sorted((str(p.relative_to(path)), p.stat().st_size) for p in path.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: the numbers every other run must reproduce. It compiles everything afresh
    (no persistent cache) while the others load from the shared cache: bitwise equality then also shows
    that the cache (and the donated state buffers, used by all) change no bit."""
    workdir = tmp_path_factory.mktemp("reference") / "run"
    result = train(workdir, "--compilation_cache=", env={"JAX_COMPILATION_CACHE_DIR": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    # The periodic eval loss shows below its step's training line; nothing of the libraries reaches the console.
    evals = re.findall(r"^step (\d+)/12 \| loss .*\nstep \1/12 \| eval loss \d+\.\d{4}$", result.stdout, re.M)
    assert evals == ["6", "12"], result.stdout
    assert not re.search(r"^[IWEF]\d{4} |Traceback", result.stdout + result.stderr, re.M), result.stderr[-3000:]
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [8, 10, 12]
    goodput = json.loads((workdir / "goodput.json").read_text())
    assert goodput["attempts"][0]["last_step"] == STEPS and 0 < goodput["totals"]["goodput"] < 1
    return workdir


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    """The same run stopped at step 8 (checkpoints 4, 6, 8): copied by the tests that damage it."""
    workdir = tmp_path_factory.mktemp("partial") / "run"
    result = train(workdir, "--config.train.steps=8")
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


def local_steps(local_dir) -> list[int]:
    """The committed steps of a single-process run's local tier (checkpoint.local_dir)."""
    committed = local_dir.glob("*/process_0_of_1/own/*/manifest.json")
    return sorted(int(p.parent.name) for p in committed if p.parent.name.isdigit())


def test_sigkill_chaos_replays_exactly(tmp_path, reference):
    """Three SIGKILLs, with persistent saves every 8 steps and local ones (checkpoint.local_dir) every step. The
    first comes once local step 3 has committed, before persistent step 8: the run resumes from its newest local
    step, not from the start. The others come at random points (mid-step, mid-save or mid-log), and the run ends
    bit for bit as the uninterrupted one."""
    workdir, local_dir, rng = tmp_path / "run", tmp_path / "shm", random.Random(7)
    tiers = ("--config.checkpoint.every_steps=8", f"--config.checkpoint.local_dir={local_dir}",
             "--config.checkpoint.local_every_steps=1")
    out, newest_local = workdir.with_suffix(".out"), None
    for kill in range(3):
        process = start(workdir, *tiers, "--config.fault_injection.step_delay_s=0.1")
        wait_for(lambda kill=kill: len(re.findall(r"from step (\d+)", out.read_text())) > kill, process)
        restored = int(re.findall(r"from step (\d+)", out.read_text())[-1])
        if kill == 0:
            wait_for(lambda: (local_steps(local_dir) or [0])[-1] >= 3, process)
        else:
            target = min(restored + rng.randint(1, 4), STEPS - 2)  # two delayed steps left: it cannot finish first
            wait_for(lambda target=target: last_step(workdir) >= target, process)
            time.sleep(rng.uniform(0.0, 0.1))
        process.kill()
        assert process.wait() == -signal.SIGKILL
        newest_local = newest_local or local_steps(local_dir)[-1]
    assert re.search(rf"from step {newest_local} \(resumed from {local_dir}/run-\w+/process_0_of_1/own/"
                     rf"{newest_local}, local tier\)", out.read_text()), out.read_text()
    assert 3 <= newest_local < 8
    result = train(workdir, *tiers)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_bitwise_equal(workdir, reference)
    goodput = json.loads((workdir / "goodput.json").read_text())
    assert len(goodput["attempts"]) == 4 and goodput["attempts"][-1]["exit_status"] == 0


def test_sigterm_saves_the_step_reached_and_requeues(tmp_path, reference):
    workdir = tmp_path / "run"
    process = start(workdir, "--config.checkpoint.every_steps=0", "--config.fault_injection.step_delay_s=0.3")
    wait_for(lambda: last_step(workdir) >= 3, process)
    process.send_signal(signal.SIGTERM)
    logged = last_step(workdir)  # step logged+1 was dispatched, logged+2 may be: they run, nothing later
    assert process.wait(timeout=60) == exit_codes.REQUEUE
    out = workdir.with_suffix(".out").read_text()
    saved = int(re.search(r"preempted: saved checkpoint .*/checkpoints/(\d+)", out).group(1))
    assert [int(p.name) for p in (workdir / "checkpoints").iterdir()] == [saved]
    assert 3 <= saved <= logged + 2 and saved < STEPS and last_step(workdir) == saved
    result = train(workdir, "--config.checkpoint.every_steps=0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"from step {saved}" in result.stdout
    assert_bitwise_equal(workdir, reference)


def test_second_ctrl_c_aborts_at_once(tmp_path):
    workdir = tmp_path / "run"
    process = start(workdir, "--config.fault_injection.step_delay_s=0.3")
    wait_for(lambda: last_step(workdir) >= 2, process)
    process.send_signal(signal.SIGINT)
    # The second signal waits for the first one's handler (it prints at once): two signals that arrive before
    # Python runs its handler are one signal to it, so a fixed pause flaked under load.
    out = workdir.with_suffix(".out")
    wait_for(lambda: "SIGINT: finishing the step in flight" in out.read_text(), process)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == -signal.SIGINT
    assert "SIGINT: finishing the step in flight" in workdir.with_suffix(".out").read_text()


@pytest.mark.parametrize("damage", ["overwrite", "bitflip"])
def test_damaged_newest_checkpoint_falls_back_then_matches(tmp_path, reference, partial, damage):
    workdir = tmp_path / "run"
    shutil.copytree(partial, workdir)
    files = [p for p in (workdir / "checkpoints" / "8").rglob("*") if p.is_file()]
    if damage == "overwrite":
        for path in files:
            path.write_bytes(b"\0garbage" * (path.stat().st_size // 8 + 1))
    else:
        largest = max(files, key=lambda p: p.stat().st_size)
        data = bytearray(largest.read_bytes())
        for offset in range(len(data) // 4, len(data), len(data) // 4):
            data[offset] ^= 0x55
        largest.write_bytes(bytes(data))
    result = train(workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"checkpoint .*/checkpoints/8 is damaged: .*; moved it to .*checkpoints.set_aside/8\.",
                     result.stdout), result.stdout
    assert "from step 6" in result.stdout
    assert_bitwise_equal(workdir, reference)


def test_model_shape_change_is_a_config_error_that_moves_nothing(tmp_path, partial):
    workdir = tmp_path / "run"
    shutil.copytree(partial, workdir)
    before = listing(workdir)
    result = train(workdir, "--config.model.d_model=32")
    assert result.returncode == exit_codes.USER_ERROR
    message = result.stderr.strip().splitlines()[-1]
    assert re.match(r"error: checkpoint .*/checkpoints/8 holds a different model or optimizer shape than the "
                    r"config \(\S+: checkpoint float32\(.*\), config float32\(.*\)", message), message
    assert listing(workdir) == before and not (workdir / "checkpoints.set_aside").exists()


def test_checkpoint_from_before_data_order_resumes_with_random(tmp_path, reference, partial):
    """Checkpoints whose meta has no data.order were trained with random windows: they resume that way
    (the same losses as resuming with data.order=random set), and the new checkpoints record it."""
    old, explicit = tmp_path / "old", tmp_path / "explicit"
    for workdir in (old, explicit):
        shutil.copytree(partial, workdir)
    for path in (old / "checkpoints").glob("*/meta/metadata"):
        meta = json.loads(path.read_text())
        del meta["config"]["data"]["order"]
        path.write_text(json.dumps(meta))
    for workdir in (old, explicit):  # the config.json of a run from then has no data.order either
        saved = json.loads((workdir / "config.json").read_text())
        del saved["config"]["data"]["order"]
        (workdir / "config.json").write_text(json.dumps(saved))
    for workdir, extra in ((old, ()), (explicit, ("--config.data.order=random",))):
        result = train(workdir, *extra)
        assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((old / "checkpoints" / str(STEPS) / "meta" / "metadata").read_text())
    assert saved["config"]["data"]["order"] == "random"
    assert losses(old) == losses(explicit) and losses(old)[STEPS] != losses(reference)[STEPS]  # epochs differ


def test_resume_on_other_meshes_continues_the_same_losses(tmp_path, reference, partial):
    """Saved on data=8 (step 8), resumed on data=2,fsdp=2,tensor=2 (to 10), then on 4 devices as an
    interleaved pipeline, whose in-memory layer order differs (to 12)."""
    workdir = tmp_path / "run"
    shutil.copytree(partial, workdir)
    runs = [("--config.train.steps=10", "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"),
            ("--num_cpu_devices=4", "--config.mesh.data=1", "--config.mesh.pipeline=2", "--config.mesh.tensor=2",
             "--config.pipeline.schedule=interleaved", "--config.pipeline.virtual_stages=2")]
    for args, restored in zip(runs, (8, 10)):
        result = train(workdir, "--config.checkpoint.every_steps=1", *args)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"from step {restored}" in result.stdout
    ours, ref = losses(workdir), losses(reference)
    assert sorted(ours) == sorted(ref)
    np.testing.assert_allclose([ours[s] for s in range(9, 13)], [ref[s] for s in range(9, 13)], rtol=1e-4)


def limit_file_size(process, size):
    """Tests run as root, and permissions do not stop root, so a directory cannot simply be made read-only.
    Instead the run's file-size limit is changed mid-run (prlimit, the kernel's per-process quota, which binds
    root too): under 256 KiB the small logs still fit, a checkpoint's data files do not, so its background
    write fails with EFBIG as it would on a full disk."""
    resource.prlimit(process.pid, resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))  # soft: it can return


def partial_files(workdir):
    return [p.name for p in (workdir / "checkpoints").iterdir() if "tmp" in p.name]


def test_failed_saves_are_retried_then_stop_the_run_at_the_limit(tmp_path):
    workdir = tmp_path / "run"
    process = start(workdir, "--config.checkpoint.every_steps=1", "--config.fault_injection.step_delay_s=0.2")
    wait_for(lambda: (workdir / "checkpoints" / "2").is_dir(), process)
    limit_file_size(process, 256 << 10)
    assert process.wait(timeout=60) == exit_codes.SAVE_FAILED
    out = workdir.with_suffix(".out").read_text().strip().splitlines()
    # Its console (stdout and stderr) holds the project's lines only; Orbax's errors and tracebacks are in the log.
    foreign = [line for line in out if line and not line.startswith(("training ", "step ", "warning: ", "error: "))]
    assert not foreign, foreign[:20]
    log = (workdir / "logs" / "process_0.log").read_text()
    assert "Traceback" in log and re.search(r"^E\d{4} .*\] \[process=0\]", log, re.M), log[-3000:]
    warnings = [line for line in out if line.startswith("warning: background save of checkpoint")]
    assert len(warnings) == 2 and "training goes on and saves again when the next save is due (1 failed" in warnings[0]
    assert re.match(r"error: background save of checkpoint .*/checkpoints/\d+ failed \(.*File too large.*\); "
                    r"the newest complete checkpoint is intact.*\(3 failed save\(s\) in a row, "
                    r"checkpoint.max_failed_saves=3\)$", out[-1]), out[-1]
    failed = json.loads((workdir / "goodput.json").read_text())["attempts"][-1]["failed_saves"]
    assert len(failed) == 3 and [f["step"] for f in failed] == list(range(failed[0]["step"], failed[0]["step"] + 3))
    # Each failure removes the partial files of every failed save so far; only the last one's could have been
    # written on by a writer Orbax had not stopped yet (the next start's cleanup takes those).
    assert all(name.startswith(f"{failed[-1]['step']}.") for name in partial_files(workdir)), partial_files(workdir)
    committed = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert committed and committed[-1] < failed[0]["step"]
    assert state_arrays(workdir, committed[-1])  # the newest complete checkpoint still restores


def test_sigusr1_saves_and_goes_on_and_storage_that_heals_loses_nothing(tmp_path, reference):
    """SIGUSR1 saves the step reached and training goes on; then saves fail for a while (fewer than
    checkpoint.max_failed_saves in a row) and succeed again: the run ends as an uninterrupted one, bit for bit."""
    workdir = tmp_path / "run"
    process = start(workdir, "--config.checkpoint.every_steps=6", "--config.checkpoint.max_failed_saves=20",
                    "--config.fault_injection.step_delay_s=0.3")
    wait_for(lambda: last_step(workdir) >= 1, process)
    process.send_signal(signal.SIGUSR1)
    wait_for(lambda: any(int(p.name) < 6 for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()), process)
    limit_file_size(process, 256 << 10)
    wait_for(lambda: "warning: background save" in workdir.with_suffix(".out").read_text(), process)
    limit_file_size(process, resource.RLIM_INFINITY)
    assert process.wait(timeout=120) == 0, workdir.with_suffix(".out").read_text()[-3000:]
    out = workdir.with_suffix(".out").read_text()
    assert "SIGUSR1: saving a checkpoint after the step in flight; training goes on" in out
    failed = json.loads((workdir / "goodput.json").read_text())["totals"]["failed_saves"]
    assert failed >= 1 and not partial_files(workdir)
    assert_bitwise_equal(workdir, reference)


def test_non_finite_loss_stops_naming_the_step_and_saves_nothing_after(tmp_path):
    workdir = tmp_path / "run"
    result = train(workdir, "--config.fault_injection.nan_at_step=5")
    assert result.returncode == exit_codes.NON_FINITE
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("loss nan and gradient norm nan at step 5: not finite; stopped without saving it "
                              "(the newest checkpoint is step 4)"), message
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [2, 4]
    assert last_step(workdir) == 4


def test_watchdog_dumps_every_stack_and_exits(tmp_path):
    workdir = tmp_path / "run"
    t0 = time.monotonic()
    result = train(workdir, "--config.train.step_timeout_s=3", "--config.fault_injection.hang_at_step=4",
                   "--config.fault_injection.hang_s=600")
    assert result.returncode == exit_codes.WATCHDOG, result.stderr[-3000:]
    assert time.monotonic() - t0 < 120
    assert "watchdog: no progress for" in result.stderr and "(train.step_timeout_s=3)" in result.stderr
    assert "most recent call first" in result.stderr and "Thread 0x" in result.stderr
    assert json.loads((workdir / "goodput.json").read_text())["attempts"][-1]["exit_status"] == exit_codes.WATCHDOG


def test_bad_inputs_are_one_line_errors(tmp_path):
    missing = train(tmp_path / "a", f"--config.checkpoint.restore_from={tmp_path / 'nope'}:3")
    assert missing.returncode == exit_codes.USER_ERROR
    assert missing.stderr.strip().splitlines()[-1].startswith("error: checkpoint.restore_from=")
    (tmp_path / "file").write_text("not a directory")
    unwritable = train(tmp_path / "file" / "run")
    assert unwritable.returncode == exit_codes.USER_ERROR
    assert unwritable.stderr.strip().splitlines()[-1].startswith(f"error: --workdir={tmp_path / 'file' / 'run'}")


def test_restore_from_continues_another_runs_state(tmp_path, reference, partial):
    workdir = tmp_path / "run"
    # Saves by time only, due at once: the decision travels with the metrics, read after the next step is
    # dispatched, so every second step is saved (10, then 12, also the final step).
    result = train(workdir, f"--config.checkpoint.restore_from={partial}:8", "--config.checkpoint.every_steps=0",
                   "--config.checkpoint.every_minutes=1e-6")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "from step 8 (full state of" in result.stdout
    ours, ref = losses(workdir), losses(reference)
    assert sorted(ours) == list(range(9, STEPS + 1)) and all(ours[s] == ref[s] for s in ours)
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [10, 12]
