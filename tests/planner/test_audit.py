"""The communication audit finds exactly the collectives each layout needs, with loop trips counted."""
import functools
import math

import numpy as np
import pytest

from sharding import expected as expected_lib
from sharding import schedules, slot_program
from sharding.expected import Expected
from tests.helpers import run_python, tiny_config
from train.plan import audit as audit_lib
from train.plan import compile_report as report
from train.trainer import Trainer

LAYOUTS = {
    "data_parallel": ({"data": 8}, ["gradient all-reduce"]),
    "fsdp": ({"fsdp": 8}, ["weight all-gather (forward + backward)", "gradient reduce-scatter"]),
    "tensor_parallel": ({"tensor": 8}, ["activation all-reduce (Megatron)"]),
    "fsdp_tensor": ({"data": 2, "fsdp": 2, "tensor": 2},
                    ["gradient all-reduce", "weight all-gather (forward + backward)", "gradient reduce-scatter",
                     "activation all-reduce (Megatron)"]),
}


def _audit(strategy, mesh, pipeline=None):
    """The audit of one layout; each is built and compiled once per test process (tests only read it)."""
    return _audit_once(strategy, tuple(mesh.items()), tuple((pipeline or {}).items()))[0]


def _plan(strategy, mesh, pipeline=None):
    """The resolved plan of the layout `_audit` compiled."""
    return _audit_once(strategy, tuple(mesh.items()), tuple((pipeline or {}).items()))[1]


@functools.lru_cache(maxsize=None)
def _audit_once(strategy, mesh, pipeline):
    config = tiny_config(**dict(mesh))
    config.sharding.strategy = strategy
    config.pipeline.update(dict(pipeline))
    trainer = Trainer.build(config)
    compiled, log = audit_lib.compile_logged(trainer.compile)
    rep = report.build(trainer.plan, trainer.mesh, compiled)
    return audit_lib.audit(trainer, rep, log, topology="dgx-h100", hosts=16, mfu=0.4), trainer.plan


def _real_sends(schedule) -> int:
    """Messages one step sends between stages, counted from the table alone: each forward of a model chunk but
    the last sends its activation, each backward (B when split) of a chunk but the first its input gradient,
    unless the neighbouring chunk runs on the same device (a V's turn)."""
    kind, chunk = schedule.table[..., schedules.KIND], np.maximum(schedule.table[..., schedules.CHUNK], 0)
    d = np.broadcast_to(np.arange(schedule.stages), kind.shape)
    k = schedule.chunk_map[d, chunk]
    device_of = np.empty(schedule.num_chunks, int)
    device_of[schedule.chunk_map] = np.arange(schedule.stages)[:, None]
    last = schedule.num_chunks - 1
    acts = (kind == schedules.FORWARD) & (k < last) & (device_of[np.minimum(k + 1, last)] != d)
    grads = np.isin(kind, schedules.GIVES_INPUT_GRAD) & (k > 0) & (device_of[np.maximum(k - 1, 0)] != d)
    return int(acts.sum() + grads.sum())


@pytest.mark.parametrize("strategy", sorted(LAYOUTS))
def test_audit_matches_the_construction(strategy):
    mesh, purposes = LAYOUTS[strategy]
    result = _audit(strategy, mesh)
    rows = [r for r in result["rows"] if r["purpose"] != "scalars (loss, norms)"]
    assert sorted(r["purpose"] for r in rows) == sorted(purposes)
    for row in rows:
        # Within 5% of the bytes; the layer scan's trip count (8) is what makes these ratios 1.
        assert abs(row["ratio"] - 1) <= 0.05, row
        if row["op"] == "reduce_scatter" and "all_reduce" in row["found_ops"]:
            assert any("reduce-scatter would do" in n for n in row["notes"])
    assert result["involuntary_rematerializations"] == 0
    proj = result["projection"]
    assert proj["devices"] == 128 == math.prod(proj["mesh"].values())
    assert proj["comm_us"] > 0 and proj["compute_us"] > 0


@pytest.mark.parametrize("schedule,virtual_stages", [("1f1b", 1), ("interleaved", 2)])
def test_pipelined_audit_is_exact(schedule, virtual_stages):
    """3D layout: the tensor all-reduces inside the slot switch's branches count as often as each stage
    runs their branch (not every slot), the embedding/head gradients' all-reduce over (data, pipeline)
    is expected, and every row is exact and within 5%."""
    mesh = {"pipeline": 2, "data": 2, "tensor": 2}
    result = _audit("fsdp_tensor", mesh, {"schedule": schedule, "virtual_stages": virtual_stages})
    rows = {r["purpose"]: r for r in result["rows"] if r["purpose"] != "scalars (loss, norms)"}
    assert sorted(rows) == sorted(["gradient all-reduce", "embedding/head gradient all-reduce (on every stage)",
                                   "activation all-reduce (Megatron)", "stage activations and gradients"])
    assert rows["embedding/head gradient all-reduce (on every stage)"]["axes"] == ["data", "pipeline"]
    for row in result["rows"]:
        assert row["exact"], row
        assert row["ratio"] is None or abs(row["ratio"] - 1) <= 0.05, row
    assert result["involuntary_rematerializations"] == 0
    # Idle cells send nothing: the stage sends are the table's real messages (mean per device), and the compiled
    # permutes, weighed by how many slots take their pattern, move exactly those bytes.
    plan = _plan("fsdp_tensor", mesh, {"schedule": schedule, "virtual_stages": virtual_stages})
    pipe = plan.pipeline
    rows_per_replica = plan.global_batch // plan.mesh_sizes["data"]
    message = rows_per_replica // pipe.microbatches * plan.model.seq_len * plan.model.d_model * np.dtype(
        plan.model.compute_dtype).itemsize
    sends = rows["stage activations and gradients"]
    assert sends["expected_bytes"] == _real_sends(pipe.build()) / pipe.stages * message, sends
    assert sends["found_bytes"] == pytest.approx(sends["expected_bytes"], rel=1e-9), sends


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 4, 1), ("interleaved", 4, 8, 2), ("zb_h1", 4, 8, 1),
                                         ("zb_v", 4, 8, 2)])
def test_expected_stage_sends_are_the_real_messages(name, p, m, v):
    """Per device, the mean over the stages of the messages the table really sends: each microbatch crosses
    each boundary between devices once each way (1F1B on p=4, m=4: 24 messages, 6 per device, where one per
    slot and channel made 28 per device)."""
    schedule = schedules.build(name, p, m, v)
    boundaries = schedule.num_chunks - 1 - schedule.v_shape  # a V's turn stays on its device
    assert _real_sends(schedule) == 2 * m * boundaries
    assert expected_lib.messages_per_step(name, p, m, v) == _real_sends(schedule) / p
    # The planner pays a permute's latency in each slot where the executor's send switch sends on a channel.
    patterns = slot_program.send_patterns(slot_program.slot_program(schedule, True), p)
    issued = sum(bool(pairs[i]) for index, pairs in patterns.values() for i in index)
    assert expected_lib.sends_per_step(name, p, m, v) == issued


def test_projection_puts_data_across_hosts_and_tensor_inside():
    proj = _audit("fsdp_tensor", {"data": 2, "fsdp": 2, "tensor": 2})["projection"]
    assert proj["mesh"] == {"data": 32, "pipeline": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    assert proj["links"]["tensor"] == "intra" and proj["links"]["data"] == "inter"


_REMAT_PROBE = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
jax.config.update("jax_num_cpu_devices", 8)
from mesh import make_mesh
from train.plan import audit as audit_lib
mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
table = jax.ShapeDtypeStruct((256, 128), jnp.float32, sharding=NamedSharding(mesh, P("tensor", "fsdp")))
tokens = jax.ShapeDtypeStruct((16, 64), jnp.int32, sharding=NamedSharding(mesh, P(("data", "fsdp"))))
lookup = jax.jit(lambda t, i: jax.lax.with_sharding_constraint(
    jnp.take(t, i, axis=0), NamedSharding(mesh, P(("data", "fsdp")))))
_, log = audit_lib.compile_logged(lambda: lookup.lower(table, tokens).compile())
print(log.count(audit_lib.REMAT_WARNING))
"""


def test_xla_remat_warning_is_caught():
    # In a fresh process: XLA logs this warning a limited number of times per process, so an earlier test's
    # compile in the same pytest worker could use them up (a `--audit` run is its own process).
    run = run_python("-c", _REMAT_PROBE, timeout=120, env={"JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert int(run.stdout.strip().splitlines()[-1]) >= 1


def test_unexpected_collectives_are_flagged():
    expected = [Expected("gradient all-reduce", "all_reduce", "data", 100.0)]
    records = [{"op": "all_reduce", "axes": ["data"], "bytes": 50, "count": 4, "scalar": False},
               {"op": "all_to_all", "axes": ["tensor"], "bytes": 8, "count": 1, "scalar": False}]
    rows = {r["purpose"]: r for r in audit_lib.attribute(records, expected, {"data": 2, "tensor": 2})}
    assert rows["gradient all-reduce"]["ratio"] == 2.0 and "2.00x" in rows["gradient all-reduce"]["notes"][0]
    assert rows["unexpected"]["notes"] == ["resharding all-to-all"]


def test_branch_records_count_by_the_mean_stage():
    """Slot switch of 3 branches over 10 slots: stage 0 runs branch 1 in 4 slots, stage 1 in none, so a
    collective there runs 2 times per device on average; a record of another conditional keeps its bound; a
    send switch's permute counts by its pattern's slots and senders."""
    switch = {"conditional": "c", "index": 1, "branches": 3, "count": 10}
    other = dict(switch, conditional="d", branches=2)
    records = [{"op": "all_reduce", "axes": ["tensor"], "bytes": 100, "count": 10, "scalar": False, "exact": False,
                "trips_known": True, "branch": [switch]},
               {"op": "all_reduce", "axes": ["data"], "bytes": 8, "count": 10, "scalar": False, "exact": False,
                "trips_known": True, "branch": [other]}]
    # A permute of the activations' send switch (its op_name names the channel): pattern 1 runs in 4 of the 10
    # slots and sends from 2 of the 8 devices, so 10 * 4/10 * 2/8 = 1 execution per device; the slot switch's
    # weighing leaves it alone though its switch has as many branches.
    send = {"op": "collective_permute", "axes": ["pipeline"], "bytes": 100, "count": 10, "scalar": False,
            "exact": False, "trips_known": True, "branch": [dict(switch, conditional="s")], "senders": 2,
            "op_name": "jit(step)/shard_map/send_act_write/cond/branch_1_fun/ppermute"}
    weighed = audit_lib.weigh_branches(records + [send], [[6, 4, 0], [10, 0, 0]], slots=10)
    assert (weighed[0]["count"], weighed[0]["exact"]) == (2.0, True) and weighed[1:] == records[1:] + [send]
    sent = audit_lib.weigh_sends(weighed, {"act_write": [5, 4, 1]}, slots=10, devices=8)
    assert sent[:2] == weighed[:2] and (sent[2]["count"], sent[2]["exact"]) == (1.0, True)
    expected = [Expected("activation", "all_reduce", "tensor", 200.0), Expected("grads", "all_reduce", "data", 80.0)]
    rows = {r["purpose"]: r for r in audit_lib.attribute(weighed, expected, {"data": 2, "tensor": 2})}
    assert rows["activation"]["exact"] and rows["activation"]["ratio"] == 1.0
    assert not rows["grads"]["exact"] and "count not exact" in rows["grads"]["notes"][0]


def test_pipelined_fsdp_tensor_audit_is_exact():
    """pipeline x fsdp x tensor: the FSDP weights are gathered and their gradients reduce-scattered once per
    step over fsdp alone, on each tensor shard: no tensor all-gather of weights or gradients at the region's
    edges, and the fsdp bytes are those of the tensor-sharded weights (not twice that)."""
    mesh = {"pipeline": 2, "fsdp": 2, "tensor": 2}
    result = _audit("fsdp_tensor", mesh, {"schedule": "1f1b"})
    rows = {r["purpose"]: r for r in result["rows"] if r["purpose"] != "scalars (loss, norms)"}
    assert sorted(rows) == sorted(["weight all-gather (once per step, pipeline)", "gradient reduce-scatter",
                                   "embedding/head gradient all-reduce (on every stage)",
                                   "activation all-reduce (Megatron)", "stage activations and gradients"])
    for row in result["rows"]:
        assert row["exact"], row
        assert row["ratio"] is None or abs(row["ratio"] - 1) <= 0.05, row
    assert result["involuntary_rematerializations"] == 0
