"""`fault_injection.nan_at_step`, outside the compiled step: step k starts from NaN parameters, so its loss
and gradients are NaN; under train.on_nonfinite=skip the parameters before the poisoning come back after it,
as if the step had skipped a bad update of clean ones. The loop's FaultInjection action does this."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from train.state import State
from train.trainer import Trainer


def poisoned(state: State) -> State:
    """`state` with NaN parameters (same shardings; the optimizer state and the step counter untouched)."""
    return {**state, "params": jax.tree.map(lambda p: p * jnp.nan, state["params"])}


def restored(state: State, params: Any) -> State:
    """`state` after a skipped poisoned step, with the parameters the poisoning replaced."""
    return {**state, "params": params}


def with_nan_injection(trainer: Trainer) -> Callable[[State, jax.Array], tuple[State, dict[str, jax.Array]]]:
    """trainer.train_step with plan.faults.nan_at_step injected around it as the loop does, for callers of
    the step itself (tests); it reads the step counter on the host."""
    k, skip = trainer.plan.faults.nan_at_step, trainer.plan.train.on_nonfinite == "skip"

    def step(state: State, batch: jax.Array) -> tuple[State, dict[str, jax.Array]]:
        if not k or int(state["step"]) + 1 != k:
            return trainer.train_step(state, batch)
        new, metrics = trainer.train_step(poisoned(state), batch)
        return (restored(new, state["params"]) if skip else new), metrics

    return step
