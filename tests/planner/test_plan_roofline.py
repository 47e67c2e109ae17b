"""The planner's roofline: memory-bound work priced at the device's memory bandwidth, attention by kernel, the
optimizer update's bytes, devices that share one host, sequence parallelism, a mixture's padded expert slots, and
`--calibrate` measuring the bandwidth beside the matmul curve and a reference step's overhead over its roofline."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

import models
from mesh import make_mesh
from mesh import topology as T
from train.plan import calibrate, memory, memory_bound, reference_step, search, timing
from train.plan.candidate import Candidate, mesh_of

H100 = T.get_topology("dgx-h100", hosts=1)


def test_presets_carry_the_datasheet_memory_bandwidth():
    assert (H100.hbm_gbps, T.get_topology("dgx-a100").hbm_gbps, T.get_topology("dgx-a100-40gb").hbm_gbps) == \
        (3350.0, 2039.0, 1555.0)


def test_optimizer_bytes_are_adams_reads_and_writes():
    """One device holding every float32 parameter: read the parameter, its gradient and two moments, write the
    parameter and the moments = 7 x the parameter bytes; sharding the state over data=2 halves all of it."""
    cfg = models.from_dict({"preset": "tiny"})
    whole = memory_bound.parts(cfg, Candidate(mesh_of({"data": 1})), 16, H100)["optimizer"]
    assert whole == 7 * 4 * models.param_count(cfg)
    split = memory_bound.parts(cfg, Candidate(mesh_of({"data": 2}), shard_opt_state=True), 16, H100)["optimizer"]
    assert split == pytest.approx(whole / 2)


def test_attention_scores_count_only_for_xla_attention():
    """XLA's attention moves the L x L scores and probabilities through memory; cuDNN's fused kernel does not."""
    xla = models.from_dict({"preset": "gpt2-125m", "attention": "xla"})
    c = Candidate(mesh_of({"fsdp": 8}))
    with_scores = memory_bound.parts(xla, c, 64, H100)
    fused = memory_bound.parts(dataclasses.replace(xla, attention="cudnn"), c, 64, H100)
    assert fused["attention_scores"] == 0 and fused["elementwise"] == with_scores["elementwise"]
    per_token = 2 * xla.n_heads * xla.seq_len * 2 * memory_bound.PASSES  # bf16 scores and probabilities
    assert with_scores["attention_scores"] == pytest.approx(per_token * 64 * xla.seq_len / 8 * xla.n_layers)
    assert memory_bound.attention_kernel(models.from_dict({"preset": "gpt2-125m"}), H100) == "cudnn"  # auto


def test_memory_bound_seconds_add_to_the_step_at_the_bandwidth():
    cfg = models.from_dict({"preset": "gpt2-125m"})
    c = Candidate(mesh_of({"data": 1}))
    one = dataclasses.replace(H100, hosts=1, devices_per_host=1)
    with_bw = search.evaluate(cfg, c, 8, one, donated=True)
    without = search.evaluate(cfg, c, 8, dataclasses.replace(one, hbm_gbps=0.0), donated=True)
    moved = sum(memory_bound.parts(cfg, c, 8, one).values())
    assert without.memory_bound_s == 0 and with_bw.memory_bound_s == pytest.approx(moved / 3350e9)
    assert with_bw.step_time_s - without.step_time_s == pytest.approx(with_bw.memory_bound_s)
    assert with_bw.as_json()["breakdown"]["memory_bound_s"] == with_bw.memory_bound_s


def test_calibrate_measures_memory_bandwidth_and_a_reference_step(tmp_path, monkeypatch):
    # what the file holds is checked here, not how steady the figures are
    monkeypatch.setattr(calibrate, "REPEATS", 2)
    monkeypatch.setattr(calibrate, "STEP_REPEATS", 2)
    cfg = models.from_dict({"preset": "tiny", "n_layers": 4, "d_model": 64, "n_heads": 4, "seq_len": 32})
    path = calibrate.write("dgx-h100", str(tmp_path / "calibrated.json"), cfg, 8)
    topo = T.get_topology(str(path))
    assert topo.hbm_gbps > 0 and topo.hbm_gbps != H100.hbm_gbps
    assert [n for n, _ in topo.matmul_efficiency["float32"]] == [128.0, 256.0, 512.0, 1024.0]
    assert all(e > 0 for _, e in topo.matmul_efficiency["float32"])  # a CPU against an H100's peak: tiny, never 0
    assert topo.shared_host  # measured on this machine's virtual CPU devices, all at once
    assert topo.step_overhead > 0 and topo.step_overhead != 1.0  # the reference step, set against its roofline
    reference = json.loads(path.read_text())["provenance"]["step_overhead_reference"]
    assert reference == "2 layers of gpt d_model=64, 1 x 32 tokens per device"


def test_the_reference_step_halves_its_rows_to_fit_and_is_skipped_when_nothing_fits(monkeypatch):
    cfg = models.from_dict({"preset": "tiny"})
    ref = reference_step.reference_model(cfg)
    assert ref.n_layers == 2 and reference_step.reference_model(models.from_dict({"preset": "moe-tiny"})).n_layers == 2
    four_rows = memory.predict(ref, reference_step._candidate(ref), 8 * 4, donated=False)["total"]  # as `fits` counts
    monkeypatch.setattr(reference_step.hardware, "memory_per_device", lambda: int(four_rows / 0.5) + 1)
    assert reference_step.rows_per_device(ref, 8 * 64) == 4  # 64 rows per device, halved until they fit
    monkeypatch.setattr(reference_step.hardware, "memory_per_device", lambda: 1000)
    assert reference_step.rows_per_device(ref, 16) is None
    assert "not measured" in reference_step.describe(cfg, 16)
    assert reference_step.step_overhead(cfg, 16, H100, repeats=1) is None


def test_the_reference_step_trains_each_device_alone():
    """Each device's copy of the replicated state varies over `data` before the gradient: no all-reduce."""
    ref = reference_step.reference_model(models.from_dict({"preset": "tiny", "d_model": 32, "n_heads": 2}))
    mesh = make_mesh({"data": 8})
    params = models.abstract_params(ref)[0]
    state = jax.eval_shape(reference_step.OPTIMIZER.init, params)
    tokens = jax.ShapeDtypeStruct((8, ref.seq_len + 1), jnp.int32)
    text = reference_step.train_step(ref, mesh).lower(params, state, tokens).as_text()
    assert "all_reduce" not in text and "all-reduce" not in text


def test_the_step_overhead_multiplies_the_work_not_the_communication():
    cfg = models.from_dict({"preset": "tiny"})
    c = Candidate(mesh_of({"fsdp": 2, "tensor": 4}))
    base = timing.predict(cfg, c, 16, H100)
    slow = timing.predict(cfg, c, 16, dataclasses.replace(H100, step_overhead=2.5))
    for key in ("compute_s", "memory_bound_s", "bubble_s"):
        assert slow[key] == pytest.approx(2.5 * base[key])
    assert slow["communication_total_s"] == base["communication_total_s"]
    with pytest.raises(T.TopologyError, match="step_overhead"):
        dataclasses.replace(H100, step_overhead=0.0)
    with pytest.raises(T.TopologyError, match=r"matmul_efficiency\['float32'\] has \[128, 0\]"):
        dataclasses.replace(H100, matmul_efficiency={"float32": [[128.0, 0.0], [256.0, 0.1]]})


def test_a_shared_host_charges_no_bubble_and_hides_no_collective():
    """On one accelerator per device the pipeline's idle cells cost time and FSDP's gathers hide behind matmuls;
    on devices that share a host's cores the idle cells' cores serve the busy stages and a collective is a copy by
    the same cores: the step is the work plus every collective."""
    cfg = models.from_dict({"preset": "tiny"})
    shared = dataclasses.replace(H100, shared_host=True)
    for c in (Candidate(mesh_of({"pipeline": 4, "data": 2}), "1f1b", 4), Candidate(mesh_of({"fsdp": 8}))):
        accelerator, host = timing.predict(cfg, c, 16, H100), timing.predict(cfg, c, 16, shared)
        assert host["bubble_s"] == 0 and host["communication_s"] == host["communication_total_s"]
        work = host["compute_s"] + host["memory_bound_s"]
        assert host["step_time_s"] == pytest.approx(work + host["communication_total_s"])
        assert accelerator["bubble_s"] > 0 or accelerator["communication_s"] < accelerator["communication_total_s"]


def test_sequence_parallelism_splits_the_replicated_bytes_and_trades_the_all_reduce():
    """With the residual stream split over `tensor`, every byte a layer keeps is split (the layer's count on one
    device, over t); the Megatron all-reduce becomes a reduce-scatter and an all-gather, as many as it was."""
    cfg = models.from_dict({"preset": "tiny"})
    mesh = mesh_of({"data": 2, "tensor": 4})
    plain, sp = Candidate(mesh), Candidate(mesh, sequence_parallel=True)
    assert memory.per_token_layer_bytes(cfg, "none", 4, True) == pytest.approx(
        memory.per_token_layer_bytes(cfg, "none", 1) / 4)
    assert memory.predict(cfg, sp, 16, True)["activations"] < memory.predict(cfg, plain, 16, True)["activations"]
    elementwise = [memory_bound.parts(cfg, x, 16, H100)["elementwise"] for x in (sp, plain)]
    assert elementwise[0] < elementwise[1]
    ops = {op: axes for _, op, axes, _ in timing.communication(cfg, sp, 16, H100) if axes == ("tensor",)}
    assert set(ops) == {"reduce_scatter", "all_gather"}
    assert "--config.sharding.sequence_parallel=True" in sp.overrides()


def test_experts_run_on_every_slot_of_their_buffers():
    """moe-tiny, expert=8, 16 rows: 2 rows per device, 8 experts x 64 slots each (dropless: capacity = seq_len),
    so the experts' MLPs run on 1,024 slots where the 128 tokens route to 256; both mixture layers keep the
    dispatched and combined buffers (d_model = 128 wide) and the hidden before and after the activation (256)."""
    cfg = models.from_dict({"preset": "moe-tiny"})
    c = Candidate(mesh_of({"expert": 8}))
    per_expert = 2 * cfg.d_model * cfg.d_mlp * 2  # one expert: the GELU MLP's two matrices in each of two layers
    assert timing.expert_padding_flops_per_token(cfg) == pytest.approx(6 * per_expert * (8 * 64 / 64 - 2))
    kept, working = memory.expert_buffer_bytes(cfg, c, 16)
    assert kept == pytest.approx(2 * (1024 * (2 * 128 + 2 * 256) - 128 * 2 * 256) * 4)
    assert working == 2 * 1024 * 128 * 4
    dense = models.from_dict({"preset": "tiny"})
    assert timing.expert_padding_flops_per_token(dense) == 0 and memory.expert_buffer_bytes(dense, c, 16) == (0, 0)


def test_ring_attention_issues_a_permute_per_block_hop_and_pass():
    """tiny on data=2 x context=4: K and V, 3 hops, forward and backward, 8 layers: 96 permutes (the compiled
    step's count)."""
    cfg = models.from_dict({"preset": "tiny"})
    c = Candidate(mesh_of({"data": 2, "context": 4}))
    ring = [e for e in timing.expected_rows(cfg, c, 16) if e.op == "collective_permute"]
    assert [timing._count(e, cfg, c, cfg.n_layers) for e in ring] == [96]
