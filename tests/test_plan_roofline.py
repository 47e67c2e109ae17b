"""The planner's roofline: memory-bound work priced at the device's memory bandwidth, attention by kernel, the
optimizer update's bytes, and `--calibrate` measuring the bandwidth beside the matmul curve."""
import dataclasses

import pytest

import models
from mesh import topology as T
from train.planner import calibrate, memory_bound, search
from train.planner.candidate import Candidate, mesh_of

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


def test_calibrate_measures_memory_bandwidth(tmp_path):
    path = calibrate.write("dgx-h100", str(tmp_path / "calibrated.json"), "float32")
    topo = T.get_topology(str(path))
    assert topo.hbm_gbps > 0 and topo.hbm_gbps != H100.hbm_gbps
    assert [n for n, _ in topo.matmul_efficiency["float32"]] == [128.0, 256.0, 512.0, 1024.0]
