"""Every layout computes the same training run as one device: losses and first-step gradients."""
import jax
import numpy as np
import pytest

from tests.helpers import (
    STEPS,
    grads_and_run,
    reference_config,
    rel_norm,
    run_steps,
    single_device_reference,
    step_with_grads,
)
from train.trainer import Trainer

LAYOUTS = [
    {"data": 8},
    {"fsdp": 8},
    {"data": 2, "fsdp": 2, "tensor": 2},
    {"data": 2, "tensor": 4},
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_layout_matches_single_device(layout):
    ref_losses, ref_grads = single_device_reference()
    trainer = Trainer.build(reference_config(**layout))
    grads, losses, _ = grads_and_run(trainer, STEPS)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert rel_norm(grads, ref_grads) < 1e-5


def test_gradient_accumulation_matches_one_big_batch():
    ref_losses, _ = single_device_reference()
    config = reference_config(data=4, fsdp=2)
    config.train.grad_accum_steps = 2
    trainer = Trainer.build(config)
    losses, state = run_steps(trainer, STEPS)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    # Evaluation goes through the same slices, and averages to the whole batch's loss.
    whole = Trainer.build(reference_config(data=4, fsdp=2))
    batch = trainer.batch(0, split="eval")
    np.testing.assert_allclose(trainer.eval_step(state["params"], batch), whole.eval_step(state["params"], batch),
                               rtol=1e-5)


def test_optimizer_state_sharding_keeps_the_numbers():
    ref_losses, _ = single_device_reference()
    config = reference_config(data=8)
    config.sharding.shard_opt_state = True
    losses, _ = run_steps(Trainer.build(config), STEPS)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)


def test_step_with_grads_returns_the_gradients_and_keeps_the_update():
    """The equivalence tests read gradients from step_with_grads: they are loss_and_grad's (accumulated over
    two slices here), and the step's new state and metrics are the production step's."""
    config = reference_config()
    config.model.update(n_layers=2, d_model=32, n_heads=4)
    config.train.grad_accum_steps = 2
    trainer = Trainer.build(config, num_devices=1)
    state, batch = trainer.init_state(), trainer.batch(0)
    new_state, metrics, grads = jax.device_get(step_with_grads(trainer)(state, batch))
    loss, ref_grads = jax.device_get(jax.jit(trainer.loss_and_grad)(state["params"], batch))
    ref_state, ref_metrics = jax.device_get(trainer.train_step(state, batch))
    assert rel_norm(grads, ref_grads) < 1e-6
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
    assert rel_norm(new_state, ref_state) < 1e-6
    for key, value in ref_metrics.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-6, err_msg=key)
