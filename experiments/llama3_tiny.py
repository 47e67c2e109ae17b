"""llama3-tiny (byte vocabulary, d_model 128, 8 layers, GQA 8/4 heads, SwiGLU, tied embeddings) on the Python
standard library's source, a few hundred steps, on the layout the planner picks for the devices at hand.

Variant `pipeline`: the planner's best layout with 2 pipeline stages, interleaved 1F1B with 2 chunks per stage
(plan.fixed pins them; needs an even number of devices)."""
from train.config.experiment import base_config

FIXED = {"": "", "pipeline": "pipeline:2,schedule:interleaved,virtual_stages:2"}


def get_config(variant: str = ""):
    if variant not in FIXED:
        raise ValueError(f"experiments/llama3_tiny.py:{variant}: unknown variant; use pipeline or none")
    c = base_config()
    c.model.preset = "llama3-tiny"
    c.plan.update(auto=True, fixed=FIXED[variant])
    c.train.update(steps=300, global_batch_size=32, log_every=10, eval_every=100, eval_batches=4)
    c.optimizer.update(lr=3e-3, warmup_steps=20)
    c.checkpoint.every_steps = 100
    return c
