"""The one measured CPU peak: the best of several sizes and repeats (a busy moment cannot lower it), cached, raised
when a run beats it, so MFU never exceeds 100%; the planner's calibration uses the same figure. The matmul probe
is replaced by known rates, so the figures the logic must produce are exact."""
import dataclasses

import jax
import pytest

from mesh import topology as T
from train.plan import calibrate
from train.runtime import cpu_peak, hardware, probes

RATES = {512: 3e10, 1024: 5e10, 2048: 2e10}  # the largest size ran in a busy moment


@pytest.fixture
def fake_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def measure(n, repeats=5, dtype="float32", every_device=False):
        calls.append(n)
        return RATES.get(n, 1e10)
    monkeypatch.setattr(probes, "measure_matmul_flops", measure)
    return calls


def test_the_peak_is_the_best_size_and_is_cached(fake_machine):
    entry = cpu_peak.record()
    assert entry["flops"] == 5e10 and sorted(fake_machine) == sorted(cpu_peak.SIZES)
    assert cpu_peak.record()["flops"] == 5e10 and len(fake_machine) == 3  # read back, not measured again
    assert cpu_peak.per_device() == 5e10 / jax.local_device_count()


def test_a_run_faster_than_the_peak_raises_it_and_mfu_stays_at_most_one(fake_machine):
    devices = jax.device_count()
    peak = hardware.peak_flops_per_device("float32") * devices
    assert peak == pytest.approx(5e10)
    assert hardware.mfu(2.5e10, 1.0, peak, measured=True) == pytest.approx(0.5)
    assert hardware.mfu(8e10, 1.0, peak, measured=True) == pytest.approx(1.0)  # re-measured, then raised to 8e10
    assert len(fake_machine) == 6 and cpu_peak.record()["flops"] == pytest.approx(8e10)
    assert hardware.mfu(4e10, 1.0, hardware.peak_flops_per_device("float32") * devices, True) == pytest.approx(0.5)
    assert hardware.mfu(8e10, 1.0, 4e10, measured=False) == pytest.approx(2.0)  # a user's --peak_tflops stands


def test_calibration_and_mfu_share_the_peak(fake_machine, tmp_path):
    """A topology without a CPU peak gets the measured one, per virtual device; the curve is a fraction of it."""
    bare = tmp_path / "bare.json"
    T.save_topology(dataclasses.replace(T.get_topology("dgx-h100"), peak_tflops={}), bare)
    topo = calibrate.measure(str(bare), "float32")
    assert topo.peak_tflops["float32"] * 1e12 == pytest.approx(hardware.peak_flops_per_device("float32"))
    curve = dict((int(n), e) for n, e in topo.matmul_efficiency["float32"])
    assert curve[1024] == pytest.approx(1.0) and curve[512] == pytest.approx(0.6)
