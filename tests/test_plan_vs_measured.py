"""experiments.plan_vs_measured without running it (a benchmark, not a timed test): its layouts are at least 12 and
cover the kinds the planner prices, each resolves on 8 devices as a run would, and its summary statistics are the
median absolute error and Spearman's rank correlation."""
import pytest

from experiments import plan_vs_measured as pvm
from train import config as run_config


def test_layouts_cover_every_kind_and_resolve():
    assert len(pvm.LAYOUTS) >= 12
    axes = {a for _, mesh, _ in pvm.LAYOUTS for a, s in mesh.items() if s > 1}
    assert axes == {"data", "fsdp", "tensor", "pipeline", "context", "expert"}
    assert {"sp", ("1f1b", 4, 1), ("interleaved", 4, 2)} <= {x for _, _, x in pvm.LAYOUTS if x}
    assert {name for name, _, _ in pvm.LAYOUTS} == {"tiny", "default", "llama3-tiny", "moe-tiny"}
    for name, mesh, extras in pvm.LAYOUTS:
        run_config.resolve(pvm._config(name, mesh, extras, "local"), 8, "cpu")


def test_summary_is_median_error_and_spearman():
    rows = [{"predicted_s": p, "measured_s": m, "time_error": p / m - 1, "memory_error": e}
            for p, m, e in ((1.0, 2.0, 0.1), (2.0, 2.5, -0.3), (3.0, 2.4, 0.2))]
    s = pvm.summary(rows)
    assert s["median_abs_time_error"] == pytest.approx(0.25)  # |-0.5|, |-0.2|, |+0.25|
    assert s["median_abs_memory_error"] == pytest.approx(0.2)
    assert s["spearman"] == pytest.approx(0.5)  # ranks (1, 2, 3) against (1, 3, 2)
