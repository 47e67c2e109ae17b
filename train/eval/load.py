"""A run's model for evaluation: its config and newest (or chosen) checkpoint, restored on the run's mesh with
`pipeline` and `context` folded into `data` (as train.sample does), and its tokenizer."""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import checkpoint
from checkpoint import format as ckpt_format
from train import config as run_config
from train.data import tokenizer as tok_lib
from train.eval.scorer import Scorer
from train.generate import decode
from train.lora import base as lora_base
from train.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class LoadedRun:
    scorer: Scorer
    codec: tok_lib.Codec
    step: int
    config: Any  # the run's ml_collections config, as evaluated


def load_run(workdir: pathlib.Path, step: int | None, batch_size: int, mesh: dict | None = None,
             num_devices: int | None = None) -> LoadedRun:
    """Restore the params of `step` (the newest when None) sharded on the run's mesh (`mesh` overrides sizes)."""
    config = run_config.load_run_config(workdir)
    config.mesh.update(mesh or {})
    decode.fold_stack_axes(config.mesh)
    codec = tok_lib.load_run_codec(workdir)  # a damaged tokenizer.json stops before the restore
    source, step, spec = run_config.run_checkpoints(workdir, step)
    trainer = Trainer.build(config, num_devices=num_devices)
    got = checkpoint.restore_source(source, step, {"params": ckpt_format.target(trainer)["params"]}, True, spec)
    params = ckpt_format.params_from_tree(trainer, got.tree["params"], lora_base.for_trainer(trainer))
    # Padding is id 0, inside every vocabulary (a byte-level run's EOS, 256, may not be); nothing real attends to it.
    scorer = Scorer(trainer.plan.model, params, trainer.layout.constrain(), trainer.mesh, batch_size, pad_id=0)
    return LoadedRun(scorer, codec, step, config)
