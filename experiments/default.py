"""The default experiment (`make train`): the small model on the Python standard library's source, on 8
devices in 3D as pipeline x data x tensor = 2 x 2 x 2 (interleaved 1F1B, 2 chunks per stage), a few hundred steps."""
from train.config import base_config


def get_config():
    c = base_config()
    c.model.preset = "small"
    c.mesh.update(data=2, pipeline=2, tensor=2)
    # Fastest of the schedules measured by experiments/bench_pipeline.py on CPU (README); bubble 11%.
    c.pipeline.update(schedule="interleaved", virtual_stages=2, microbatches=4)
    c.train.update(steps=300, global_batch_size=32, log_every=10, eval_every=100, eval_batches=4)
    c.optimizer.update(lr=3e-3, warmup_steps=20)
    return c
