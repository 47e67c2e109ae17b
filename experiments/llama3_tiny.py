"""llama3-tiny (byte vocabulary, d_model 128, 8 layers, GQA 8/4 heads, SwiGLU, tied embeddings) on the Python
standard library's source, on 8 devices as data x tensor = 2 x 4, a few hundred steps.

Variant `pipeline`: pipeline x data x tensor = 2 x 2 x 2, interleaved 1F1B with 2 chunks per stage."""
from train.config import base_config

LAYOUTS = {"": dict(data=2, tensor=4), "pipeline": dict(data=2, pipeline=2, tensor=2)}


def get_config(variant: str = ""):
    if variant not in LAYOUTS:
        raise ValueError(f"experiments/llama3_tiny.py:{variant}: unknown variant; use pipeline or none")
    c = base_config()
    c.model.preset = "llama3-tiny"
    c.mesh.update(LAYOUTS[variant])
    if variant:
        c.pipeline.update(schedule="interleaved", virtual_stages=2, microbatches=4)
    c.train.update(steps=300, global_batch_size=32, log_every=10, eval_every=100, eval_batches=4)
    c.optimizer.update(lr=3e-3, warmup_steps=20)
    c.checkpoint.every_steps = 100
    return c
