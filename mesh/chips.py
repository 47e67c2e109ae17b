"""Datasheet peak FLOP/s and memory bandwidth of each accelerator, keyed by JAX's `device_kind`: the one table behind
MFU (train/runtime/hardware.py), the memory check's report, the audit's projected compute time
(train/plan/audit.py) and the planner's memory-bound terms (train/plan/timing.py).

Dense peaks (no 2:4 sparsity) in TFLOP/s per chip, as (bf16, fp16, fp32):
- NVIDIA A100 (SXM and PCIe): 312 / 312 / 19.5 (fp32 without TF32); A100 datasheet.
- NVIDIA H100 SXM and H200 SXM (the same compute die): 989 / 989 / 67; H100 and H200 datasheets.
- NVIDIA H100 PCIe: 756 / 756 / 51; H100 datasheet.
- NVIDIA L40S: 362 / 362 / 91.6; B200: 2250 / 2250 / 75 (DGX B200: 72 PFLOP/s dense FP8 per 8 GPUs).
- Google TPU v4 275, v5e 197, v5p 459, v6e 918 (bf16; cloud.google.com/tpu/docs system architecture).
  TPU datasheets list bf16 only: the MXU multiplies in bf16, and JAX's default matmul precision runs fp16
  and fp32 matmuls on it in one bf16 pass, so the bf16 peak is the ceiling for all three.

Memory (HBM or GDDR) bandwidth per chip, GB/s (1e9 bytes/s), from the same datasheets and pages:
- A100 80GB SXM 2,039; A100 80GB PCIe 1,935; A100 40GB 1,555 (A100 datasheet).
- H100 SXM 3,350; H100 PCIe 2,000 (H100 datasheet); H200 SXM 4,800 (H200 datasheet).
- L40S 864 (L40S datasheet); B200 8,000 (DGX B200 datasheet: 64 TB/s for 8 GPUs).
- TPU v4 1,200, v5e 819, v5p 2,765, v6e 1,640 (cloud.google.com/tpu/docs system architecture pages).
"""
from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    bf16_tflops: float
    fp16_tflops: float
    fp32_tflops: float
    hbm_gbps: float = 0.0  # memory bandwidth, GB/s

    def peak_tflops(self, dtype: str) -> float:
        """Dense peak for matmuls in `dtype` ('bfloat16', 'float16', 'float32'; anything else counts as fp32)."""
        return {"bfloat16": self.bf16_tflops, "float16": self.fp16_tflops}.get(dtype, self.fp32_tflops)


def _tpu(name: str, bf16: float, hbm_gbps: float) -> Chip:
    return Chip(name, bf16, bf16, bf16, hbm_gbps)


# (pattern on device_kind, chip): the first match wins, so the more specific patterns come first.
CHIPS: tuple[tuple[str, Chip], ...] = (
    (r"H100.*PCIe", Chip("H100 PCIe", 756.0, 756.0, 51.0, 2000.0)),
    (r"H100", Chip("H100 SXM", 989.0, 989.0, 67.0, 3350.0)),
    (r"H200", Chip("H200 SXM", 989.0, 989.0, 67.0, 4800.0)),
    (r"A100.*40GB", Chip("A100 40GB", 312.0, 312.0, 19.5, 1555.0)),
    (r"A100.*(80GB.*PCIe|PCIe.*80GB)", Chip("A100 80GB PCIe", 312.0, 312.0, 19.5, 1935.0)),
    (r"A100", Chip("A100", 312.0, 312.0, 19.5, 2039.0)),
    (r"L40S", Chip("L40S", 362.0, 362.0, 91.6, 864.0)),
    (r"B200", Chip("B200", 2250.0, 2250.0, 75.0, 8000.0)),
    (r"^TPU v4$", _tpu("TPU v4", 275.0, 1200.0)),
    (r"^TPU v5(e| lite)", _tpu("TPU v5e", 197.0, 819.0)),  # JAX calls v5e "TPU v5 lite"
    (r"^TPU v5p?$", _tpu("TPU v5p", 459.0, 2765.0)),
    (r"^TPU v6(e| lite)", _tpu("TPU v6e", 918.0, 1640.0)),
)


def chip_of(device_kind: str) -> Chip | None:
    """The table's entry for a `jax.Device.device_kind` string, or None for a device it does not know."""
    for pattern, chip in CHIPS:
        if re.search(pattern, device_kind, flags=re.IGNORECASE):
            return chip
    return None


def peak_flops(device_kind: str, dtype: str) -> float | None:
    """Datasheet dense peak FLOP/s of one device of `device_kind` for `dtype` matmuls; None when unknown."""
    chip = chip_of(device_kind)
    return chip.peak_tflops(dtype) * 1e12 if chip else None


def memory_gbps(device_kind: str) -> float | None:
    """Datasheet memory bandwidth (GB/s) of one device of `device_kind`; None when unknown."""
    chip = chip_of(device_kind)
    return chip.hbm_gbps if chip else None
