"""The train state (a plain dict: params, opt_state, step), its optimizer, its shardings and its
initialization straight into those shardings: abstract shapes first, then the specs from the rules,
then a jitted init whose outputs are born sharded, so no host ever holds the whole model."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
from mesh.layout import axis_sizes
from models import lora
from sharding import specs as sharding_specs
from train.config.experiment import Plan

State = dict[str, Any]


def make_optimizer(opt_cfg: Any, decay_steps: int,
                   adapters_only: bool = False) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup and cosine decay, after global-norm clipping. Norm scales are not decayed.
    `adapters_only` (LoRA): only the adapters get AdamW; every other parameter gets a zero update and no state."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=opt_cfg.lr, warmup_steps=opt_cfg.warmup_steps,
        decay_steps=decay_steps, end_value=opt_cfg.lr * opt_cfg.min_lr_ratio)
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, _: not str(path[-1].key).endswith("norm"), params)
    adamw = optax.adamw(schedule, b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps,
                        weight_decay=opt_cfg.weight_decay, mask=decay_mask)
    chain = optax.chain(*([optax.clip_by_global_norm(opt_cfg.clip_norm)] if opt_cfg.clip_norm else []), adamw)
    if not adapters_only:
        return chain, schedule
    labels = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, _: "adapter" if lora.is_adapter(path) else "frozen", params)
    return optax.multi_transform({"adapter": chain, "frozen": optax.set_to_zero()}, labels), schedule


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Where the params and the batch live on the mesh: all that placing a model needs (no optimizer)."""
    mesh: jax.sharding.Mesh
    rules: dict[str, tuple[str, ...]]
    param_specs: Any      # PartitionSpecs, shaped like the params
    logical_axes: Any     # logical names, shaped like the params
    params: Any           # NamedShardings, shaped like the params
    batch: NamedSharding  # [batch, seq+1] tokens
    abstract_params: Any  # ShapeDtypeStructs with shardings

    def constrain(self):
        """The activation-sharding hook handed to the model."""
        return sharding_specs.constrainer(self.mesh, self.rules)


@dataclasses.dataclass(frozen=True)
class Layout(ParamLayout):
    """A ParamLayout with where the rest of the training state lives: the optimizer's moments and the step."""
    state: Any            # NamedShardings, shaped like the state
    abstract_state: Any   # ShapeDtypeStructs with shardings


def param_layout(model: models.ModelConfig, rules: dict[str, tuple[str, ...]],
                 mesh: jax.sharding.Mesh) -> ParamLayout:
    """Specs for params (strict divisibility) and the batch (rows over the `batch` rule's axes) on `mesh`."""
    mesh_sizes = axis_sizes(mesh)
    abstract_params, logical = models.abstract_params(model)
    pspecs = sharding_specs.param_specs(abstract_params, logical, rules, mesh_sizes)
    shardings = sharding_specs.named(mesh, pspecs)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_params,
                            shardings)
    batch_spec = sharding_specs.mesh_spec(P("batch", None), rules, None, mesh_sizes)
    return ParamLayout(mesh, rules, pspecs, logical, shardings, NamedSharding(mesh, batch_spec), abstract)


def plan_layout(plan: Plan, mesh: jax.sharding.Mesh, tx: optax.GradientTransformation,
                shard_opt_state: bool, params: ParamLayout | None = None) -> Layout:
    """`params` (param_layout's, made here when None) with the optimizer state's specs (following params,
    optionally also over `data`) and the step counter's (replicated)."""
    params = params or param_layout(plan.model, plan.rules, mesh)
    abstract_params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params.abstract_params)
    ospecs = sharding_specs.opt_state_specs(tx, abstract_params, params.param_specs, plan.mesh_sizes,
                                            shard_opt_state)
    specs = {"params": params.param_specs, "opt_state": ospecs, "step": P()}
    shardings = sharding_specs.named(mesh, specs)
    abstract = {"params": abstract_params, "opt_state": jax.eval_shape(tx.init, abstract_params),
                "step": jax.ShapeDtypeStruct((), jnp.int32)}
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(ParamLayout)}
    return Layout(**fields, state=shardings, abstract_state=abstract)


def init_state(plan: Plan, layout: Layout, tx: optax.GradientTransformation, seed: int) -> State:
    """Initialize every array directly in its target sharding (RNG values do not depend on the layout,
    since jax's threefry is partitionable)."""
    def init() -> State:
        params = models.init_params(plan.model, seed)
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    return jax.jit(init, out_shardings=layout.state)()
