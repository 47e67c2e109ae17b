"""The composition matrix: layouts that combine parallel axes compute what one device computes (losses within
1e-4, first-step gradients within 1e-5), one compiled program per layout."""
import math

import numpy as np
import pytest

from tests.helpers import grads_and_run, reference_config, rel_norm, single_device_reference
from train.trainer import Trainer

# (mesh, sequence parallelism). Three axes at a time, so that one compiled program holds several pairs: context x
# data, context x fsdp, context x tensor + sequence parallelism, tensor + sequence parallelism x data and x fsdp.
DENSE = [
    ({"data": 2, "context": 2, "tensor": 2}, True),
    ({"fsdp": 2, "context": 2, "tensor": 2}, True),
]


def _id(value) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={n}" for k, n in value.items())
    return "sp" if value else "-"


@pytest.mark.parametrize("mesh,sequence_parallel", DENSE, ids=_id)
def test_dense_composition_matches_single_device(mesh, sequence_parallel):
    ref_losses, ref_grads = single_device_reference(5)
    config = reference_config(**mesh)
    config.sharding.sequence_parallel = sequence_parallel
    trainer = Trainer.build(config, num_devices=math.prod(mesh.values()))
    grads, losses, _ = grads_and_run(trainer, 5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert rel_norm(grads, ref_grads) < 1e-5
