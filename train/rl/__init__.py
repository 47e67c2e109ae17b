"""Reinforcement learning on verifiable rewards (GRPO): `python -m train.rl`. A run is a training run whose batch is
the step's rollouts, sampled by the serving engine (train/serve) from the policy, scored by a reward, and whose step
is the clipped group-relative objective; after each update the weights are resharded device to device into the
engine. The loop, checkpoints, preemption, resume and loggers are the training loop's own (train/loop)."""
