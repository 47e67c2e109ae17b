"""The planner's benchmarks without running them (they are benchmarks, not timed tests): plan_vs_measured's layouts
are at least 12 and cover the kinds the planner prices, each resolves on 8 devices as a run would, its summary
statistics are the median absolute error and Spearman's rank correlation; published_runs' FLOP convention is the
paper's."""
import pytest

import models
from experiments import kernel_profile, published_runs
from experiments import plan_vs_measured as pvm
from train.config import experiment as run_config


def test_layouts_cover_every_kind_and_resolve():
    assert len(pvm.LAYOUTS) >= 12
    axes = {a for _, mesh, _ in pvm.LAYOUTS for a, s in mesh.items() if s > 1}
    assert axes == {"data", "fsdp", "tensor", "pipeline", "context", "expert"}
    assert {"sp", ("1f1b", 4, 1), ("interleaved", 4, 2)} <= {x for _, _, x in pvm.LAYOUTS if x}
    assert {name for name, _, _ in pvm.LAYOUTS} == {"tiny", "default", "llama3-tiny", "moe-tiny"}
    for name, mesh, extras in pvm.LAYOUTS:
        run_config.resolve(pvm._config(name, mesh, extras, "local"), 8, "cpu")


def test_summary_is_median_error_and_spearman():
    rows = [{"predicted_s": p, "measured_s": m, "time_error": p / m - 1, "roofline_time_error": p / m / 2 - 1,
             "memory_error": e} for p, m, e in ((1.0, 2.0, 0.1), (2.0, 2.5, -0.3), (3.0, 2.4, 0.2))]
    s = pvm.summary(rows)
    assert s["median_abs_time_error"] == pytest.approx(0.25)  # |-0.5|, |-0.2|, |+0.25|
    assert s["median_abs_roofline_time_error"] == pytest.approx(0.6)  # |-0.75|, |-0.6|, |-0.375|
    assert s["median_abs_memory_error"] == pytest.approx(0.2)
    assert s["spearman"] == pytest.approx(0.5)  # ranks (1, 2, 3) against (1, 3, 2)


def test_published_runs_flop_convention_recomputes_the_blocks():
    """Megatron's Eq. 3 counts the blocks' forward once more (activation recomputation), not the head's: 4/3 of the
    blocks' 6N + attention per token, plus the head's 6 V d."""
    for _, heads, d, layers, _, _, _, batch, _ in published_runs.RUNS:
        cfg = models.from_dict(dict(vocab_size=published_runs.VOCAB, seq_len=published_runs.SEQ, d_model=d,
                                    n_layers=layers, n_heads=heads))
        head = 6.0 * published_runs.VOCAB * d
        per_token = 4 / 3 * (models.flops_per_token(cfg) - head) + head
        assert published_runs.paper_flops(batch, layers, d) == pytest.approx(per_token * batch * published_runs.SEQ)


def test_kernel_profile_sorts_kernel_names_by_kind():
    """XLA:CPU's thunk names and XLA:GPU's kernel names to their kind; the trace's control and host events are not
    kernels."""
    kinds = {name: kernel_profile.kind(name) for name in (
        "ynn_fusion.20", "dot.3", "cutlass_80_tensorop_gemm", "copy_bitcast_fusion.8", "transpose_copy_fusion",
        "bitcast_dynamic-update-slice_fusion.25", "dynamic-slice_bitcast_fusion", "wrapped_broadcast.12",
        "multiply_tanh_fusion", "loop_add_fusion", "all-reduce.40", "ppermute.25", "psum_invariant.70",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ThunkExecutor::Execute", "Wait: pending_threads=1/8",
        "while.83", "$api.py:2479 block_until_ready", "end: copy")}
    assert kinds == {
        "ynn_fusion.20": "matmul", "dot.3": "matmul", "cutlass_80_tensorop_gemm": "matmul",
        "copy_bitcast_fusion.8": "copy/transpose", "transpose_copy_fusion": "copy/transpose",
        "bitcast_dynamic-update-slice_fusion.25": "scan stacks", "dynamic-slice_bitcast_fusion": "scan stacks",
        "wrapped_broadcast.12": "fill", "multiply_tanh_fusion": "other", "loop_add_fusion": "other",
        "all-reduce.40": "collective", "ppermute.25": "collective", "psum_invariant.70": "collective",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "collective", "ThunkExecutor::Execute": None,
        "Wait: pending_threads=1/8": None, "while.83": None, "$api.py:2479 block_until_ready": None,
        "end: copy": None}
