"""The one peak-FLOP/s table: JAX's device_kind strings find their datasheet entry; MFU, the audit and
experiments/bench_train.py look the peak up for the dtype of the resolved model (hardware.compute_dtype)."""
import pytest

from experiments.tiny import get_config
from mesh import chips
from train.plan import audit
from train.runtime import hardware

# device_kind strings as JAX reports them, and the datasheet dense peak (TFLOP/s) per dtype.
KINDS = {
    "NVIDIA A100-SXM4-80GB": (312.0, 312.0, 19.5),
    "NVIDIA A100-PCIE-40GB": (312.0, 312.0, 19.5),
    "NVIDIA H100 80GB HBM3": (989.0, 989.0, 67.0),
    "NVIDIA H100 PCIe": (756.0, 756.0, 51.0),
    "NVIDIA H200": (989.0, 989.0, 67.0),
    "TPU v4": (275.0, 275.0, 275.0),
    "TPU v5 lite": (197.0, 197.0, 197.0),
    "TPU v5e": (197.0, 197.0, 197.0),
    "TPU v5": (459.0, 459.0, 459.0),
    "TPU v5p": (459.0, 459.0, 459.0),
    "TPU v6 lite": (918.0, 918.0, 918.0),
    "TPU v6e": (918.0, 918.0, 918.0),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_device_kind_finds_its_datasheet_peak(kind):
    for dtype, tflops in zip(("bfloat16", "float16", "float32"), KINDS[kind]):
        assert chips.peak_flops(kind, dtype) == tflops * 1e12


def test_unknown_devices_have_no_peak():
    assert chips.peak_flops("cpu", "float32") is None
    assert chips.peak_flops("TPU v4 lite", "bfloat16") is None  # the v4i inference chip is not a v4


def test_audit_presets_use_the_table():
    assert chips.peak_flops(audit.PRESET_DEVICE_KIND["dgx-h100"], "bfloat16") == 989e12
    assert chips.peak_flops(audit.PRESET_DEVICE_KIND["tpu-v5e"], "bfloat16") == 197e12
    assert chips.peak_flops(audit.PRESET_DEVICE_KIND["tpu-v5p"], "bfloat16") == 459e12


def test_benchmarks_take_the_dtype_of_the_resolved_model():
    config = get_config()
    assert hardware.compute_dtype(config) == "float32"
    config.model.preset = "gpt2-125m"  # its preset computes in bfloat16; the raw field stays unset
    assert config.model.compute_dtype is None and hardware.compute_dtype(config) == "bfloat16"
    config.model.compute_dtype = "float32"  # an explicit override wins (float16 is refused: no loss scaling)
    assert hardware.compute_dtype(config) == "float32"


@pytest.mark.parametrize("kind, gbps", [
    ("NVIDIA A100-SXM4-80GB", 2039.0), ("NVIDIA A100-SXM4-40GB", 1555.0), ("NVIDIA A100-PCIE-40GB", 1555.0),
    ("NVIDIA A100 80GB PCIe", 1935.0), ("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H100 PCIe", 2000.0),
    ("NVIDIA H200", 4800.0), ("TPU v5 lite", 819.0), ("TPU v5p", 2765.0), ("TPU v4", 1200.0),
])
def test_device_kind_finds_its_datasheet_memory_bandwidth(kind, gbps):
    assert chips.memory_gbps(kind) == gbps
    assert chips.memory_gbps("cpu") is None
