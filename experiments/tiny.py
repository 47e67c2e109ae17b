"""The tiny model for tests: 1.6M parameters, 8 layers, short sequences, small batches."""
from train.config import base_config


def get_config(variant: str = ""):
    if variant:
        raise ValueError(f"experiments/tiny.py:{variant}: this experiment has no variants")
    c = base_config()
    c.model.preset = "tiny"
    c.mesh.data = -1
    c.train.steps = 20
    c.train.global_batch_size = 16
    c.train.log_every = 5
    c.train.eval_every = 10
    c.train.eval_batches = 2
    c.optimizer.warmup_steps = 2
    return c
