"""Mixture of experts: the layer against a numpy reference, expert-parallel layouts against one device, the
audit and the planner's memory of an expert layout, the router's fields in metrics.jsonl, the sizes of Mixtral,
and the layouts refused."""
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from mesh.errors import UserError
from models import gpt, moe, stack
from tests.helpers import (
    MOE_SEED,
    STEPS,
    compiled_step,
    grads_and_run,
    moe_config,
    rel_norm,
    step_with_grads,
)
from train.config.experiment import resolve
from train.loop import runner as loop
from train.plan import audit as audit_lib
from train.plan import compile_report as report
from train.plan import memory as planner_memory
from train.plan.candidate import Candidate, mesh_of
from train.trainer import Trainer

# Seed 5: the first batch's closest k-th / (k+1)-th router logits are 9e-4 apart at init (seed 0 has a pair
# within 1e-6, close enough for float32 rounding to swap two experts between layouts).
SEED = MOE_SEED
LAYOUTS = [{"expert": 4}, {"expert": 2, "data": 2, "tensor": 2}]


def _layout_id(layout):
    return ",".join(f"{k}={v}" for k, v in layout.items())


@functools.lru_cache(maxsize=None)
def reference():
    """moe-tiny on one device, dropless: the initial state, first-step gradients, STEPS losses, the first step's
    metrics and the routing margin of the first batch."""
    trainer = Trainer.build(moe_config(), num_devices=1)
    state = jax.device_get(trainer.init_state())
    grads, losses, _ = grads_and_run(trainer, STEPS, state)
    _, metrics, _ = step_with_grads(trainer)(state, trainer.batch(0))  # the first step again, compiled once
    cfg, family, tokens = trainer.plan.model, models.family_of(trainer.plan.model), trainer.batch(0)[:, :-1]
    def forward(p):  # the objective, its metrics, and the routing margin (one compiled program)
        x = family.forward.embed(models.top_params(p), tokens, cfg)
        stats = stack.run_stack(p["layers"], x, tokens, cfg, models.contract.no_constraint,
                                gpt.block(cfg, models.contract.no_constraint))[1]
        return *models.loss_and_metrics(p, trainer.batch(0), cfg), stats["topk_margin"]
    objective, forward_metrics, margin = jax.jit(forward)(state["params"])
    return {"state": state, "grads": grads, "losses": losses, "metrics": jax.device_get(metrics),
            "margin": float(margin), "objective": float(objective), "forward": jax.device_get(forward_metrics)}


@functools.lru_cache(maxsize=None)
def layout_trainer(layout: tuple) -> Trainer:
    mesh = dict(layout)
    return Trainer.build(moe_config(**mesh), num_devices=math.prod(mesh.values()))


def test_routing_margin_of_the_reference():
    """Rounding (~1e-6 on these logits) cannot flip a token's top-2 experts of the first batch in any layer."""
    assert reference()["margin"] > 1e-4


@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
def test_expert_layout_matches_single_device(layout):
    ref = reference()
    trainer = layout_trainer(tuple(layout.items()))
    state = jax.device_put(ref["state"], trainer.layout.state)
    grads, losses, _ = grads_and_run(trainer, STEPS, state)
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-4)
    assert rel_norm(grads, ref["grads"]) < 1e-5


def test_expert_layout_audit():
    """expert=2 x data=2 x tensor=2: the all-to-alls, the gradient all-reduces and Megatron's, nothing else."""
    trainer = layout_trainer(tuple(LAYOUTS[1].items()))
    compiled = compiled_step(trainer)  # the equivalence test's program
    result = audit_lib.audit(trainer, report.build(trainer.plan, trainer.mesh, compiled), "", "dgx-h100", 1, 0.4)
    rows = [r for r in result["rows"] if r["purpose"] != "scalars (loss, norms)"]
    assert sorted((r["purpose"], tuple(r["axes"])) for r in rows) == [
        ("activation all-reduce (Megatron)", ("tensor",)), ("expert dispatch and combine", ("expert",)),
        ("gradient all-reduce", ("data",)), ("gradient all-reduce", ("data", "expert"))]
    for row in rows:
        assert abs(row["ratio"] - 1) <= 0.05, row
    cfg = trainer.plan.model  # 2 MoE layers x 4 all-to-alls of [16/4 rows, 8 experts, 64 slots, 128] float32
    assert next(r for r in rows if r["op"] == "all_to_all")["expected_bytes"] == 2 * 4 * 4 * 8 * 64 * 128 * 4
    assert cfg.capacity_factor == 0 and result["projection"]["comm_us_per_axis"]["expert"] > 0
    # The planner's memory, the experts' slot buffers included, against the compiled arguments + outputs + temps
    # (this program returns the gradients, which the production step holds as temporaries: the same bytes)
    memory = report.memory_per_device(compiled)
    c = Candidate(mesh_of(trainer.plan.mesh_sizes), remat=cfg.remat, grad_accum_steps=trainer.plan.grad_accum)
    predicted = planner_memory.predict(cfg, c, trainer.plan.global_batch, donated=False)["total"]
    assert predicted == pytest.approx(memory["argument_bytes"] + memory["output_bytes"] + memory["temp_bytes"],
                                      rel=0.25)


def test_router_fields_in_metrics_jsonl(tmp_path):
    """The loop logs the router's statistics beside `loss`, which stays the language-model loss."""
    config = moe_config(**LAYOUTS[1])
    config.train.update(steps=STEPS, eval_batches=0, log_every=STEPS, loggers="")
    config.checkpoint.enabled = False
    loop.run(config, str(tmp_path / "run"))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if r.get("step") == STEPS)
    assert first["loss"] == pytest.approx(reference()["losses"][-1], rel=1e-4)
    for key in (*moe.METRICS, *(f"moe_load_e{i}" for i in range(8))):
        assert key in first and math.isfinite(first[key]), key
    assert first["moe_dropped_fraction"] == 0.0  # dropless
    assert sum(first[f"moe_load_e{i}"] for i in range(8)) == pytest.approx(1.0, abs=1e-5)


def test_objective_adds_the_weighted_router_losses():
    ref = reference()
    objective, metrics = ref["objective"], ref["forward"]
    expected = (metrics["loss"] + 1e-3 * metrics["moe_z_loss"] + 1e-2 * metrics["moe_load_balance_loss"])
    assert objective == pytest.approx(float(expected), rel=1e-6)
    assert float(metrics["loss"]) == pytest.approx(float(ref["metrics"]["loss"]), rel=1e-6)  # the step's `loss`
    assert objective > float(metrics["loss"])


# ----------------------------------------------------------------------------- one layer against numpy

def _numpy_moe(h, router, w_in, w_out, k, cap):
    """Per row: tokens in order of (choice, position) take their expert's next slot until `cap` are taken."""
    B, L, D = h.shape
    E = router.shape[1]
    logits = h @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    y, kept_count, load = np.zeros_like(h), 0, np.zeros(E)
    for b in range(B):
        top = np.argsort(-logits[b], axis=-1, kind="stable")[:, :k]
        taken = np.zeros(E, int)
        for j in range(k):
            for t in range(L):
                e = top[t, j]
                load[e] += 1
                if taken[e] < cap:
                    taken[e] += 1
                    kept_count += 1
                    u = h[b, t] @ w_in[e]
                    gelu = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3)))
                    y[b, t] += probs[b, t, e] / probs[b, t, top[t]].sum() * (gelu @ w_out[e])
    lse = np.log(np.exp(logits).sum(-1))
    load /= B * L * k
    return y, {"moe_z_loss": np.mean(lse ** 2), "moe_dropped_fraction": 1 - kept_count / (B * L * k),
               "moe_load_balance_loss": E * np.sum(load * probs.mean((0, 1))), "moe_load": load}


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_layer_matches_numpy(capacity_factor):
    cfg = models.GPTConfig(d_model=16, n_heads=2, n_layers=1, mlp_ratio=2, seq_len=8, n_experts=4,
                           experts_per_token=2, capacity_factor=capacity_factor).validate()
    keys = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(keys[0], (3, 8, 16))
    router = jax.random.normal(keys[1], (16, 4)) * 0.5
    w = {"w_in": jax.random.normal(keys[2], (4, 16, 32)) * 0.2, "w_out": jax.random.normal(keys[3], (4, 32, 16)) * 0.2}
    y, stats = jax.jit(lambda *a: moe.moe_mlp(*a, cfg, models.contract.no_constraint,
                                              lambda w, x: models.gpt.expert_mlp(w, x, cfg)))(router, w, h)
    ref_y, ref_stats = _numpy_moe(*(np.asarray(a, np.float64) for a in (h, router, w["w_in"], w["w_out"])),
                                  k=2, cap=moe.capacity(cfg, 8))
    np.testing.assert_allclose(y, ref_y, rtol=1e-4, atol=1e-5)
    for key, value in ref_stats.items():
        np.testing.assert_allclose(stats[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    assert (ref_stats["moe_dropped_fraction"] > 0) == (capacity_factor > 0)  # capacity 4 of 8 drops some


# ----------------------------------------------------------------------------- sizes and refused layouts

def test_sizes_count_every_expert_and_flops_the_active_ones():
    cfg = models.from_dict({"preset": "moe-tiny"})
    shapes, _ = models.abstract_params(cfg)
    assert models.param_count(cfg) == sum(math.prod(a.shape) for a in jax.tree.leaves(shapes))
    mixtral = models.from_dict({"preset": "mixtral-8x7b"})
    active = models.llama.matmul_params(mixtral, active=True) + 32000 * 4096 + 65 * 4096  # + lookup, norms
    assert round(models.param_count(mixtral) / 1e9, 1) == 46.7 and round(active / 1e9, 1) == 12.9  # Jiang et al.
    attention = 12 * 32 * 4096 * 2048
    assert models.flops_per_token(mixtral) == 6 * models.llama.matmul_params(mixtral, active=True) + attention


@pytest.mark.parametrize("settings, message", [
    ({"mesh.pipeline": 2, "mesh.context": 2, "mesh.data": 2, "pipeline.microbatches": 8},
     "device's 1 rows over context; make them a multiple of 2 (train.global_batch_size or pipeline.microbatches)"),
    ({"mesh.pipeline": 2, "mesh.data": 4, "model.moe_every": 4}, "groups are not divisible by mesh.pipeline=2"),
    ({"mesh.context": 2, "mesh.expert": 2, "mesh.data": 2, "train.global_batch_size": 4},
     "device's 1 rows over context; make them a multiple of 2"),
    ({"mesh.context": 4, "mesh.data": 2, "train.global_batch_size": 4}, "make them a multiple of 4"),
    ({"mesh.expert": 8, "model.n_experts": 4}, "model.n_experts=4 is not divisible by mesh axes expert=8"),
    ({"mesh.data": 8, "model.experts_per_token": 9}, "model.experts_per_token=9"),
    ({"mesh.data": 8, "model.moe_every": 3}, "model.moe_every=3"),
    ({"mesh.data": 8, "model.capacity_factor": -1.0}, "model.capacity_factor=-1.0"),
])
def test_unsupported_settings_are_one_line_errors(settings, message):
    config = moe_config()
    config.mesh.data = 1
    for key, value in settings.items():
        section, name = key.split(".")
        config[section][name] = value
    with pytest.raises(UserError) as error:
        resolve(config, 8)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_dense_models_keep_their_layer_stack():
    shapes, _ = models.abstract_params(models.from_dict({"preset": "tiny"}))
    assert sorted(shapes["layers"]) == ["attn_norm", "mlp_norm", "w_in", "w_out", "wo", "wqkv"]
    assert jnp.shape(shapes["layers"]["w_in"]) == (8, 128, 512)
