"""One object holding everything a run needs once the config is validated: the plan, the placed model (mesh,
parameter layout, layer order: train/placed.py), the layout of the whole state, the optimizer, the data source and
the jitted steps. Tests and benchmarks build it directly."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import ml_collections
import optax

import models
from models import lora
from sharding import pipeline as pipeline_lib
from train import placed as placed_lib
from train import state as state_lib
from train import step as step_lib
from train.config.experiment import Plan, resolve
from train.data import loader as data_lib


@dataclasses.dataclass
class Trainer:
    config: ml_collections.ConfigDict  # the raw config, read only as a whole (to_dict) for config.json and meta
    plan: Plan
    mesh: jax.sharding.Mesh
    layout: state_lib.Layout
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    tokens: data_lib.TokenSource  # the loaded token source of plan.data
    loss_and_grad: step_lib.LossAndGrad
    train_step: Any
    eval_step: Any
    placed: placed_lib.Placed  # the model on the mesh, shapes only: what the state's layout extends

    @classmethod
    def build(cls, config: ml_collections.ConfigDict, num_devices: int | None = None) -> "Trainer":
        """Validate (raising a one-line user error), then lay out exactly the layout `config` gives (plan.auto
        is the entry point's: train/loop/runner.py applies the planner first); nothing is compiled or allocated yet."""
        plan = resolve(config, num_devices or jax.device_count())
        tokens = data_lib.load(plan.data, plan.model.vocab_size, plan.model.seq_len + 1, plan.data.files)
        placed = placed_lib.of_plan(plan, num_devices)
        mesh = placed.mesh
        tx, schedule = state_lib.make_optimizer(plan.optimizer, plan.decay_steps, lora.enabled(plan.model),
                                                models.moe.bias_update_speed(plan.model))
        layout = state_lib.plan_layout(plan, mesh, tx, plan.shard_opt_state, placed.layout)
        if plan.pipeline:
            table = plan.pipeline.build()
            loss_and_grad = pipeline_lib.loss_and_grad(plan.model, mesh, plan.rules, table)
            eval_loss = pipeline_lib.loss(plan.model, mesh, plan.rules, table)
        else:
            loss_and_grad = step_lib.model_loss_and_grad(plan.model, layout.constrain())
            eval_loss = None
        loss_and_grad = step_lib.accumulate(loss_and_grad, plan.grad_accum, layout.batch,
                                            models.target_counter(plan.model))
        train_step = step_lib.make_train_step(loss_and_grad, tx, schedule, layout, **step_lib.guard_options(plan))
        eval_step = step_lib.make_eval_step(plan.model, layout, eval_loss, plan.grad_accum)
        return cls(config, plan, mesh, layout, tx, schedule, tokens, loss_and_grad, train_step, eval_step, placed)

    def init_state(self) -> state_lib.State:
        return self.from_logical(state_lib.init_state(self.plan, self.layout, self.tx, self.plan.train.seed))

    @property
    def model(self) -> models.ModelConfig:
        return self.placed.model

    @property
    def abstract_params(self) -> Any:
        """The params' ShapeDtypeStructs with their shardings (checkpoint.format.Placement)."""
        return self.placed.abstract_params

    @property
    def frozen(self) -> frozenset[str]:
        """Saved-tree paths ('params/layers/wqkv') a checkpoint does not hold: with LoRA, every base parameter
        (read again from checkpoint.restore_from, train/lora); otherwise none."""
        return self.placed.frozen

    @property
    def layer_order(self):
        """The logical layer at each position of the in-memory stack, or None when that is the identity."""
        return self.placed.layer_order

    @functools.cached_property
    def _reorder(self):
        """Jitted (to_logical, from_logical) over the whole state, compiled once; None for the identity."""
        order = self.layer_order
        if order is None:
            return None
        return tuple(jax.jit(lambda s, fn=fn: fn(s, order), out_shardings=self.layout.state)
                     for fn in (pipeline_lib.to_logical, pipeline_lib.from_logical))

    def to_logical(self, state: state_lib.State) -> state_lib.State:
        """The state with every stacked-layer array in logical layer order: what a checkpoint saves.

        Interleaved pipelines keep each device's chunks contiguous in memory (sharding/pipeline.layer_order);
        for any other layout the order is already logical and `state` itself is returned.
        """
        return state if self._reorder is None else self._reorder[0](state)

    def from_logical(self, state: state_lib.State) -> state_lib.State:
        """Inverse of to_logical: a restored (logical-order) state -> this layout's in-memory order."""
        return state if self._reorder is None else self._reorder[1](state)

    def batch(self, step: int, split: str = "train") -> jax.Array:
        return data_lib.global_batch(self.tokens, self.layout.batch, self.plan.train.seed, step,
                                     self.plan.global_batch, self.plan.model.seq_len + 1, split)

    def abstract_batch(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.plan.global_batch, self.plan.model.seq_len + 1), "int32",
                                    sharding=self.layout.batch)

    def write_tokenizer(self, workdir) -> None:
        """The data's tokenizer.json (with its EOS and BOS ids) into the workdir, where sampling and export look."""
        data_lib.copy_tokenizer(self.plan.data.files, workdir)

    def compile(self):
        """Lower and compile the train step on abstract inputs (no state is allocated)."""
        return self.train_step.lower(self.layout.abstract_state, self.abstract_batch()).compile()
