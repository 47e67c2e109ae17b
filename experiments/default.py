"""The default experiment (`make train`): the small model on the Python standard library's source, on 8
devices in 3D as data=2 x pipeline=2 x tensor=2 (interleaved 1F1B, 2 chunks per stage), a few hundred steps.

Variants (`--config=experiments/default.py:NAME`) keep everything but the layout: `fsdp_tensor` (data x fsdp
x tensor = 2 x 2 x 2, no pipeline), `data_parallel` (data=8)."""
from train.config.experiment import base_config
from train.config.settings import nearest

LAYOUTS = {
    "": dict(data=2, pipeline=2, tensor=2),
    "fsdp_tensor": dict(data=2, fsdp=2, tensor=2),
    "data_parallel": dict(data=8),
}


def get_config(variant: str = ""):
    if variant not in LAYOUTS:
        raise ValueError(f"experiments/default.py:{variant}: unknown variant; {nearest(variant, LAYOUTS)}use one of "
                         f"{', '.join(v for v in LAYOUTS if v)} or none")
    c = base_config()
    c.model.preset = "small"
    c.mesh.update(LAYOUTS[variant])
    if variant:
        c.sharding.strategy = variant
    else:  # the fastest schedule measured by experiments/bench_pipeline.py on CPU (docs/benchmarks.md); bubble 11%
        c.pipeline.update(schedule="interleaved", virtual_stages=2, microbatches=4)
    c.train.update(steps=300, global_batch_size=32, log_every=10, eval_every=100, eval_batches=4)
    c.optimizer.update(lr=3e-3, warmup_steps=20)
    c.checkpoint.every_steps = 100
    return c
