"""Where a compiled step's time goes, by kind of kernel: a few steps under `jax.profiler`, each kernel's time from
the trace summed by kind (matmuls, copies and transposes, the layer scan's stacking, fills, collectives, other
fusions). `python -m experiments.bench_train --profile` prints it per layout.

Shares, not seconds: virtual CPU devices are threads sharing the machine's cores, so a kernel's traced duration
includes the time its thread waited for a core; the shares of the summed time still say which kinds dominate. The
compute kernels' shares leave the collectives out: on CPU a collective's duration is mostly its thread waiting
for the others at the rendezvous, reported apart as a share of all traced kernel time.
Kinds are read from kernel names (XLA:CPU's thunks, XLA:GPU's kernels), a heuristic: `other` is mostly elementwise
and reduction fusions (norms, activations, softmax, the optimizer's update).
"""
from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import jax

KINDS = ("matmul", "copy/transpose", "scan stacks", "fill", "other")  # the compute kernels
_MATMUL = ("ynn", "dot", "gemm", "cublas", "cutlass", "nvjet", "matmul", "convolution", "xnn")
# XLA's collectives, and those a shard_map names after its JAX op (ppermute, psum, ...)
_COLLECTIVE = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all", "nccl", "ppermute",
               "psum", "pmean", "pmax", "all_gather", "all_to_all", "reduce_scatter")
# Host-side and control events of the trace, not kernels: the executor, loops and branches, waits, Python frames.
_NOT_KERNELS = ("ThunkExecutor", "Wait", "Rendezvous", "InvokeRendezvous", "while", "conditional", "call", "$",
                "Pjit", "Execute", "Common", "Launch", "Slinky", "ParseArguments", "end:")


def kind(name: str) -> str | None:
    """The kind of a trace event by its name, None for an event that is not a kernel."""
    lower = name.lower()
    if lower.startswith(_COLLECTIVE) or "nccl" in lower:
        return "collective"
    if name.startswith(_NOT_KERNELS):
        return None
    if any(m in lower for m in _MATMUL):
        return "matmul"
    if "dynamic-update-slice" in lower or "dynamic-slice" in lower or "dynamic_update_slice" in lower:
        return "scan stacks"
    if "copy" in lower or "transpose" in lower:
        return "copy/transpose"
    if "broadcast" in lower:
        return "fill"
    return "other"


def _events(trace_dir: str):
    """Kernel events of the newest trace: the device planes' (a GPU's) when there are any, else the host's."""
    data = jax.profiler.ProfileData.from_file(str(sorted(Path(trace_dir).rglob("*.xplane.pb"))[-1]))
    planes = list(data.planes)
    devices = [p for p in planes if p.name.startswith("/device:")]
    for plane in devices or [p for p in planes if p.name.startswith("/host:")]:
        for line in plane.lines:
            yield from line.events


def profile(step: Callable, state: Any, batch: Any, steps: int = 3) -> dict[str, Any]:
    """{"share": {kind: fraction of the compute kernels' summed time}, "collective": the collectives' fraction of
    all kernel time, "kernels_per_step": n (every device's)} over `steps` calls of the (already compiled and
    warmed) `step` on one batch."""
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(steps):
            state, _ = jax.block_until_ready(step(state, batch))
        jax.profiler.stop_trace()
        seconds, count = Counter(), 0
        for event in _events(trace_dir):
            k = kind(event.name)
            if k is not None:
                seconds[k] += event.duration_ns
                count += 1
    compute = sum(seconds[k] for k in KINDS) or 1
    return {"share": {k: seconds[k] / compute for k in KINDS},
            "collective": seconds["collective"] / (compute + seconds["collective"]), "kernels_per_step": count / steps}
