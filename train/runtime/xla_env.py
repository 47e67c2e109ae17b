"""GPU runtime defaults, applied before JAX starts its backend: XLA flags that let the scheduler overlap
collectives with compute and combine small ones, and a memory fraction so the memory check sees most of the
card rather than XLA's default 75% preallocation. Only what the user has not set is set; what was set is
recorded in config.json (`runtime_defaults`). CPU runs get nothing.

Flags, and why each (their effect on one H200 is measured by `python -m experiments.bench_gpu`):
- latency-hiding scheduler: orders async collectives to overlap with independent compute (FSDP gathers,
  data-parallel reductions);
- combine thresholds of 128 MiB for all-reduce / all-gather / reduce-scatter: fewer, larger collectives, each
  nearer the link's bandwidth than its latency;
- while-loop double buffering: lets the scheduler overlap a scanned layer's collectives with the previous
  iteration's compute (the layer stack is a scan).
"""
from __future__ import annotations

import importlib.util
import os

GPU_XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_enable_while_loop_double_buffering=true",
)
MEM_FRACTION = "0.92"  # of the card's memory, leaving room for cuDNN/cuBLAS workspaces outside XLA's pool
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def gpu_expected(env: dict[str, str] | None = None) -> bool:
    """Whether JAX will start on NVIDIA GPUs: a CUDA plugin is installed and JAX_PLATFORMS allows it."""
    env = os.environ if env is None else env
    platforms = env.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms.split(",") for p in ("cuda", "gpu")):
        return False
    for name in CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:
            continue
    return False


def flag_name(flag: str) -> str:
    return flag.split("=", 1)[0]


def gpu_defaults(env: dict[str, str]) -> dict[str, str]:
    """The environment variables to set (name -> new value): the flags the user's XLA_FLAGS lacks, and the
    memory fraction unless XLA_PYTHON_CLIENT_MEM_FRACTION or XLA_PYTHON_CLIENT_PREALLOCATE is set."""
    out = {}
    user_flags = env.get("XLA_FLAGS", "")
    present = {flag_name(f) for f in user_flags.split()}
    missing = [f for f in GPU_XLA_FLAGS if flag_name(f) not in present]
    if missing:
        out["XLA_FLAGS"] = " ".join([user_flags, *missing]).strip()
    if not any(k in env for k in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE")):
        out["XLA_PYTHON_CLIENT_MEM_FRACTION"] = MEM_FRACTION
    return out


APPLIED: dict[str, str] = {}  # what apply() set in this process, for config.json


def apply() -> dict[str, str]:
    """Set the GPU defaults in os.environ when a GPU run is expected; call before JAX's backend starts."""
    if not gpu_expected():
        return {}
    changes = gpu_defaults(dict(os.environ))
    os.environ.update(changes)
    APPLIED.update(changes)
    return changes
