"""A run's model for evaluation: its config and newest (or chosen) checkpoint, restored on the run's mesh with
`pipeline` and `context` folded into `data` (as train.sample does), and its tokenizer."""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from train import placed as placed_lib
from train.config import sections
from train.data import tokenizer as tok_lib
from train.eval.scorer import Scorer


@dataclasses.dataclass(frozen=True)
class LoadedRun:
    scorer: Scorer
    codec: tok_lib.Codec
    step: int
    config: Any  # the run's ml_collections config, as evaluated


def load_run(workdir: pathlib.Path, step: int | None, batch_size: int, mesh: dict | None = None,
             num_devices: int | None = None) -> LoadedRun:
    """Restore the params of `step` (the newest when None) sharded on the run's mesh (`mesh` overrides sizes):
    train.placed.from_run, which builds nothing of training."""
    placed = placed_lib.from_run(workdir, step, mesh, num_devices=num_devices)
    # Padding is id 0, inside every vocabulary (a byte-level run's EOS, 256, may not be); nothing real attends to it.
    config = placed_lib.decoding_config(workdir, mesh)
    scorer = Scorer(placed, batch_size, pad_id=0, settings=sections.ServeSection.from_config(config.serve))
    return LoadedRun(scorer, placed.codec, placed.step, config)
