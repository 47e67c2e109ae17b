"""The default experiment (`make train`): the small model on the Python standard library's source,
on 8 devices laid out as data x fsdp x tensor = 2 x 2 x 2, a few hundred steps."""
from train.config import base_config


def get_config():
    c = base_config()
    c.model.preset = "small"
    c.mesh.update(data=2, fsdp=2, tensor=2)
    c.train.update(steps=300, global_batch_size=32, log_every=10, eval_every=100, eval_batches=4)
    c.optimizer.update(lr=3e-3, warmup_steps=20)
    return c
