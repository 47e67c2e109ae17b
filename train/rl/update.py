"""The jitted GRPO step: the rollouts' rows cut into train.grad_accum_steps slices (as train/step.py cuts a batch),
the log-probabilities the objective compares against (the reference's, and the old policy's where they are not the
trainer's own), then rl.updates_per_rollout optimizer updates, the first of which reports the metrics."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
from train.config.sections import RLSection
from train.rl import objective
from train.state import Layout

CORE = ("params", "opt_state", "step")  # what an update changes; the reference stays as it is


def batch_shardings(layout: Layout) -> dict[str, NamedSharding]:
    """The rollout batch's arrays: rows [B, L+1], per-target log-probabilities [B, L], advantages [B]."""
    rows = layout.batch
    return {"tokens": rows, "sampled_logprobs": rows, "advantages": NamedSharding(rows.mesh, P(rows.spec[0]))}


def abstract_batch(layout: Layout, rows: int, length: int) -> dict[str, jax.ShapeDtypeStruct]:
    shapes = {"tokens": ((rows, length + 1), jnp.int32), "sampled_logprobs": ((rows, length), jnp.float32),
              "advantages": ((rows,), jnp.float32)}
    return {k: jax.ShapeDtypeStruct(s, d, sharding=batch_shardings(layout)[k]) for k, (s, d) in shapes.items()}


def _slices(batch: dict[str, jax.Array], accum: int, layout: Layout) -> dict[str, jax.Array]:
    """Every array [B, ...] -> [accum, B/accum, ...]; slice k takes rows k, k+accum, ... (train/step.py's cut: each
    device's rows hold a part of every slice, so cutting moves no data)."""
    def cut(x):
        x = jnp.swapaxes(x.reshape(x.shape[0] // accum, accum, *x.shape[1:]), 0, 1)
        spec = P(None, layout.batch.spec[0], *([None] * (x.ndim - 2)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, spec))
    return {k: cut(v) for k, v in batch.items()}


class Update:
    """(core state, reference params or None, batch) -> (core state, metrics), built for one run's settings."""

    def __init__(self, cfg: models.ModelConfig, layout: Layout, tx: optax.GradientTransformation,
                 schedule: optax.Schedule, rl: RLSection, accum: int, skip_nonfinite: bool = False):
        self.cfg, self.layout, self.tx, self.schedule, self.rl, self.accum = cfg, layout, tx, schedule, rl, accum
        self.skip_nonfinite, self.hooks = skip_nonfinite, layout.constrain()
        self.clip = objective.Clip(rl.clip_eps, rl.clip_high, rl.kl_coef, rl.loss_agg == "seq_mean")
        # Where the old log-probabilities come from: the trainer's own (one on-policy update: the ratio is 1), a
        # forward pass before the updates (several on-policy updates), or the engine that sampled (stale rollouts).
        self.old = ("own" if rl.updates_per_rollout == 1 and not rl.max_staleness
                    else "engine" if rl.max_staleness else "forward")

    def logprobs(self, params: Any, tokens: jax.Array) -> jax.Array:
        return objective.token_logprobs(params, tokens, self.cfg, self.hooks, self.rl.temperature)[0]

    def slice_loss(self, params: Any, piece: dict[str, jax.Array], tokens: jax.Array, rows: int):
        """One slice's share of the loss (a sum over its tokens, weighted against the whole step) and its metrics."""
        logp, own, counted, aux = objective.token_logprobs(params, piece["tokens"], self.cfg, self.hooks,
                                                           self.rl.temperature)
        ordered = lambda name: objective.in_layout_order(piece[name], self.hooks)  # noqa: E731
        weights = objective.token_weights(counted, self.clip.per_sequence, rows, tokens)
        old = jax.lax.stop_gradient(logp) if self.old == "own" else ordered("old")
        reference = ordered("reference") if "reference" in piece else None
        loss, sums = objective.grpo_terms(logp, old, piece["advantages"], weights, self.clip, reference)
        diff = jnp.max(jnp.where(counted, jnp.abs(own - ordered("sampled_logprobs")), 0.0))
        return loss + aux / self.accum, {**sums, "logprob_max_diff": diff}

    def gradients(self, params: Any, pieces: dict[str, jax.Array], tokens: jax.Array, rows: int):
        """(loss, metrics, gradients) summed over the slices (the metric `logprob_max_diff` their maximum)."""
        grad_fn = jax.value_and_grad(lambda p, piece: self.slice_loss(p, piece, tokens, rows), has_aux=True)

        def body(carry, piece):
            (loss, sums), grads = grad_fn(params, piece)
            total = jax.tree.map(jnp.add, carry, (loss, sums, grads))
            total[1]["logprob_max_diff"] = jnp.maximum(carry[1]["logprob_max_diff"], sums["logprob_max_diff"])
            return total, None

        (loss, sums), grads = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], pieces))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (loss, sums, grads))
        (loss, sums, grads), _ = jax.lax.scan(body, zeros, pieces)
        return loss, sums, grads

    def apply(self, params: Any, opt_state: Any, pieces: dict[str, jax.Array], tokens: jax.Array, rows: int):
        """One optimizer update: (params, opt_state, metrics)."""
        loss, sums, grads = self.gradients(params, pieces, tokens, rows)
        grads = jax.lax.with_sharding_constraint(grads, self.layout.state["params"])
        grad_norm = optax.tree.norm(grads)
        updates, new_opt = self.tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": grad_norm, **sums}
        if self.skip_nonfinite:
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            new_params, new_opt = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                               (new_params, new_opt), (params, opt_state))
            metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
        return new_params, new_opt, metrics

    def __call__(self, core: dict[str, Any], reference: Any, batch: dict[str, jax.Array]):
        rows = batch["tokens"].shape[0]
        tokens = jnp.sum((batch["tokens"][:, 1:] >= 0).astype(jnp.float32))
        pieces = _slices(batch, self.accum, self.layout)
        if reference is not None:
            pieces["reference"] = jax.lax.map(lambda t: self.logprobs(reference, t), pieces["tokens"])
        if self.old == "forward":
            pieces["old"] = jax.lax.map(lambda t: self.logprobs(core["params"], t), pieces["tokens"])
        elif self.old == "engine":
            pieces["old"] = pieces["sampled_logprobs"]
        params, opt_state, metrics = self.apply(core["params"], core["opt_state"], pieces, tokens, rows)
        if self.rl.updates_per_rollout > 1:
            def again(_, carry):
                return self.apply(*carry, pieces, tokens, rows)[:2]
            params, opt_state = jax.lax.fori_loop(1, self.rl.updates_per_rollout, again, (params, opt_state))
        metrics["lr"] = self.schedule(core["step"] * self.rl.updates_per_rollout)
        return {"params": params, "opt_state": opt_state, "step": core["step"] + 1}, metrics

    def jitted(self, with_reference: bool):
        """jit(core, reference, batch) with explicit shardings; `reference` is None without a KL penalty."""
        state = {k: self.layout.state[k] for k in CORE}
        replicated = NamedSharding(self.layout.mesh, P())
        reference = self.layout.state["params"] if with_reference else None
        donate = () if self.layout.mesh.devices.flat[0].platform == "cpu" else (0,)
        return jax.jit(self.__call__, in_shardings=(state, reference, batch_shardings(self.layout)),
                       out_shardings=(state, replicated), donate_argnums=donate)
