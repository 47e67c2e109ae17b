"""The tiny model (1.6M parameters, 8 layers, short sequences, small batches) for quick checks; the planner
picks the layout for the devices at hand (a --config.mesh.* override pins your own)."""
from train.config.experiment import base_config


def get_config(variant: str = ""):
    if variant:
        raise ValueError(f"experiments/tiny.py:{variant}: this experiment has no variants")
    c = base_config()
    c.model.preset = "tiny"
    c.plan.auto = True
    c.train.steps = 20
    c.train.global_batch_size = 16
    c.train.log_every = 5
    c.train.eval_every = 10
    c.train.eval_batches = 2
    c.optimizer.warmup_steps = 2
    return c
