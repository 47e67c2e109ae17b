"""Shared test helpers: tiny configs and short runs, compiled once per layout."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys
import time
import weakref
from typing import Any

import jax
import numpy as np

from experiments.tiny import get_config
from train import placed as placed_lib
from train import step as step_lib
from train.serve.engine import Engine, SamplingParams, Settings
from train.trainer import Trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tiny_config(source: str = "synthetic", **mesh):
    config = get_config()
    config.data.source = source
    config.plan.auto = False  # the tests pin their layouts
    config.mesh.update({"data": 1, **mesh} if mesh else {"data": 1})
    return config


def reference_config(**mesh):
    """The model the layouts are held to one device on: the tiny model at half width (d_model 64), whose cold
    runs take about a fifth less CPU time; what a layout must compute does not depend on the width."""
    config = tiny_config(**mesh)
    config.model.d_model = 64
    return config


def run_steps(trainer: Trainer, steps: int, state=None):
    """Losses of `steps` updates from `state` (a fresh state when None; it is donated), and the final state."""
    state = trainer.init_state() if state is None else state
    losses = []
    for step in range(steps):
        state, metrics = trainer.train_step(state, trainer.batch(step))
        losses.append(float(metrics["loss"]))
    return np.array(losses), state


_WITH_GRADS: dict[int, Any] = {}  # id(trainer) -> its step_with_grads, dropped when the trainer is freed


def step_with_grads(trainer: Trainer):
    """jit(state, batch) -> (state, metrics, grads): the trainer's train step built from its own pieces with
    return_grads, so a run yields its first gradients without compiling loss_and_grad as a second program.
    Built once per trainer: tests that run twice on one trainer reuse the compiled step."""
    key = id(trainer)
    if key not in _WITH_GRADS:
        _WITH_GRADS[key] = step_lib.make_train_step(trainer.loss_and_grad, trainer.tx, trainer.schedule,
                                                    trainer.layout, return_grads=True,
                                                    **step_lib.guard_options(trainer.plan))
        weakref.finalize(trainer, _WITH_GRADS.pop, key, None)
    return _WITH_GRADS[key]


def compiled_step(trainer: Trainer):
    """The compiled program of `step_with_grads`, for tests that read what a layout runs (the audit, the
    collectives): after the layout's equivalence run it is jit's in-memory hit, where the production step would
    be a second compile. The production step pins the gradients to the parameters' layout as this one does,
    so the two run the same collectives."""
    return step_with_grads(trainer).lower(trainer.layout.abstract_state, trainer.abstract_batch()).compile()


def grads_and_run(trainer: Trainer, steps: int, state=None):
    """(first-step gradients, losses of `steps` updates, final state) from `state` (a fresh state when None;
    it is donated), every step run by one compiled program (step_with_grads)."""
    assert steps >= 1, steps
    state = trainer.init_state() if state is None else state
    step_fn, grads, losses = step_with_grads(trainer), None, []
    for step in range(steps):
        state, metrics, step_grads = step_fn(state, trainer.batch(step))
        grads = jax.device_get(step_grads) if step == 0 else grads
        losses.append(float(metrics["loss"]))
    return grads, np.array(losses), state


def rel_norm(a, b) -> float:
    """||a - b|| / ||b|| over whole pytrees."""
    diff = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    ref = sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in jax.tree.leaves(b))
    return (diff / ref) ** 0.5


# Updates every layout is held to one device over: the losses of steps 2 and 3 follow one and two optimizer updates,
# so a layout's Adam state and schedule are checked, not just its first gradients. One count for every file, so
# the one-device reference below is computed once per test process.
STEPS = 3


@functools.lru_cache(maxsize=None)
def single_device_run(steps: int = STEPS) -> dict:
    """The reference every layout is held to: reference_config on one device, `steps` updates from a fresh
    state: losses, first-step gradients, final params and the eval loss of the final params."""
    trainer = Trainer.build(reference_config(), num_devices=1)
    grads, losses, state = grads_and_run(trainer, steps)
    return {"losses": losses, "grads": grads, "params": state["params"],
            "eval_loss": float(trainer.eval_step(state["params"], trainer.batch(0, "eval")))}


def single_device_reference(steps: int = STEPS):
    ref = single_device_run(steps)
    return ref["losses"], ref["grads"]


def engine_greedy(cfg, params, prompt: list[int], new: int) -> tuple[list[int], list[dict[int, float]]]:
    """`new` greedy tokens of the serving engine on one device after `prompt`, and each one's top-8
    log-probabilities {id: log p} (one step shape compiled: chunks of 8)."""
    placed = placed_lib.on_one_device(cfg)
    placed = dataclasses.replace(placed, params=jax.device_put(params, placed.layout.params))
    settings = Settings(page_size=8, max_num_seqs=1, max_batch_tokens=8, prefill_chunk=8)
    engine = Engine.build(placed, settings, max_context=len(prompt) + new)
    [out] = engine.generate([list(map(int, prompt))], SamplingParams(max_tokens=new, logprobs=8))
    return out.token_ids, out.logprobs


def clear_lead(logprobs: list[dict[int, float]], margin: float = 1e-3) -> int:
    """How many leading tokens were chosen by more than `margin` over the runner-up: past a near-tie two
    implementations may pick differently, then diverge."""
    for i, row in enumerate(logprobs):
        top = sorted(row.values())[-2:]
        if top[1] - top[0] <= margin:
            return i
    return len(logprobs)


def run_python(*args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python ARGS` in the repository, its environment (with `env` added) sharing the tests' compilation
    cache; text output captured."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def run_cli(*args: str, timeout: float = 240, env: dict | None = None,
            module: str = "train") -> subprocess.CompletedProcess:
    """`python -m train ARGS` (or another `module`) in a subprocess sharing the tests' compilation cache."""
    return run_python("-m", module, *args, timeout=timeout, env=env)


def start_cli(module: str, *args: str, **popen) -> subprocess.Popen:
    """`python -m MODULE ARGS` in the background (e.g. train, or train.launch), text output."""
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, text=True, **popen)


def losses(workdir) -> dict[int, float]:
    """{step: loss} of a run's metrics.jsonl; a step logged twice fails."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r["step"] for r in records if "loss" in r]
    assert len(steps) == len(set(steps)), f"a step is logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def last_step(workdir) -> int:
    """The newest step a run's metrics.jsonl logs a loss for; 0 before it has one."""
    return max(losses(workdir), default=0) if (workdir / "metrics.jsonl").exists() else 0


def wait_for(condition, process: subprocess.Popen, timeout: float = 120):
    """Poll `condition` until it holds; fail if the background `process` ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended early with status {process.returncode}"
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


# Shared by the tests of one feature in several folders (tests/models and tests/sharding, tests/train's two
# multi-process files): the data and configs they all train on.
DOCUMENT_EOS = 0


def documents_datadir(path, n_tokens=6000, seed=0):
    """A DATADIR (meta.json with eos_id, train.bin, val.bin) of random tokens with EOS about every 9 tokens."""
    from train.data import tokenizer
    path.mkdir()
    rng = np.random.default_rng(seed)
    tokens = np.where(rng.random(n_tokens) < 0.11, DOCUMENT_EOS, rng.integers(1, 320, n_tokens)).astype(np.uint16)
    tokens.tofile(path / "train.bin")
    tokens[:1000].tofile(path / "val.bin")
    tokenizer.bytes_tokenizer().save(str(path / "tokenizer.json"))
    (path / "meta.json").write_text(json.dumps(dict(vocab_size=320, dtype="uint16", eos_id=DOCUMENT_EOS)))
    return path


def documents_config(path, **mesh):
    """The tiny model, two layers (one per pipeline stage), on documents_datadir's packed documents, masked."""
    config = tiny_config("tokens", **mesh)
    config.data.update(path=str(path), document_mask=True)
    config.model.update(n_layers=2, d_model=32, n_heads=4)
    return config


MOE_SEED = 5


def moe_config(**mesh):
    config = tiny_config(**mesh)
    config.model.preset = "moe-tiny"
    config.train.seed = MOE_SEED
    return config


# python -m train's arguments of the multi-process tests: half the tiny model on data x fsdp x tensor = 2 x 2 x 2.
MULTIPROCESS_TRAIN = [
    "--config=experiments/tiny.py", "--config.data.source=synthetic", "--config.train.log_every=1",
    "--config.model.d_model=64", "--config.model.n_layers=4",  # half size: faster, the same properties
    "--config.train.eval_every=0", "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
    "--config.optimizer.decay_steps=16"]  # fixed: runs of any length share one compiled step per process count


def committed(workdir) -> list[int]:
    """Steps of the checkpoints that finished committing (Orbax renames a save's folder to its step)."""
    folder = workdir / "checkpoints"
    return [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.is_dir() else []
