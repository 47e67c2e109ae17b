"""One point of the search space (a layout and its knobs) and the prediction made for it."""
from __future__ import annotations

import dataclasses
from typing import Any

from mesh.layout import AXES

REMATS = ("none", "save_dots", "full")  # model.remat's policies, from most memory to most recomputation


@dataclasses.dataclass(frozen=True)
class Candidate:
    mesh: tuple[tuple[str, int], ...]   # ((axis, size), ...) in mesh order
    schedule: str = "none"              # pipeline schedule, "none" without a pipeline
    microbatches: int = 1
    virtual_stages: int = 1
    remat: str = "none"
    shard_opt_state: bool = False
    grad_accum_steps: int = 1
    sequence_parallel: bool = False     # Megatron's: the residual stream split over the sequence on `tensor`

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    def overrides(self) -> list[str]:
        """The `--config.*` flags that run this candidate with `python -m train`."""
        out = [f"--config.mesh.{a}={s}" for a, s in self.mesh]
        out += ["--config.sharding.strategy=fsdp_tensor", f"--config.sharding.shard_opt_state={self.shard_opt_state}",
                f"--config.model.remat={self.remat}", f"--config.train.grad_accum_steps={self.grad_accum_steps}"]
        if self.sequence_parallel:
            out.append("--config.sharding.sequence_parallel=True")
        if self.sizes.get("pipeline", 1) > 1:
            out += [f"--config.pipeline.schedule={self.schedule}",
                    f"--config.pipeline.microbatches={self.microbatches}",
                    f"--config.pipeline.virtual_stages={self.virtual_stages}"]
        return out


def mesh_of(sizes: dict[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple((a, int(sizes.get(a, 1))) for a in AXES)


@dataclasses.dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    memory: dict[str, float]            # bytes per device by part, and "total"
    fits: bool
    compute_s: float                    # matmuls (and attention's batched matmuls) at the matmul efficiency,
                                        # times the topology's step_overhead
    memory_bound_s: float               # work bound by the device's memory bandwidth, times step_overhead
    communication_s: float              # exposed (after overlap)
    communication_total_s: float        # every collective, none overlapped
    bubble_s: float
    step_time_s: float
    tflops_per_device: float
    mfu: float
    tokens_per_s: float
    comm_by_purpose: dict[str, float] = dataclasses.field(default_factory=dict)
    memory_bound_by_part: dict[str, float] = dataclasses.field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        c = self.candidate
        return {"mesh": c.sizes, "schedule": c.schedule, "microbatches": c.microbatches,
                "virtual_stages": c.virtual_stages, "remat": c.remat, "shard_opt_state": c.shard_opt_state,
                "grad_accum_steps": c.grad_accum_steps, "sequence_parallel": c.sequence_parallel,
                "memory_bytes_per_device": int(self.memory["total"]),
                "fits": self.fits, "step_time_s": self.step_time_s, "tflops_per_device": self.tflops_per_device,
                "mfu": self.mfu, "tokens_per_s": self.tokens_per_s,
                "breakdown": {"compute_s": self.compute_s, "memory_bound_s": self.memory_bound_s,
                              "memory_bound_by_part_s": self.memory_bound_by_part,
                              "communication_s": self.communication_s,
                              "communication_total_s": self.communication_total_s, "bubble_s": self.bubble_s,
                              **{f"{k}_bytes": int(v) for k, v in self.memory.items() if k != "total"},
                              "communication_by_purpose_s": self.comm_by_purpose},
                "overrides": c.overrides()}
