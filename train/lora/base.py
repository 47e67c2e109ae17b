"""A LoRA run's frozen base: read from `checkpoint.restore_from` (Hugging Face weights, another run's checkpoint,
or the model's initialization from the seed when it is empty) into the run's shardings, in logical layer order."""
from __future__ import annotations

from typing import Any

import jax

import checkpoint
import models
from checkpoint import format as ckpt_format
from checkpoint import meta as meta_lib
from checkpoint import plain
from models import lora
from train.hf import restore as hf_import

PARAMS = "params/"


def describe(spec: str) -> str:
    """Where the base comes from, for the log."""
    if spec.startswith(hf_import.PREFIX):
        return f"the Hugging Face weights of {spec[len(hf_import.PREFIX):]}"
    return f"the params of {spec}" if spec else "the model's initialization from train.seed"


def adapter_count(placed: Any) -> int:
    """The trained parameters of `placed` (a train.placed.Placed or a Trainer; the log's "training N parameters"
    counts the model)."""
    cfg = placed.model
    return lora.adapter_count(cfg, models.family_of(cfg).forward.lora_projections(cfg))


def load(spec: str, cfg: models.ModelConfig, seed: int, target: dict[str, Any]) -> dict[str, jax.Array]:
    """{saved-tree path: array} for `target` ({'params/...': ShapeDtypeStruct with its sharding}): from `hf:DIR`,
    from the params of a checkpoint `PATH[:STEP]` (every checksum verified), or recomputed from `seed` ('')."""
    nested = plain.nest({k[len(PARAMS):]: v for k, v in target.items()})
    if spec.startswith(hf_import.PREFIX):
        got = hf_import.read_params(spec, cfg, nested)
    elif spec:
        source, step = checkpoint.open_source(spec)
        got = checkpoint.restore_source(source, step, {"params": nested}, True, spec).tree["params"]
    else:
        got = initialized(cfg, seed, nested)
    return {PARAMS + k: v for k, v in plain.flatten(got).items()}


def initialized(cfg: models.ModelConfig, seed: int, target: Any) -> Any:
    """The leaves of `target` (nested like params) as the model's initialization from `seed` makes them, compiled
    for those leaves only (XLA drops the others)."""
    names = set(plain.flatten(target))

    def init():
        return plain.nest({k: v for k, v in plain.flatten(models.init_params(cfg, seed)).items() if k in names})
    return jax.jit(init, out_shardings=jax.tree.map(lambda s: s.sharding, target))()


def for_placed(placed: Any) -> dict[str, jax.Array] | None:
    """The base of `placed` (a train.placed.Placed or a Trainer) in its shardings (None without LoRA): what
    checkpoint.format.from_tree completes a state with."""
    if not placed.frozen:
        return None
    return load(placed.base, placed.model, placed.seed, ckpt_format.frozen_target(placed))


def check_source(trainer: Any, workdir: Any = None) -> None:
    """Before compiling: the base's source holds this model (a one-line error otherwise); Hugging Face tokenizer
    files are copied into `workdir`, as for any hf: start."""
    spec = trainer.plan.checkpoint.restore_from
    if spec.startswith(hf_import.PREFIX):
        hf_import.check(spec, trainer.placed, workdir)
    elif spec:
        source, step = checkpoint.open_source(spec)
        wanted = plain.nest(ckpt_format.frozen_target(trainer))
        meta_lib.check_compatible(source.read_meta(step), wanted, str(source.step_dir(step)), prefix=PARAMS)
