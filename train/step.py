"""The jitted train and eval steps. A step is `loss_and_grad` (the plain model, or the pipeline
executor of sharding/pipeline.py) + optional gradient accumulation + clipping + AdamW, with explicit
in/out shardings (and, on accelerators, a donated state)."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
from train.state import Layout, ParamLayout, State

# (params, tokens) -> (the loss, or metrics holding it under `loss`, gradients)
LossAndGrad = Callable[[Any, jax.Array], tuple[jax.Array | dict[str, jax.Array], Any]]


def model_loss_and_grad(cfg: models.ModelConfig, constrain) -> LossAndGrad:
    """The loss and gradients of the unpipelined model on a [batch, seq+1] token batch; when the model logs
    more than its loss (a mixture's router statistics), the metrics in place of the loss, holding it under
    `loss`. The gradients are those of the objective (models.loss_and_metrics)."""
    grad_fn = jax.value_and_grad(lambda p, t: models.loss_and_metrics(p, t, cfg, constrain), has_aux=True)

    def metrics_and_grad(params, tokens):
        (_, metrics), grads = grad_fn(params, tokens)
        return (metrics if len(metrics) > 1 else metrics["loss"]), grads
    return metrics_and_grad


def _slices(tokens_BxL: jax.Array, accum: int, batch_sharding: NamedSharding) -> jax.Array:
    """[accum, B/accum, L]: slice k takes rows k, k+accum, k+2*accum, ...; each device's contiguous block
    of rows holds a part of every slice, so splitting the batch moves no data between devices."""
    B, L = tokens_BxL.shape
    micro_AxBxL = jnp.swapaxes(tokens_BxL.reshape(B // accum, accum, L), 0, 1)
    return jax.lax.with_sharding_constraint(micro_AxBxL, NamedSharding(batch_sharding.mesh,
                                                                       P(None, *batch_sharding.spec)))


def slice_weights(micro_AxBxL: jax.Array, count_targets: Callable | None) -> jax.Array | None:
    """[A] float32: each slice's share of the batch's counted targets, so the weighted slice means add up to
    the mean over the whole batch (None: every slice counts equally, weight 1/A)."""
    if count_targets is None:
        return None
    counts_A = jax.vmap(count_targets)(micro_AxBxL)
    return counts_A / jnp.maximum(jnp.sum(counts_A), 1.0)


def accumulate(loss_and_grad: LossAndGrad, accum: int, batch_sharding: NamedSharding,
               count_targets: Callable | None = None) -> LossAndGrad:
    """Average loss and gradients over `accum` equal slices of the batch (`_slices`), one after another;
    weighted by each slice's counted targets when some targets do not count (`count_targets`:
    models.documents.target_counter), so the result is the mean over the whole batch's counted targets."""
    if accum == 1:
        return loss_and_grad

    def fn(params, tokens_BxL):
        def body(carry, xs):
            tokens, weight = xs
            loss, grads = loss_and_grad(params, tokens)
            if weight is not None:
                loss, grads = jax.tree.map(lambda x: x * weight.astype(x.dtype), (loss, grads))
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        micro = _slices(tokens_BxL, accum, batch_sharding)
        zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(loss_and_grad, params, micro[0]))
        weights = slice_weights(micro, count_targets)
        (loss, grads), _ = jax.lax.scan(body, zeros, (micro, weights))
        if weights is not None:
            return loss, grads
        return jax.tree.map(lambda x: x / accum, (loss, grads))

    return fn


def make_train_step(loss_and_grad: LossAndGrad, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    layout: Layout, *, skip_nonfinite: bool = False, return_grads: bool = False):
    """jit(state, batch) -> (state, metrics); metrics are replicated scalars. On accelerators the state
    is donated (its buffers become the new state's, halving its memory); XLA's CPU backend instead adds
    copies around the layer scan when the state is donated (8% slower, more temp memory, measured on the
    tiny model), and host memory is not the constraint there, so CPU runs keep both.

    `skip_nonfinite`: a step whose loss or gradient norm is not finite leaves params and optimizer state
    as they were (decided inside the step, so a bad update never reaches the state) and reports
    `skipped`=1.

    `return_grads`: jit(state, batch) -> (state, metrics, grads), the (accumulated, pinned) gradients the
    update used, laid out as the parameters: tests and debugging read the gradients of a step without
    compiling loss_and_grad a second time. False builds the production step, unchanged.
    """
    param_shardings = layout.state["params"]

    def step(state: State, tokens: jax.Array):
        loss, grads = loss_and_grad(state["params"], tokens)
        values = loss if isinstance(loss, dict) else {}  # metrics beside the loss (model_loss_and_grad)
        loss = values.pop("loss", loss)
        # Pin gradients to the parameters' layout: under FSDP this makes the reduction a reduce-scatter.
        grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        grad_norm = optax.tree.norm(models.moe.without_bias(grads))  # a balancing bias's entry holds its load
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state["step"]), **values}
        if skip_nonfinite:
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                             (params, opt_state), (state["params"], state["opt_state"]))
            metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
        new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
        return (new_state, metrics, grads) if return_grads else (new_state, metrics)

    replicated = NamedSharding(layout.mesh, P())
    out_shardings = (layout.state, replicated) + ((param_shardings,) if return_grads else ())
    return jax.jit(step, in_shardings=(layout.state, layout.batch), out_shardings=out_shardings,
                   donate_argnums=() if layout.mesh.devices.flat[0].platform == "cpu" else 0)


def guard_options(plan) -> dict:
    """make_train_step's non-finite policy, from the plan (fault injection is the loop's: train/loop/faults.py)."""
    return {"skip_nonfinite": plan.train.on_nonfinite == "skip"}


def make_eval_step(cfg: models.ModelConfig, layout: Layout | ParamLayout, loss_fn: Callable | None = None,
                   accum: int = 1):
    """jit(params, batch) -> mean loss, forward only (`loss_fn`, e.g. a pipeline's, or the plain model),
    over the same `accum` slices as training, so evaluation needs no more memory than a train step. `layout`:
    the state's, or a placed model's alone (no optimizer)."""
    constrain = layout.constrain()
    if loss_fn is None:  # the language-model loss, without what the layers add to the objective
        loss_fn = lambda params, tokens: models.loss_and_metrics(params, tokens, cfg, constrain)[1]["loss"]  # noqa: E731
    count_targets = models.target_counter(cfg)
    if accum > 1:
        one = loss_fn

        def loss_fn(params, tokens_BxL):
            micro = _slices(tokens_BxL, accum, layout.batch)
            weights = slice_weights(micro, count_targets)
            if weights is not None:
                total, _ = jax.lax.scan(lambda acc, xs: (acc + one(params, xs[0]) * xs[1], None),
                                        jnp.zeros((), jnp.float32), (micro, weights))
                return total
            total, _ = jax.lax.scan(lambda acc, tokens: (acc + one(params, tokens), None),
                                    jnp.zeros((), jnp.float32), micro)
            return total / accum
    return jax.jit(loss_fn,
                   in_shardings=(layout.params, layout.batch),
                   out_shardings=NamedSharding(layout.mesh, P()))
