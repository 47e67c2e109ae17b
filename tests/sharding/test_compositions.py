"""The composition matrix: layouts that combine parallel axes compute what one device computes (losses within
1e-4, first-step gradients within 1e-5), one compiled program per layout."""
import functools
import math

import jax
import numpy as np
import pytest

from sharding import pipeline as pipeline_lib
from tests.helpers import (
    STEPS,
    documents_config,
    documents_datadir,
    grads_and_run,
    moe_config,
    reference_config,
    rel_norm,
    single_device_reference,
    step_with_grads,
)
from train.plan import audit as audit_lib
from train.plan import compile_report as report
from train.trainer import Trainer

# (mesh, sequence parallelism). Three axes at a time, so that one compiled program holds several pairs: context x
# fsdp, context x tensor + sequence parallelism, tensor + sequence parallelism x fsdp, and sequence parallelism
# and context inside a pipeline (context x data and tensor + sequence parallelism x data:
# tests/sharding/test_context.py's layouts; pipeline x data and tensor: tests/sharding/test_pipeline.py's).
DENSE = [
    ({"fsdp": 2, "context": 2, "tensor": 2}, True),
    ({"pipeline": 2, "context": 2, "tensor": 2}, True),
]


def _id(value) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={n}" for k, n in value.items())
    return "sp" if value else "-"


@functools.lru_cache(maxsize=None)
def _trainer(make_config, layout: tuple, sequence_parallel: bool) -> Trainer:
    """One trainer (and so one compiled program) per model and layout, shared by the equivalence and audit tests."""
    config = make_config(**dict(layout))
    config.sharding.sequence_parallel = sequence_parallel
    return Trainer.build(config, num_devices=math.prod(n for _, n in layout))


def dense_trainer(layout: tuple, sequence_parallel: bool) -> Trainer:
    return _trainer(reference_config, layout, sequence_parallel)


@pytest.mark.parametrize("mesh,sequence_parallel", DENSE, ids=_id)
def test_dense_composition_matches_single_device(mesh, sequence_parallel):
    ref_losses, ref_grads = single_device_reference()
    trainer = dense_trainer(tuple(mesh.items()), sequence_parallel)
    grads, losses, _ = grads_and_run(trainer, STEPS)
    if trainer.layer_order is not None:  # a pipeline's in-memory stack is in device-chunk order
        grads = pipeline_lib.to_logical(grads, trainer.layer_order)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert rel_norm(grads, ref_grads) < 1e-5


# Mixtures of experts, held to moe-tiny on one device (test_moe's seed keeps the routing away from ties); a
# pipeline's router losses are per microbatch (averaged over the replicas' rows of it: `expert`, `data` or the
# rows split over `context` beside it), so it is held to one device accumulating over as many slices.
MOE = [({"expert": 2, "fsdp": 2, "data": 2}, False), ({"expert": 2, "data": 2, "tensor": 2}, True),
       ({"context": 2, "data": 2, "tensor": 2}, False), ({"context": 2, "expert": 2, "data": 2}, False),
       ({"pipeline": 2, "expert": 2, "tensor": 2}, True), ({"pipeline": 2, "context": 2, "data": 2}, False)]


@functools.lru_cache(maxsize=None)
def moe_reference(accum: int) -> dict:
    """moe-tiny on one device, over `accum` slices: its initial state, first-step gradients and STEPS losses (with
    accum 1, test_moe's program)."""
    config = moe_config()
    config.train.grad_accum_steps = accum
    trainer = Trainer.build(config, num_devices=1)
    state = jax.device_get(trainer.init_state())
    grads, losses, _ = grads_and_run(trainer, STEPS, state)
    return {"state": state, "grads": grads, "losses": losses}


def moe_trainer(layout: tuple, sequence_parallel: bool) -> Trainer:
    return _trainer(moe_config, layout, sequence_parallel)


@pytest.mark.parametrize("mesh,sequence_parallel", MOE, ids=_id)
def test_moe_composition_matches_single_device(mesh, sequence_parallel):
    trainer = moe_trainer(tuple(mesh.items()), sequence_parallel)
    ref = moe_reference(trainer.plan.pipeline.microbatches if trainer.plan.pipeline else 1)
    state = trainer.from_logical(jax.device_put(ref["state"], trainer.layout.state))  # a pipeline's stack order
    grads, losses, _ = grads_and_run(trainer, STEPS, state)
    if trainer.layer_order is not None:
        grads = pipeline_lib.to_logical(grads, trainer.layer_order)
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-4)
    assert rel_norm(grads, ref["grads"]) < 1e-5


def _audit(trainer: Trainer) -> list[dict]:
    """The audit's rows (the scalars' row aside), each checked at 1.00 within 5%. It reads the step that returns
    its gradients too, which the equivalence test of the layout has just compiled (a persistent-cache hit, where
    the production step would be a second compile); the production step pins the gradients to the parameters'
    layout as this one does, so their collectives are the same."""
    step = step_with_grads(trainer)
    compiled = step.lower(trainer.layout.abstract_state, trainer.abstract_batch()).compile()
    result = audit_lib.audit(trainer, report.build(trainer.plan, trainer.mesh, compiled), "", topology="dgx-h100",
                             hosts=16, mfu=0.4)
    rows = [r for r in result["rows"] if r["purpose"] != "scalars (loss, norms)"]
    for row in rows:
        assert abs(row["ratio"] - 1) <= 0.05, row
    return rows


def test_audit_of_experts_over_fsdp():
    """The experts split over `expert` and stored split over `fsdp` are gathered once per step (the all-to-all
    region keeps the gathered copy for its backward)."""
    rows = _audit(moe_trainer(tuple(MOE[0][0].items()), False))
    assert sorted((r["purpose"], tuple(r["axes"])) for r in rows) == [
        ("expert dispatch and combine", ("expert",)), ("gradient all-reduce", ("data",)),
        ("gradient all-reduce", ("data", "expert")), ("gradient reduce-scatter", ("fsdp",)),
        ("weight all-gather (forward + backward)", ("fsdp",))]


def test_audit_of_sequence_and_context_parallelism_in_a_pipeline():
    """Stage messages split over `tensor` like the residual stream and over `context`; each backward cell's
    recomputed forward scatters and gathers as the forward does; K and V all-gathered over `context` in every cell
    that runs a chunk's forward, on each device's heads (their gradients reduce-scattered in the backward ones);
    the gradients summed over `context` once per step."""
    rows = _audit(dense_trainer(tuple(DENSE[1][0].items()), True))
    assert sorted((r["purpose"], tuple(r["axes"])) for r in rows) == [
        ("activation all-gather (sequence parallel)", ("tensor",)),
        ("activation reduce-scatter (sequence parallel)", ("tensor",)), ("context K/V all-gather", ("context",)),
        ("context K/V gradient reduce-scatter", ("context",)),
        ("embedding/head gradient all-reduce (on every stage)", ("pipeline", "context")),
        ("gradient all-reduce", ("context",)), ("stage activations and gradients", ("pipeline",))]


def test_audit_of_fsdp_beside_context_and_sequence_parallelism():
    """Each block weight and the head pinned whole over `fsdp` as their matmuls take them, and kept for the
    backward under remat none (sharding.specs.pins_weights); over `context` only the ring and the gradients'
    sum, no activation gathered."""
    rows = _audit(dense_trainer(tuple(DENSE[0][0].items()), True))
    assert sorted((r["purpose"], tuple(r["axes"])) for r in rows) == [
        ("activation all-gather (sequence parallel)", ("tensor",)),
        ("activation reduce-scatter (sequence parallel)", ("tensor",)), ("gradient all-reduce", ("context",)),
        ("gradient reduce-scatter", ("fsdp",)), ("ring attention K/V blocks", ("context",)),
        ("weight all-gather (forward, kept for the backward)", ("fsdp",))]


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> dict:
    """Packed documents (an EOS about every 9 tokens) on one device: the DATADIR, STEPS losses, first gradients."""
    path = documents_datadir(tmp_path_factory.mktemp("documents") / "data")
    grads, losses, _ = grads_and_run(Trainer.build(documents_config(path), num_devices=1), STEPS)
    return {"path": path, "grads": grads, "losses": losses}


@pytest.mark.parametrize("mesh", [{"context": 4, "data": 2}, {"pipeline": 2, "context": 2, "data": 2}], ids=_id)
def test_packed_documents_in_ring_attention_match_single_device(mesh, documents):
    """Every hop of a 4-device ring masks the other documents' keys (a block may hold none of a query's); inside
    a pipeline each cell finds the documents along the whole rows and weighs its slice's loss by its counted
    targets."""
    trainer = Trainer.build(documents_config(documents["path"], **mesh), num_devices=math.prod(mesh.values()))
    grads, losses, _ = grads_and_run(trainer, STEPS)
    if trainer.layer_order is not None:
        grads = pipeline_lib.to_logical(grads, trainer.layer_order)
    np.testing.assert_allclose(losses, documents["losses"], rtol=1e-4)
    assert rel_norm(grads, documents["grads"]) < 1e-5


def test_audit_of_experts_under_sequence_parallelism():
    """The mixture takes whole rows in and gives whole rows back: its MLP reductions scatter its buffers and its
    input is not gathered again for the weight gradients."""
    rows = _audit(moe_trainer(tuple(MOE[1][0].items()), True))
    assert sorted(r["purpose"] for r in rows) == [
        "activation all-gather (sequence parallel)", "activation reduce-scatter (sequence parallel)",
        "expert dispatch and combine", "gradient all-reduce", "gradient all-reduce"]


def test_audit_of_experts_under_context_parallelism():
    """The mixture's rows split over `context` in place of their sequence (all-to-alls), its weights' gradients
    summed over data x context at once; the ring and Megatron as without experts."""
    rows = _audit(moe_trainer(tuple(MOE[2][0].items()), False))
    assert sorted((r["purpose"], tuple(r["axes"])) for r in rows) == [
        ("activation all-reduce (Megatron)", ("tensor",)), ("gradient all-reduce", ("context",)),
        ("gradient all-reduce", ("data",)), ("gradient all-reduce", ("data", "context")),
        ("mixture rows over context", ("context",)), ("ring attention K/V blocks", ("context",))]


def test_audit_of_experts_under_context_and_expert_parallelism():
    """Rows split over the batch axes and `context` go to the experts' devices over `expert`; the mixture half's
    norm and router, read on those rows, have their gradients summed over all three at once."""
    rows = _audit(moe_trainer(tuple(MOE[3][0].items()), False))
    assert sorted((r["purpose"], tuple(r["axes"])) for r in rows) == [
        ("expert dispatch and combine", ("expert",)), ("gradient all-reduce", ("context",)),
        ("gradient all-reduce", ("data", "context")), ("gradient all-reduce", ("data", "expert")),
        ("gradient all-reduce", ("data", "expert", "context")), ("mixture rows over context", ("context",)),
        ("ring attention K/V blocks", ("context",))]


def test_audit_of_experts_in_a_pipeline():
    """Each stage's experts split over `expert` (their all-to-alls in the forward cell, the backward cell's
    recomputed forward and its backward) and their MLPs over `tensor` (under sequence parallelism, the mixture's
    rows gathered whole and its buffers' reductions scattered in the same cells, no permute inside a cell), on the
    stage holding the layer; `expert` splits the rows, so the gradients are summed over it, and the router
    statistics of each microbatch averaged over it (a few scalars, within the gradient row's 5%)."""
    rows = _audit(moe_trainer(tuple(MOE[4][0].items()), MOE[4][1]))
    assert sorted((r["purpose"], tuple(r["axes"])) for r in rows) == [
        ("activation all-gather (sequence parallel)", ("tensor",)),
        ("activation reduce-scatter (sequence parallel)", ("tensor",)),
        ("embedding/head gradient all-reduce (on every stage)", ("pipeline", "expert")),
        ("expert dispatch and combine", ("expert",)), ("gradient all-reduce", ("expert",)),
        ("stage activations and gradients", ("pipeline",))]


def test_audit_of_a_mixture_with_context_in_a_pipeline():
    """Each cell's mixture takes its rows over `context` and gives them back (all-to-alls in every cell pass but
    the dead last one of a recompute), beside the cells' K/V all-gathers; every gradient summed over the batch
    axes and `context` at once."""
    rows = _audit(moe_trainer(tuple(MOE[5][0].items()), False))
    assert sorted((r["purpose"], tuple(r["axes"])) for r in rows) == [
        ("context K/V all-gather", ("context",)), ("context K/V gradient reduce-scatter", ("context",)),
        ("embedding/head gradient all-reduce (on every stage)", ("data", "pipeline", "context")),
        ("gradient all-reduce", ("data", "context")), ("mixture rows over context", ("context",)),
        ("stage activations and gradients", ("pipeline",))]


# The newer mixtures held to one device as moe-tiny is: Qwen3-MoE (per-head q/k norms, head_dim apart from
# d_model/n_heads, the chosen probabilities unrenormalized) with its experts over `expert` and its heads and MLPs
# over `tensor`; Mixtral (a mixture in every layer) in a 2-stage pipeline with `tensor` inside each stage. (Mixtral
# on pipeline x data or pipeline x expert trains here too, but its step loaded from XLA's persistent cache on CPU
# deadlocks in its collectives: docs/testing.md.)
FAMILY_LAYOUTS = [("qwen3-moe-tiny", {"expert": 2, "tensor": 2}), ("mixtral-tiny", {"pipeline": 2, "tensor": 2})]


def family_config(preset: str):
    """A maker of `preset`'s tiny config at half width, sequences of 32, on test_moe's seed."""
    def make(**mesh):
        config = moe_config(**mesh)
        config.model.update(preset=preset, d_model=64, n_heads=4, n_kv_heads=2, seq_len=32)
        return config
    return make


_FAMILY_MAKERS = {preset: family_config(preset) for preset, _ in FAMILY_LAYOUTS}  # one _trainer cache key each


@functools.lru_cache(maxsize=None)
def family_reference(preset: str, accum: int) -> dict:
    """`preset` on one device over `accum` slices: its initial state, first-step gradients and STEPS losses."""
    config = _FAMILY_MAKERS[preset]()
    config.train.grad_accum_steps = accum
    trainer = Trainer.build(config, num_devices=1)
    state = jax.device_get(trainer.init_state())
    grads, losses, _ = grads_and_run(trainer, STEPS, state)
    return {"state": state, "grads": grads, "losses": losses}


@pytest.mark.parametrize("preset,mesh", FAMILY_LAYOUTS, ids=lambda v: _id(v) if isinstance(v, dict) else v)
def test_newer_mixture_layout_matches_single_device(preset, mesh):
    trainer = _trainer(_FAMILY_MAKERS[preset], tuple(mesh.items()), False)
    ref = family_reference(preset, trainer.plan.pipeline.microbatches if trainer.plan.pipeline else 1)
    state = trainer.from_logical(jax.device_put(ref["state"], trainer.layout.state))
    grads, losses, _ = grads_and_run(trainer, STEPS, state)
    if trainer.layer_order is not None:
        grads = pipeline_lib.to_logical(grads, trainer.layer_order)
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-4)
    assert rel_norm(grads, ref["grads"]) < 1e-5
