"""The typed sections of `Plan` (train/config.py) that the trainer, resume, the loop, its actions and the saver
read instead of the raw config: `train`, `checkpoint`, `faults`, `optimizer`, `source` (the data settings).
resolve() builds them once the config is validated.

How a new setting joins Plan: give it a default in base_config (train/config.py), validate it in resolve
(one-line ConfigError naming the setting), add a typed field to the section here that owns it (or a new
section, added to Plan with a default of None and filled in `from_config`), and read `trainer.plan.<section>.
<field>` below __main__, never `config.<section>.<key>`.
"""
from __future__ import annotations

import dataclasses
from typing import Any


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in str(text or "").split(",") if n.strip())


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """How the loop runs: logging and evaluation cadence, the non-finite policy, the watchdog, the actions."""
    log_every: int
    eval_every: int      # 0: only at the end
    eval_batches: int    # 0: no evaluation
    on_nonfinite: str    # stop or skip
    step_timeout_s: float
    memory_check: bool
    seed: int
    loggers: tuple[str, ...]
    actions: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    every_steps: int
    every_minutes: float
    mtbf_hours: float
    keep: int
    keep_period: int
    restore_from: str
    restore_params_only: bool
    enabled: bool = True  # False: never write a checkpoint (still resume from one)
    max_failed_saves: int = 3  # this many failed saves in a row stop the run (exit 74); fewer are retried
    local_dir: str = ""  # the local tier's node-local directory ("" = no local tier)
    local_every_steps: int = 0  # its save interval in steps

    @property
    def local(self) -> bool:
        return bool(self.enabled and self.local_dir and self.local_every_steps)


@dataclasses.dataclass(frozen=True)
class FaultSection:
    """Faults on purpose, for the tests of the fault handling (0 = off)."""
    nan_at_step: int
    hang_at_step: int
    hang_s: float
    step_delay_s: float

    @property
    def in_loop(self) -> bool:
        """A fault the loop injects: a delay, a hang, or NaN parameters at a step (train/loop/faults.py)."""
        return bool(self.step_delay_s or self.hang_at_step or self.nan_at_step)


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    """AdamW with warmup and cosine decay after clipping (train/state.make_optimizer)."""
    lr: float
    warmup_steps: int
    decay_steps: int     # 0: train.steps
    min_lr_ratio: float
    weight_decay: float
    b1: float
    b2: float
    eps: float
    clip_norm: float     # 0: no clipping


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Where the tokens come from (train/data.load); the token files themselves are Plan.data."""
    source: str          # text, tokens or synthetic
    path: str
    eval_percent: int
    cache_dir: str
    order: str           # epochs or random
    document_mask: bool


def optimizer_of(config: Any) -> OptimizerSection:
    o = config.optimizer
    return OptimizerSection(float(o.lr), int(o.warmup_steps), int(o.decay_steps), float(o.min_lr_ratio),
                            float(o.weight_decay), float(o.b1), float(o.b2), float(o.eps), float(o.clip_norm))


def data_of(config: Any) -> DataSection:
    d = config.data
    return DataSection(str(d.source), str(d.path), int(d.eval_percent), str(d.cache_dir),
                       str(d.get("order", "epochs")), bool(d.get("document_mask", False)))


def from_config(config: Any) -> tuple[TrainSection, CheckpointSection, FaultSection]:
    """The sections of a validated config."""
    t, ck, fi = config.train, config.checkpoint, config.fault_injection
    train = TrainSection(int(t.log_every), int(t.eval_every), int(t.eval_batches), str(t.on_nonfinite),
                         float(t.step_timeout_s), bool(t.memory_check), int(t.seed), _names(t.loggers),
                         _names(t.actions))
    checkpoint = CheckpointSection(int(ck.every_steps), float(ck.every_minutes), float(ck.get("mtbf_hours", 0.0)),
                                   int(ck.keep), int(ck.keep_period), str(ck.restore_from),
                                   bool(ck.restore_params_only), bool(ck.get("enabled", True)),
                                   int(ck.get("max_failed_saves", 3)), str(ck.get("local_dir", "")),
                                   int(ck.get("local_every_steps", 0)))
    faults = FaultSection(int(fi.nan_at_step), int(fi.hang_at_step), float(fi.hang_s), float(fi.step_delay_s))
    return train, checkpoint, faults
