"""The pipeline executor: every schedule on three 3D layouts trains exactly as one device does (losses,
first-step gradients, parameters in logical order), so do the zero-bubble schedules (split backwards), 1F1B's
memory stays flat in the microbatch count while GPipe's grows and ZB-H1's stays near 1F1B's, only stage-local
collectives run per slot, and misconfigurations fail with one line."""
import functools

import numpy as np
import pytest

from mesh import hlo
from mesh.errors import UserError
from sharding import pipeline as pipeline_lib
from sharding import pipeline_stages as stages
from sharding import schedules, slot_program
from tests.helpers import (
    STEPS,
    compiled_step,
    grads_and_run,
    reference_config,
    rel_norm,
    single_device_run,
    tiny_config,
)
from train.config.experiment import resolve
from train.trainer import Trainer

LAYOUTS = [(("pipeline", 4), ("data", 2)),
           (("pipeline", 2), ("data", 2), ("tensor", 2)),
           (("pipeline", 2), ("fsdp", 2), ("data", 2))]
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]
# FSDP and tensor inside the pipeline: the gather and reduce-scatter run per tensor shard (a nested shard_map).
FSDP_TENSOR = (("pipeline", 2), ("fsdp", 2), ("tensor", 2))


def _config(layout, schedule="1f1b", virtual_stages=1, microbatches=4, batch=16, model=reference_config):
    config = model(**dict(layout))
    config.pipeline.update(schedule=schedule, virtual_stages=virtual_stages, microbatches=microbatches)
    config.train.global_batch_size = batch
    return config


@functools.lru_cache(maxsize=None)
def _trainer(layout, schedule="1f1b", virtual_stages=1, microbatches=4, batch=16) -> Trainer:
    return Trainer.build(_config(layout, schedule, virtual_stages, microbatches, batch))


def _reference():
    ref = single_device_run(STEPS)
    return ref["losses"], ref["grads"], ref["params"], ref["eval_loss"]


def _name(layout):
    return ",".join(f"{axis}={size}" for axis, size in layout)


# Every schedule on one of the layouts or two, every layout with one schedule or two (the executor runs any table
# the same way; the full cross product costs twice the compiles for no path it does not already take).
MATRIX = [(LAYOUTS[0], *SCHEDULES[1]), (LAYOUTS[0], *SCHEDULES[2]), (LAYOUTS[1], *SCHEDULES[0]),
          (LAYOUTS[1], *SCHEDULES[2]), (LAYOUTS[2], *SCHEDULES[1])]


@pytest.mark.parametrize("layout,schedule,virtual_stages", MATRIX,
                         ids=[f"{_name(layout)}-{schedule}" for layout, schedule, _ in MATRIX])
def test_schedule_matches_single_device(layout, schedule, virtual_stages):
    ref_losses, ref_grads, ref_params, ref_eval = _reference()
    trainer = _trainer(layout, schedule, virtual_stages)
    grads, losses, state = grads_and_run(trainer, STEPS)
    if trainer.layer_order is not None:  # interleaved: the in-memory stack is in device-chunk order
        grads = pipeline_lib.to_logical(grads, trainer.layer_order)
    assert rel_norm(grads, ref_grads) < 1e-5
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    # Checkpoints are layout-free: the logical-order state is the single-device state.
    assert rel_norm(trainer.to_logical(state)["params"], ref_params) < 1e-5
    if layout == LAYOUTS[0] and schedule in ("interleaved", "zb_v"):  # the pipelined eval step, on permuted layers
        np.testing.assert_allclose(float(trainer.eval_step(state["params"], trainer.batch(0, "eval"))), ref_eval,
                                   rtol=1e-5)


@pytest.mark.parametrize("schedule,virtual_stages", [("zb_h1", 1), ("zb_v", 2)], ids=["zb_h1", "zb_v"])
@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=_name)
def test_zero_bubble_matches_single_device(layout, schedule, virtual_stages):
    """B and W cells (the split backward) on pipeline=4 beside data and pipeline=2 beside data and tensor; zb_v
    also sends activations back up the stages and keeps them at the V's turn."""
    test_schedule_matches_single_device(layout, schedule, virtual_stages)


def test_chunked_loss_on_a_pipeline_matches_single_device():
    """model.loss_chunk_size > 0 (every preset from gpt2-125m up) on the last stage: the chunks' scan inside the
    stage's shard_map trains as the whole loss on one device does (7 does not divide the sequence: a padded chunk)."""
    ref_losses, ref_grads, _, _ = _reference()
    config = _config(LAYOUTS[0])
    config.model.loss_chunk_size = 7
    grads, losses, _ = grads_and_run(Trainer.build(config), STEPS)
    assert rel_norm(grads, ref_grads) < 1e-5
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)


def test_fsdp_tensor_layout_matches_single_device():
    test_schedule_matches_single_device(FSDP_TENSOR, "1f1b", 1)


def test_v_shaped_layer_order():
    # zb_v on 2 stages: device 0 holds model chunks 0 and 3 (layers 0,1 and 6,7), device 1 chunks 1 and 2.
    np.testing.assert_array_equal(pipeline_lib.layer_order(8, 2, 2, v_shape=True), [0, 1, 6, 7, 2, 3, 4, 5])


def test_layer_order_round_trip():
    order = pipeline_lib.layer_order(8, 2, 2)
    # Device 0 holds model chunks 0 and 2 (layers 0,1 and 4,5), device 1 chunks 1 and 3.
    np.testing.assert_array_equal(order, [0, 1, 4, 5, 2, 3, 6, 7])
    tree = {"layers": {"w": np.arange(8)}, "embed": np.arange(3)}
    physical = pipeline_lib.from_logical(tree, order)
    np.testing.assert_array_equal(physical["layers"]["w"], order)
    np.testing.assert_array_equal(pipeline_lib.to_logical(physical, order)["layers"]["w"], np.arange(8))
    np.testing.assert_array_equal(physical["embed"], np.arange(3))


@functools.lru_cache(maxsize=None)
def _temp_bytes(schedule: str, m: int) -> int:
    """Compiled temp bytes of the tiny model on LAYOUTS[0] with 2 rows per microbatch per replica."""
    trainer = Trainer.build(_config(LAYOUTS[0], schedule, 1, m, 2 * 2 * m, model=tiny_config))
    return trainer.compile().memory_analysis().temp_size_in_bytes


def test_one_f_one_b_memory_is_flat_and_gpipe_grows():
    """Microbatch size fixed at 2 rows per replica: the batch grows with m. GPipe keeps m inputs per stage,
    1F1B at most p, so only GPipe's temp memory grows, by one [2, seq, d_model] input per extra microbatch."""
    temp = {(s, m): _temp_bytes(s, m) for s in ("1f1b", "gpipe") for m in (4, 16)}
    assert temp["1f1b", 16] <= 1.3 * temp["1f1b", 4], temp
    entry = 2 * 64 * 128 * 4
    assert temp["gpipe", 16] - temp["gpipe", 4] >= 0.9 * (16 - 4) * entry, temp
    assert temp["gpipe", 16] > temp["1f1b", 16], temp


def test_zb_h1_memory_stays_near_1f1b():
    """ZB-H1 keeps 1F1B's p stage inputs; only its gradient buffer grows (p-1 entries waiting for their W), and
    its split cells add no buffer of their own: compiled temp bytes within 10% of 1F1B's."""
    assert _temp_bytes("zb_h1", 4) <= 1.1 * _temp_bytes("1f1b", 4), (_temp_bytes("zb_h1", 4), _temp_bytes("1f1b", 4))


@pytest.mark.parametrize("layout,schedule,virtual_stages", MATRIX[3:5], ids=[_name(row[0]) for row in MATRIX[3:5]])
def test_collectives_per_step(layout, schedule, virtual_stages):
    """Batch-axis reductions once per step; inside the slot loop only pipeline sends and the stage's own
    tensor-parallel all-reduces; the token batch is never gathered. It reads the programs the schedule tests
    compiled (compiled_step)."""
    trainer = _trainer(layout, schedule, virtual_stages)
    records = hlo.collectives(compiled_step(trainer).as_text(), trainer.mesh)
    slots = trainer.plan.pipeline.build().num_slots
    batch_axes = {"data", "fsdp"}
    reductions = [r for r in records if batch_axes & set(r["axes"]) and not r["scalar"]]
    assert reductions and all(r["count"] == 1 for r in reductions), reductions
    in_loop = [r for r in records if r["count"] >= slots]
    assert any(r["op"] == "collective_permute" for r in in_loop), in_loop
    for r in in_loop:
        assert (r["op"], r["axes"]) in (("collective_permute", ["pipeline"]), ("all_reduce", ["tensor"])), r
    assert not [r for r in records if r["dtype"].startswith("s")], "an integer (token) array was communicated"


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 4, 4, 1), ("1f1b", 2, 4, 1), ("interleaved", 2, 4, 2),
                                         ("interleaved", 4, 8, 2)])
def test_branch_slot_counts(name, p, m, v):
    """Per stage: every slot runs one branch; each microbatch's forward and backward run once per chunk, the
    embedding cells (first) on stage 0 only, the head cells (last) on stage p-1 only; idle = the bubble."""
    counts = slot_program.branch_slot_counts(schedules.build(name, p, m, v))
    slots = 2 * (v * m + p - 1)
    assert counts.shape == (p, stages.NUM_BRANCHES) and (counts.sum(axis=1) == slots).all()
    np.testing.assert_array_equal(counts[:, stages.IDLE], 2 * (p - 1))
    for first, mid, last in ((stages.FWD_FIRST, stages.FWD_MID, stages.FWD_LAST),
                             (stages.BWD_FIRST, stages.BWD_MID, stages.BWD_LAST)):
        np.testing.assert_array_equal(counts[:, first], [m] + [0] * (p - 1))
        np.testing.assert_array_equal(counts[:, last], [0] * (p - 1) + [m])
        np.testing.assert_array_equal(counts[:, first] + counts[:, mid] + counts[:, last], v * m)


def test_branch_slot_counts_of_split_backwards():
    """ZB-H1 on p=4, m=8: per stage m forwards, m B cells and m W cells; the first chunk's B is idle (nothing
    upstream to send to) and its W the whole backward of the embedding chunk; idle = the p-1 bubble slots."""
    p, m = 4, 8
    counts = slot_program.branch_slot_counts(schedules.build("zb_h1", p, m))
    assert counts.shape == (p, stages.NUM_SPLIT_BRANCHES) and (counts.sum(axis=1) == 3 * m + p - 1).all()
    np.testing.assert_array_equal(counts[:, stages.IDLE], [p - 1 + m] + [p - 1] * (p - 1))
    np.testing.assert_array_equal(counts[:, stages.BWD_FIRST], [m] + [0] * (p - 1))
    np.testing.assert_array_equal(counts[:, stages.BWD_MID] + counts[:, stages.BWD_LAST], 0)
    np.testing.assert_array_equal(counts[:, stages.INPUT_MID], [0, m, m, 0])
    np.testing.assert_array_equal(counts[:, stages.WEIGHT_LAST], [0, 0, 0, m])
    assert slot_program.branch_slot_counts(schedules.build("zb_h1", p, m), train=False).shape[1] == stages.NUM_BRANCHES


def _bad(changes: dict, layout=(("pipeline", 4), ("data", 2))):
    config = _config(layout)
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        config[section][key] = value
    return config


@pytest.mark.parametrize("changes,fragment", [
    ({"pipeline.schedule": "interleaved", "pipeline.virtual_stages": 4},
     "model.n_layers=8 is not divisible by mesh.pipeline=4 x pipeline.virtual_stages=4"),
    ({"train.global_batch_size": 12}, "train.global_batch_size=12 is not divisible by the data-parallel size 2 x "
                                     "pipeline.microbatches=4"),
    ({"pipeline.microbatches": 2}, "pipeline.microbatches=2: the 1f1b schedule needs at least"),
    ({"pipeline.schedule": "interleaved", "pipeline.virtual_stages": 2, "pipeline.microbatches": 6},
     "pipeline.microbatches=6: the interleaved schedule needs a multiple"),
    ({"pipeline.schedule": "zero_bubble"}, "pipeline.schedule='zero_bubble': unknown schedule"),
    ({"pipeline.virtual_stages": 2}, "pipeline.virtual_stages=2: only pipeline.schedule='interleaved'"),
    ({"sharding.rules": {"mlp": "pipeline"}}, "sharding.rules maps 'mlp' onto 'pipeline'"),
], ids=["layers", "batch", "1f1b_microbatches", "interleaved_microbatches", "unknown", "virtual", "rule"])
def test_misconfiguration_fails_in_one_line(changes, fragment):
    with pytest.raises(UserError) as info:
        resolve(_bad(changes), 8)
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)
