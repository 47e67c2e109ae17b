"""The loop as a scheduler of actions: a user action from an experiment runs at its cadence and W&B
(offline) records the run (with checkpoint.enabled=False: nothing saved); TensorBoard writes its scalars
without importing torch; the house rules of train/ (function length, loop parameters) hold."""
import ast
import json
import math

import jax
import numpy as np
import pytest

from tests.helpers import ROOT, run_python, tiny_config
from train.config.experiment import ConfigError
from train.loop import actions
from train.loop import runner as loop


def small_config(steps: int = 6):
    config = tiny_config(data=8)
    config.model.update(d_model=32, n_layers=2, n_heads=2)
    config.train.update(steps=steps, global_batch_size=8, log_every=2, eval_every=0, eval_batches=1)
    config.optimizer.warmup_steps = 1
    config.checkpoint.every_minutes = 0.0
    return config


def test_user_action_runs_at_its_cadence_and_wandb_writes_offline(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb").mkdir()
    seen = []

    def param_norm(info):
        step, state, metrics = info.step, info.state, info.metrics
        seen.append(step)
        norm = math.sqrt(sum(float(np.sum(np.square(np.asarray(x)))) for x in jax.tree.leaves(state["params"])))
        return {"param_norm": norm, "loss_again": float(metrics["loss"])}

    actions.register("param_norm_every_3", lambda config: actions.Every(3, param_norm))
    config = small_config()
    config.train.update(actions="param_norm_every_3", loggers="tensorboard,wandb")
    config.checkpoint.enabled = False  # also the benchmark mode: no checkpoint written, one warning line
    loop.run(config, str(tmp_path / "run"))
    assert seen == [3, 6]
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert capsys.readouterr().out.count("warning: checkpoint.enabled=False") == 1
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    custom = [r for r in records if "param_norm" in r]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert [r["step"] for r in custom] == [3, 6] and all(r["param_norm"] > 0 for r in custom)
    assert custom[1]["loss_again"] == losses[6]  # the metrics handed over are those of that step
    runs = list((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert list((tmp_path / "run" / "tensorboard").iterdir())


_TENSORBOARD_PROBE = """
import pathlib, sys
from train.loop.metrics import TensorBoard
board = TensorBoard(pathlib.Path(sys.argv[1]), None)
board.scalars(7, {"loss": 1.5})
board.close()
print("torch" in sys.modules)
"""


def test_tensorboard_writes_scalars_without_importing_torch(tmp_path):
    """A fresh process (torch is installed with the hf extra): the writer does not pay torch's import."""
    out = run_python("-c", _TENSORBOARD_PROBE, str(tmp_path), timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", (out.stdout, out.stderr[-2000:])
    from tensorboardX.proto import event_pb2
    (path,) = (tmp_path / "tensorboard").iterdir()
    data, values = path.read_bytes(), []
    while data:  # TFRecord framing: u64 length, u32 crc, payload, u32 crc
        length = int.from_bytes(data[:8], "little")
        event = event_pb2.Event.FromString(data[12:12 + length])
        values += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
        data = data[16 + length:]
    assert values == [(7, "loss", 1.5)]


def test_unknown_action_or_logger_is_a_config_error(tmp_path):
    config = small_config()
    config.train.actions = "nope"
    with pytest.raises(ConfigError, match="train.actions='nope': unknown action 'nope'"):
        loop.run(config, str(tmp_path / "a"))
    config = small_config()
    config.train.loggers = "tensorbored"
    with pytest.raises(ConfigError, match="train.loggers='tensorbored': unknown logger 'tensorbored'"):
        loop.run(config, str(tmp_path / "b"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _functions(folder: str, pattern: str = "*.py"):
    for path in sorted((ROOT / folder).glob(pattern)):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs) + bool(args.vararg) + bool(
                    args.kwarg)
                yield path.name, node.name, node.end_lineno - node.lineno + 1, count


def test_train_functions_are_short_and_loop_functions_take_few_parameters():
    found = list(_functions("train", "**/*.py"))
    assert len(found) > 100  # the walk sees the whole folder
    long = [(f, n, lines) for f, n, lines, _ in found if lines > 50]
    assert not long, f"functions over 50 lines: {long}"
    # The training loop's (train/loop/), not the serving engine's runner.py and scheduler.py.
    wide = [(f, n, c) for f, n, _, c in _functions("train/loop") if f in ("runner.py", "scheduler.py") and c > 5]
    assert not wide, f"loop functions over 5 parameters: {wide}"


def test_train_subpackage_functions_are_short():
    """The 50-line rule holds in train/'s subpackages (train/plan/...) too, not only its top level."""
    folders = sorted({p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "train").rglob("*/*.py")})
    assert "train/plan" in folders
    found = [(folder, f, n, lines) for folder in folders for f, n, lines, _ in _functions(folder)]
    assert len(found) > 30  # the walk sees the subpackages' functions
    long = [item for item in found if item[3] > 50]
    assert not long, f"functions over 50 lines: {long}"


def test_fault_injection_is_an_action_only_a_test_config_adds():
    """The production loop holds no fault injection; a test's fault_injection.* puts it first, before
    step s-1's metrics are fetched, and the documented order of the built-in actions holds."""
    import dataclasses
    import types

    from train.config import sections
    from train.config.experiment import base_config
    from train.loop import builtin as loop_actions
    config = base_config()
    checkpoint_section = sections.CheckpointSection.from_config(config.checkpoint)
    faults = sections.FaultSection.from_config(config.fault_injection)
    loop = types.SimpleNamespace(plan=types.SimpleNamespace(faults=faults, checkpoint=checkpoint_section))
    names = [type(a).__name__ for a in loop_actions.step_actions(loop, [])]
    assert names == ["FetchPending", "SavePoll", "ProfileStop", "SavePrepare", "FetchNow", "Evaluation",
                     "CheckpointSave", "UserActions", "PreemptionStop"]
    config.fault_injection.step_delay_s = 0.1
    loop.plan.faults = sections.FaultSection.from_config(config.fault_injection)
    assert [type(a).__name__ for a in loop_actions.step_actions(loop, [])] == ["FaultInjection", *names]
    loop.plan.checkpoint = dataclasses.replace(checkpoint_section, enabled=False)  # checkpoint.enabled=False
    assert [type(a).__name__ for a in loop_actions.step_actions(loop, [])] == [
        "FaultInjection", *(n for n in names if n not in ("SavePrepare", "CheckpointSave"))]
    metric = [type(a).__name__ for a in loop_actions.metric_actions(loop)]
    assert metric == ["StepClock", "WatchdogKick", "StopSaveAgreement", "NonFiniteGuard", "MetricsLogging"]


def test_loop_actions_take_few_parameters():
    found = [(f, n, c) for f, n, _, c in _functions("train", "**/*.py") if f in ("builtin.py", "sections.py")]
    assert len(found) > 20
    wide = [item for item in found if item[2] > 5]
    assert not wide, f"loop functions over 5 parameters: {wide}"
