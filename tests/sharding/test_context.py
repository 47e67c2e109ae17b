"""Long sequences: context parallelism (ring attention over `context`) and Megatron sequence parallelism compute
the single-device run, cut activation memory, communicate what the construction says, and refuse what they
do not support with one line."""
import functools
import math

import numpy as np
import pytest

from mesh.errors import UserError
from sharding.context import zigzag_order
from tests.helpers import (
    STEPS,
    compiled_step,
    grads_and_run,
    reference_config,
    rel_norm,
    single_device_reference,
    tiny_config,
)
from train.loop import runner as loop
from train.plan import audit as audit_lib
from train.plan import compile_report as report
from train.trainer import Trainer

LAYOUTS = [  # (mesh, sequence parallelism); each runs on as many devices as its axes multiply to
    ({"context": 2}, False),
    ({"context": 4, "data": 2}, False),
    ({"context": 2, "tensor": 2}, False),
    ({"tensor": 4, "data": 2}, True),
]


def _config(mesh: dict, sequence_parallel: bool = False):
    config = reference_config(**mesh)
    config.sharding.sequence_parallel = sequence_parallel
    return config


@functools.lru_cache(maxsize=None)
def _trainer(mesh: tuple, sequence_parallel: bool) -> Trainer:
    return Trainer.build(_config(dict(mesh), sequence_parallel), num_devices=math.prod(size for _, size in mesh))


def test_zigzag_order_gives_device_i_chunks_i_and_2c_minus_1_minus_i():
    order = zigzag_order(16, 4).reshape(4, 2, 2)  # 4 devices, 8 chunks of 2 positions
    assert order[:, :, 0].tolist() == [[0, 14], [2, 12], [4, 10], [6, 8]]
    assert sorted(order.ravel().tolist()) == list(range(16))


@pytest.mark.parametrize("mesh,sequence_parallel", LAYOUTS,
                         ids=lambda v: ",".join(f"{k}={n}" for k, n in v.items()) if isinstance(v, dict)
                         else ("sp" if v else "-"))
def test_long_sequence_layout_matches_single_device(mesh, sequence_parallel):
    ref_losses, ref_grads = single_device_reference()
    trainer = _trainer(tuple(mesh.items()), sequence_parallel)
    grads, losses, _ = grads_and_run(trainer, STEPS)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert rel_norm(grads, ref_grads) < 1e-5


def test_context_parallelism_cuts_activation_memory():
    """Compile only: at 4096 tokens a row, 4 context devices each need at most 0.35x one device's temporaries
    (the ring keeps [2C, 2C] and [C, C] score blocks where one device builds the whole L x L)."""
    temps = {}
    for context in (1, 4):
        config = _config({"context": context})
        config.model.seq_len, config.train.global_batch_size = 4096, 1
        temps[context] = Trainer.build(config, num_devices=context).compile().memory_analysis().temp_size_in_bytes
    assert temps[4] <= 0.35 * temps[1], temps


@pytest.mark.parametrize("layout,purposes", [
    (LAYOUTS[3], ["gradient all-reduce", "activation reduce-scatter (sequence parallel)",
                  "activation all-gather (sequence parallel)"]),
    (LAYOUTS[2], ["gradient all-reduce", "ring attention K/V blocks", "activation all-reduce (Megatron)"]),
], ids=["tensor=4,data=2,sp", "context=2,tensor=2"])
def test_audit_of_sequence_and_context_parallelism(layout, purposes):
    """Every expected row at 1.00 within 5%, nothing unexpected; no activation all-reduce under sequence
    parallelism (XLA:CPU emits an all-reduce + slice for each reduce-scatter, counted in its row). It reads the
    program the equivalence test above compiled (compiled_step)."""
    mesh, sequence_parallel = layout
    trainer = _trainer(tuple(mesh.items()), sequence_parallel)
    result = audit_lib.audit(trainer, report.build(trainer.plan, trainer.mesh, compiled_step(trainer)), "",
                             topology="dgx-h100", hosts=16, mfu=0.4)
    rows = [r for r in result["rows"] if r["purpose"] != "scalars (loss, norms)"]
    assert sorted(r["purpose"] for r in rows) == sorted(purposes)
    for row in rows:
        assert abs(row["ratio"] - 1) <= 0.05, row


def _bad(mesh: dict, **changes):
    config = tiny_config(**mesh)
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        config[section][key] = value
    return config


BAD = {
    "sp_without_tensor": (_bad({"data": 8}, sharding__sequence_parallel=True),
                          "sharding.sequence_parallel=True needs mesh.tensor > 1"),
    "sp_without_tensor_rules": (_bad({"tensor": 8}, sharding__sequence_parallel=True, sharding__strategy="fsdp",
                                     sharding__rules={"mlp": "tensor"}), "needs a tensor-parallel strategy"),
    "context_cudnn_in_a_pipeline": (_bad({"pipeline": 2, "context": 4}, model__attention="cudnn"),
                                    "model.attention=cudnn with mesh.context=4"),
    "context_seq_len": (_bad({"context": 8}, model__seq_len=72),
                        "model.seq_len=72 is not divisible by 2 x mesh.context=8"),
    "context_cudnn": (_bad({"context": 8}, model__attention="cudnn"), "model.attention=cudnn with mesh.context=8"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_unsupported_combination_is_one_line_before_compiling(name, tmp_path, monkeypatch):
    config, fragment = BAD[name]
    monkeypatch.setattr(loop.Trainer, "compile", lambda self: pytest.fail("compiled a bad config"))
    with pytest.raises(UserError) as info:
        loop.run(config, str(tmp_path / "run"))
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
