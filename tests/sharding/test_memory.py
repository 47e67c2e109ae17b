"""Sharding really divides memory: FSDP arguments per device, and optimizer-state sharding over data."""
import math

import jax
import numpy as np

from tests.helpers import tiny_config
from train.trainer import Trainer


def _argument_bytes(trainer: Trainer) -> int:
    return trainer.compile().memory_analysis().argument_size_in_bytes


def _per_device_bytes(tree, shardings) -> int:
    return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
               for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def test_fsdp_divides_argument_bytes():
    single = _argument_bytes(Trainer.build(tiny_config(), num_devices=1))
    fsdp = _argument_bytes(Trainer.build(tiny_config(fsdp=8)))
    assert fsdp <= single / 6, (fsdp, single)


def test_optimizer_state_sharding_divides_by_data_axis():
    per_device = {}
    for shard in (False, True):
        config = tiny_config(data=8)
        config.sharding.shard_opt_state = shard
        layout = Trainer.build(config).layout
        per_device[shard] = _per_device_bytes(layout.abstract_state["opt_state"], layout.state["opt_state"])
    # Adam's two moments shrink 8-fold; only the step counter stays replicated.
    np.testing.assert_allclose(per_device[False] / per_device[True], 8, rtol=1e-3)
