"""Where a run starts: its own newest intact checkpoint (automatic resume), else `checkpoint.restore_from`
(another run's checkpoint: full state, or params only for fine-tuning), else a fresh init. Also the check
of a workdir's checkpoints against the config, made before anything is compiled or moved."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

import checkpoint
from checkpoint import format as ckpt_format
from checkpoint import meta as meta_lib
from mesh.errors import probe_directory
from train import placed as placed_lib
from train.config.experiment import ConfigError
from train.hf import restore as hf_import
from train.lora import base as lora_base
from train.runtime.hardware import GiB
from train.trainer import Trainer


def _newest_meta(ckpts: checkpoint.Checkpoints) -> tuple[int, dict[str, Any]] | None:
    for step in reversed(ckpts.steps()):
        try:
            return step, ckpts.read_meta(step)
        except Exception:  # noqa: BLE001  (a damaged one: the restore moves it aside later)
            continue
    return None


def check_before_compile(trainer: Trainer, workdir: pathlib.Path) -> None:
    """Fail fast, moving nothing: the run's own newest checkpoint (or restore_from's) must hold the arrays
    this config trains, with the same seed; a LoRA run's base source must hold its base (it is read on every
    start); the workdir must have room for a checkpoint."""
    wanted, ck, seed_now = ckpt_format.target(trainer), trainer.plan.checkpoint, trainer.plan.train.seed
    own_dir = workdir / "checkpoints"
    own = checkpoint.Checkpoints(own_dir, read_only=True) if own_dir.is_dir() else None
    found = _newest_meta(own) if own else None
    if found:
        step, meta = found
        meta_lib.check_compatible(meta, wanted, str(own.step_dir(step)))
        seed = meta.get("config", {}).get("train", {}).get("seed")
        if seed is not None and seed != seed_now:
            raise ConfigError(f"train.seed={seed_now} but {own.step_dir(step)} was trained with seed {seed}; "
                              f"set it back (a resumed run replays the same data), or use a new --workdir")
    if trainer.frozen:
        lora_base.check_source(trainer, workdir)
    elif not found:
        _check_restore_from(trainer, workdir, wanted)
    if not ck.enabled:
        return  # nothing will be written: no room needed
    if ck.local:
        _check_local_dir(ck.local_dir)
    need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(wanted))
    free = shutil.disk_usage(workdir).free
    if free < need:
        raise ConfigError(f"--workdir={workdir}: {free / GiB:.2f} GiB free but one checkpoint needs about "
                          f"{need / GiB:.2f} GiB; free some space or choose another directory")


def _check_restore_from(trainer: Trainer, workdir: pathlib.Path, wanted: dict[str, Any]) -> None:
    """checkpoint.restore_from (of a run without checkpoints of its own) holds what this config trains."""
    ck = trainer.plan.checkpoint
    if ck.restore_from.startswith(hf_import.PREFIX):
        hf_import.check(ck.restore_from, trainer.placed, workdir)
    elif ck.restore_from:
        source, step = checkpoint.open_source(ck.restore_from)
        try:
            meta = source.read_meta(step)
        except Exception as e:  # noqa: BLE001
            raise checkpoint.RestoreFromError(
                f"checkpoint.restore_from={ck.restore_from!r}: the meta of {source.step_dir(step)} does not read "
                f"({type(e).__name__})") from None
        meta_lib.check_compatible(meta, wanted, str(source.step_dir(step)),
                                  prefix="params/" if ck.restore_params_only else "")


def _check_local_dir(local_dir: str) -> None:
    """The local tier's directory must take a file (created if needed; the probe is removed)."""
    try:
        probe_directory(pathlib.Path(local_dir).expanduser(), str(jax.process_index()))
    except OSError as e:
        raise ConfigError(f"checkpoint.local_dir={local_dir}: cannot write there ({e.strerror}); choose a writable "
                          f"node-local directory (e.g. /dev/shm/RUN or a local disk), or set it to '' with "
                          f"checkpoint.local_every_steps=0") from None


@dataclasses.dataclass
class Start:
    state: dict[str, Any]
    rng: jax.Array
    step: int
    origin: str        # what the run starts from, for the log
    resumed: bool      # from this run's own checkpoint (metrics.jsonl continues)
    seconds: float


def start(trainer: Trainer, ckpts: checkpoint.Checkpoints, say: Callable[[str], None],
          local: checkpoint.LocalCheckpoints | None = None) -> Start:
    """The state to train from: the run's newest checkpoint of either tier, else checkpoint.restore_from, else a
    fresh one. The settings come from trainer.plan; the raw config only as the record compared with the checkpoint's."""
    t0 = time.perf_counter()
    restored = checkpoint.restore_tiers(ckpts, local, ckpt_format.target(trainer), warn=say)
    if restored:
        changes = meta_lib.config_changes(restored.meta.get("config", {}), trainer.config.to_dict())
        if changes:
            say(f"resuming with changed settings: {'; '.join(changes)}")
        if "order" not in restored.meta.get("config", {}).get("data", {"order": None}):  # written before data.order
            _train_with_random_windows(trainer)
        state = ckpt_format.from_tree(trainer, restored.tree, lora_base.for_placed(trainer.placed))
        return Start(state, restored.tree["rng"], restored.step,
                     f"resumed from {restored.where}, {restored.tier} tier", True, time.perf_counter() - t0)
    return _from_elsewhere(trainer, t0)


def _train_with_random_windows(trainer: Trainer) -> None:
    """What a checkpoint from before data.order trained with, so the batches replay exactly (the plan, and so
    the checkpoint meta, say so)."""
    data = dataclasses.replace(trainer.plan.data, order="random")
    trainer.plan = dataclasses.replace(trainer.plan, data=data)
    trainer.tokens = dataclasses.replace(trainer.tokens, order="random")


def _from_elsewhere(trainer: Trainer, t0: float) -> Start:
    """No checkpoint of the run's own: checkpoint.restore_from (a run's checkpoint or Hugging Face weights),
    else a fresh init."""
    rng = ckpt_format.rng_of(trainer.plan.train.seed, trainer.mesh)
    spec, params_only = trainer.plan.checkpoint.restore_from, trainer.plan.checkpoint.restore_params_only
    if trainer.frozen:  # LoRA: fresh adapters and optimizer state on the base read from its source
        origin = f"{lora_base.adapter_count(trainer):,} adapter parameters initialized on {lora_base.describe(spec)}"
        state = _fresh_optimizer(trainer, placed_lib.initialized(trainer.placed).params)
        return Start(state, rng, 0, origin, False, time.perf_counter() - t0)
    if not spec:
        return Start(trainer.init_state(), rng, 0, "initialized", False, time.perf_counter() - t0)
    if spec.startswith(hf_import.PREFIX):  # Hugging Face weights: params only, fresh optimizer, step 0
        state = _fresh_optimizer(trainer, placed_lib.from_hf(trainer.placed, spec).params)
        return Start(state, rng, 0, f"Hugging Face weights of {spec[len(hf_import.PREFIX):]}"
                     f"{hf_import.left_out(spec)}", False, time.perf_counter() - t0)
    source, step = checkpoint.open_source(spec)
    if params_only:
        got = checkpoint.restore_source(source, step, ckpt_format.params_target(trainer), True, spec)
        params = trainer.placed.from_logical(ckpt_format.params_from_tree(trainer, got.tree["params"]))
        return Start(_fresh_optimizer(trainer, params), rng, 0, f"params of {got.where}", False,
                     time.perf_counter() - t0)
    got = checkpoint.restore_source(source, step, ckpt_format.target(trainer), False, spec)
    return Start(ckpt_format.from_tree(trainer, got.tree), rng, got.step, f"full state of {got.where}", False,
                 time.perf_counter() - t0)


def _fresh_optimizer(trainer: Trainer, params: dict[str, Any]) -> dict[str, Any]:
    """A first state on `params` (in the layout's in-memory order): a fresh optimizer state and step 0."""
    opt_state = jax.jit(trainer.tx.init, out_shardings=trainer.layout.state["opt_state"])(params)
    return {"params": params, "opt_state": opt_state,
            "step": jax.device_put(jnp.zeros((), jnp.int32), trainer.layout.state["step"])}


def cut_metrics(workdir: pathlib.Path, step: int) -> None:
    """Keep only metrics.jsonl records up to `step`, so a resumed run logs every step once."""
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True)
            if line.strip() and _record_step(line) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def _record_step(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return float("inf")  # a torn last line (killed mid-write) goes
