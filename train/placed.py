"""A model placed on a mesh: its config, the params' shardings and layer order on that mesh, and the params
(restored from a run's checkpoint, read from `hf:DIR`, or initialized), with the run's tokenizer. Placing builds
no optimizer, no data source and no training step: what decoding, scoring, export and a server need, and what
train.trainer.Trainer adds those to."""
from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any

import jax
import ml_collections
import numpy as np

import checkpoint
import models
from checkpoint import format as ckpt_format
from checkpoint import plain
from mesh import make_mesh
from mesh.layout import AXES
from models import lora as lora_lib
from sharding import pipeline as pipeline_lib
from train import state as state_lib
from train.config import experiment as run_config
from train.config.experiment import Plan, resolve
from train.data import tokenizer as tok_lib
from train.hf import restore as hf_import
from train.lora import base as lora_base

LORA_CHOICES = ("keep", "merge")


@dataclasses.dataclass(frozen=True)
class Placed:
    """A model on a mesh. `params` is None for a placement alone (shapes and shardings, no arrays); otherwise
    every array sits in `layout.params`' sharding with the layer stack in `layer_order`."""
    model: models.ModelConfig
    layout: state_lib.ParamLayout
    layer_order: np.ndarray | None = None  # the logical layer at each in-memory position; None: the identity
    base: str = ""   # checkpoint.restore_from: where a LoRA model's frozen base is read
    seed: int = 0    # train.seed: a LoRA base with no source is the model's initialization from it
    params: Any = None
    codec: tok_lib.Codec | None = None  # the run's tokenizer, when placed from a run
    step: int | None = None  # the checkpoint step the params were restored from

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.layout.mesh

    @property
    def abstract_params(self) -> Any:
        """ShapeDtypeStructs with their shardings, shaped like the params (logical layer order)."""
        return self.layout.abstract_params

    @functools.cached_property
    def frozen(self) -> frozenset[str]:
        """Saved-tree paths ('params/layers/wqkv') a checkpoint does not hold: with LoRA, every base parameter
        (read again from `base`); otherwise none."""
        if not lora_lib.enabled(self.model):
            return frozenset()
        paths = jax.tree_util.tree_flatten_with_path(self.abstract_params)[0]
        return frozenset("params/" + "/".join(str(k.key) for k in path) for path, _ in paths
                         if not lora_lib.is_adapter(path))

    @functools.cached_property
    def _reorder(self):
        """Jitted logical -> in-memory order over the params, compiled once; None for the identity."""
        if self.layer_order is None:
            return None
        return jax.jit(lambda p: pipeline_lib.from_logical(p, self.layer_order), out_shardings=self.layout.params)

    def from_logical(self, params: Any) -> Any:
        """Params in logical layer order -> this placement's in-memory order (the same arrays for the identity)."""
        return params if self._reorder is None else self._reorder(params)


def layer_order(plan: Plan) -> np.ndarray | None:
    """The logical layer at each position of the in-memory stack, or None when that is the identity."""
    p = plan.pipeline
    if p is None or p.virtual_stages == 1:
        return None  # contiguous stages: the in-memory order is the logical one
    return pipeline_lib.layer_order(models.stack_length(plan.model), p.stages, p.virtual_stages,
                                    v_shape=p.schedule in pipeline_lib.schedules.V_SHAPED)


def of_plan(plan: Plan, num_devices: int | None = None) -> Placed:
    """The plan's model on its mesh (the first `num_devices` devices, default all), shapes only."""
    mesh = make_mesh(plan.mesh_sizes, num_devices=num_devices)
    return Placed(plan.model, state_lib.param_layout(plan.model, plan.rules, mesh), layer_order(plan),
                  plan.checkpoint.restore_from, plan.train.seed)


def place(config: ml_collections.ConfigDict, num_devices: int | None = None) -> Placed:
    """Validate `config` (a one-line user error otherwise) and place its model, shapes only: no arrays."""
    return of_plan(resolve(config, num_devices or jax.device_count()), num_devices)


def on_one_device(model: models.ModelConfig, base: str = "", seed: int = 0) -> Placed:
    """`model` on the first device alone, in logical layer order (an export reads the whole model there)."""
    mesh = make_mesh({a: 1 for a in AXES}, num_devices=1)
    return Placed(model, state_lib.param_layout(model, {}, mesh), None, base, seed)


def fold_stack_axes(mesh: ml_collections.ConfigDict) -> None:
    """A run's mesh config made fit for decoding: `pipeline` and `context` folded into `data`, since decoding
    runs the whole layer stack on every device, one new token at a time."""
    folded = mesh.pipeline * mesh.context
    mesh.pipeline = mesh.context = 1
    if mesh.data != -1:
        mesh.data *= folded



def decoding_config(workdir: pathlib.Path, mesh: dict | None = None) -> ml_collections.ConfigDict:
    """A run's config for decoding: its mesh (`mesh` overrides sizes) with `pipeline` and `context` folded into
    `data`, since decoding runs the whole layer stack on every device, one new token at a time."""
    config = run_config.load_run_config(workdir)
    config.mesh.update(mesh or {})
    fold_stack_axes(config.mesh)
    return config


def restore(placed: Placed, workdir: pathlib.Path, step: int | None = None, lora: str = "keep") -> Placed:
    """`placed` with the params of the run's checkpoint `step` (default: the newest); a LoRA run's base is read
    from its checkpoint.restore_from, its adapters kept (`lora="keep"`) or merged into the base ("merge")."""
    assert lora in LORA_CHOICES, lora
    source, step, spec = run_config.run_checkpoints(workdir, step)
    got = checkpoint.restore_source(source, step, ckpt_format.params_target(placed), True, spec,
                                    named=(f"--workdir={workdir}", "give an older one with --step=N"))
    params = ckpt_format.params_from_tree(placed, got.tree["params"], lora_base.for_placed(placed))
    placed = dataclasses.replace(placed, params=placed.from_logical(params), step=step)
    return merged(placed) if lora == "merge" else placed


def from_run(workdir: pathlib.Path | str, step: int | None = None, mesh: dict | None = None, lora: str = "keep",
             num_devices: int | None = None) -> Placed:
    """A run's model on its decoding mesh (decoding_config), restored from its checkpoint `step` (default: the
    newest), with its tokenizer. A damaged tokenizer.json or a missing step stops before anything is read."""
    workdir = pathlib.Path(workdir).expanduser()
    config = decoding_config(workdir, mesh)
    codec = tok_lib.load_run_codec(workdir)
    run_config.run_checkpoints(workdir, step)
    return dataclasses.replace(restore(place(config, num_devices), workdir, step, lora), codec=codec)


def initialized(placed: Placed) -> Placed:
    """`placed` with the model's initialization from its seed; a LoRA model's base is read from its source
    (never initialized at random only to be replaced) and its adapters are initialized."""
    flat = plain.flatten({"params": placed.abstract_params})
    held = plain.nest({k: v for k, v in flat.items() if k not in placed.frozen})["params"]
    flat = {**plain.flatten({"params": lora_base.initialized(placed.model, placed.seed, held)}),
            **(lora_base.for_placed(placed) or {})}
    params = plain.from_plain(plain.nest(flat)["params"], placed.abstract_params)
    return dataclasses.replace(placed, params=placed.from_logical(params))


def from_hf(placed: Placed, spec: str) -> Placed:
    """`placed` with the Hugging Face weights of `spec` ('hf:DIR'), each device reading only its slices."""
    params = hf_import.read_params(spec, placed.model, placed.abstract_params, placed.layer_order)
    return dataclasses.replace(placed, params=params)


def merged(placed: Placed) -> Placed:
    """A LoRA model as its base model (lora_rank 0), each adapted weight W + (alpha/rank)·A·B; the merge runs on
    the host, then the merged params go back into the base's shardings. Without adapters, `placed` itself."""
    if not lora_lib.enabled(placed.model):
        return placed
    cfg = dataclasses.replace(placed.model, lora_rank=0)
    layout = state_lib.param_layout(cfg, placed.layout.rules, placed.mesh)
    host = jax.tree.map(np.asarray, jax.device_get(placed.params))
    params = lora_lib.merge(host, placed.model, models.family_of(placed.model).forward.lora_projections(placed.model))
    return dataclasses.replace(placed, model=cfg, layout=layout, params=jax.device_put(params, layout.params))
