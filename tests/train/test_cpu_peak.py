"""The one measured CPU peak: the best of several sizes and repeats (a busy moment cannot lower it), measured on a
device the process owns, once per machine even when processes start together, refused when impossible for the
machine's cores or when a run's rate shows it off by an order of magnitude; the planner's calibration uses the same
figure. The matmul probe is replaced by known rates, so the figures the logic must produce are exact."""
import dataclasses
import json
import multiprocessing
import time

import jax
import pytest

from mesh import topology as T
from train.plan import calibrate
from train.runtime import cpu_peak, hardware, probes

RATES = {512: 3e10, 1024: 5e10, 2048: 2e10}  # the largest size ran in a busy moment


@pytest.fixture
def fake_machine(tmp_path, monkeypatch):
    """A cache of its own and a matmul probe that returns RATES; the sizes it was asked for, in order."""
    monkeypatch.setenv("SPMDTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hardware, "_CHECKED", [])
    calls = []

    def measure(n, repeats=5, dtype="float32", every_device=False, device=None):
        calls.append(n)
        return RATES.get(n, 1e10)
    monkeypatch.setattr(probes, "measure_matmul_flops", measure)
    return calls


def _cache_holds(flops):
    """The cache as a run of this machine and jax version wrote it, holding `flops`."""
    cpu_peak.cache_file().parent.mkdir(parents=True, exist_ok=True)
    cpu_peak.cache_file().write_text(json.dumps({cpu_peak._key(): {"flops": flops, "measured": "earlier"}}))


def test_the_peak_is_the_best_size_and_is_cached(fake_machine):
    entry = cpu_peak.record()
    assert entry["flops"] == 5e10 and sorted(fake_machine) == sorted(cpu_peak.SIZES)
    assert entry["why"] == "no figure cached" and entry["measured"] and "matmul" in entry["how"]
    assert cpu_peak.record()["flops"] == 5e10 and len(fake_machine) == 3  # read back, not measured again
    assert cpu_peak.per_device() == 5e10 / jax.local_device_count()


def test_a_corrupted_cache_is_refused_and_measured_again(fake_machine):
    _cache_holds(1e16)  # a figure no machine of these cores reaches
    entry = cpu_peak.record()
    assert entry["flops"] == 5e10 and len(fake_machine) == 3
    assert entry["why"].startswith("the cached 1e+16 FLOP/s is above what") and entry["bound"] == cpu_peak.bound()
    cpu_peak.cache_file().write_text("[1, 2")  # a damaged file
    assert cpu_peak.record()["flops"] == 5e10 and len(fake_machine) == 6


def test_a_run_off_by_an_order_of_magnitude_measures_again(fake_machine, monkeypatch):
    _cache_holds(1e10)  # measured in a busy moment: a run beats it
    assert cpu_peak.check(3e10)["flops"] == 5e10 and len(fake_machine) == 3
    assert "a run reached 3e+10 FLOP/s, above the cached 1e+10" in cpu_peak.record()["why"]
    assert cpu_peak.check(1e9)["flops"] == 5e10 and len(fake_machine) == 4  # a small model: the quick probe agrees
    _cache_holds(cpu_peak.bound())  # possible for the cores, yet far above what this machine does
    assert cpu_peak.check(1e9)["flops"] == 5e10 and len(fake_machine) == 4 + 1 + 3


def test_mfu_divides_by_the_checked_peak_and_a_users_peak_stands(fake_machine):
    devices, local = jax.device_count(), jax.local_device_count()
    peak = hardware.peak_flops_per_device("float32") * devices
    assert peak == pytest.approx(5e10 * devices / local)
    assert hardware.mfu(2.5e10, 1.0, peak, measured=True) == pytest.approx(0.5)
    assert hardware.mfu(2.5e10, 1.0, peak, measured=True) == pytest.approx(0.5) and len(fake_machine) == 3
    assert hardware.mfu(8e10, 1.0, 4e10, measured=False) == pytest.approx(2.0)  # a user's --peak_tflops stands


def _start_together(barrier, results):
    barrier.wait()
    results.put(cpu_peak.record()["flops"])


@pytest.mark.filterwarnings("ignore:os.fork")
def test_processes_starting_together_measure_once(fake_machine, tmp_path, monkeypatch):
    """Three processes ask at once: one measures (slowly) while the others wait, then all read its figure."""
    def slow(n, repeats=5, dtype="float32", every_device=False, device=None):
        with open(tmp_path / "measured", "a") as f:
            f.write(f"{n}\n")
        time.sleep(0.3)
        return RATES[n]
    monkeypatch.setattr(probes, "measure_matmul_flops", slow)
    context = multiprocessing.get_context("fork")  # the children touch no JAX backend: file locks and the fake
    barrier, results = context.Barrier(3), context.Queue()
    children = [context.Process(target=_start_together, args=(barrier, results)) for _ in range(3)]
    for child in children:
        child.start()
    figures = [results.get(timeout=60) for _ in children]
    for child in children:
        child.join(timeout=60)
    assert figures == [5e10] * 3
    assert (tmp_path / "measured").read_text().split() == [str(n) for n in cpu_peak.SIZES]


def test_a_process_measures_on_a_device_it_owns(tmp_path, monkeypatch):
    """In a multi-process run jax.devices()[0] is process 0's: the probe must not touch it."""
    monkeypatch.setenv("SPMDTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_peak, "SIZES", (64,))
    monkeypatch.setattr(cpu_peak, "REPEATS", 1)

    class Foreign:
        platform = "cpu"
    monkeypatch.setattr(jax, "devices", lambda *a: [Foreign(), *jax.local_devices()])
    entry = cpu_peak.record()
    assert entry["flops"] > 0 and entry["device"] == f"cpu:{jax.local_devices()[0].id} of process 0"


def test_calibration_and_mfu_share_the_peak(fake_machine, tmp_path):
    """A topology without a CPU peak gets the measured one, per virtual device; the curve is a fraction of it, and
    the file says where the peak came from."""
    bare = tmp_path / "bare.json"
    T.save_topology(dataclasses.replace(T.get_topology("dgx-h100"), peak_tflops={}), bare)
    topo = calibrate.measure(str(bare), "float32")
    assert topo.peak_tflops["float32"] * 1e12 == pytest.approx(hardware.peak_flops_per_device("float32"))
    curve = dict((int(n), e) for n, e in topo.matmul_efficiency["float32"])
    assert curve[1024] == pytest.approx(1.0) and curve[512] == pytest.approx(0.6)
    assert calibrate.peak_source("dgx-h100", "float32") == "the dgx-h100 preset's datasheet figure (mesh/chips.py)"
    assert calibrate.peak_source(str(bare), "float32", measured=True).startswith(
        "this machine's measured CPU peak, measured ")
