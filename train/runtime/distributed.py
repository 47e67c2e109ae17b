"""Joining a multi-process run (`jax.distributed.initialize`): from flags, from the JAX_* variables,
or from a SLURM step / Open MPI job that launched several tasks. A single process joins nothing, even
inside a SLURM allocation, so it never waits for peers that were never started.

The coordination service's timeouts default to minutes in JAX; here they are short, so when a process
dies the survivors fail within seconds instead of hanging in a collective.
"""
from __future__ import annotations

import dataclasses
import os

import jax

from mesh.errors import UserError


class ClusterError(UserError):
    """Multi-process settings (flags or JAX_* variables) that do not describe one cluster; one line."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    coordinator_address: str | None  # None: let JAX detect it (SLURM, Open MPI)
    num_processes: int | None
    process_id: int | None
    method: str                      # flags | env | slurm | ompi


def _int_env(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.strip().isdigit() else None


def detect(coordinator_address: str = "", num_processes: int = 1, process_id: int = 0) -> Cluster | None:
    """Where the run's processes come from; None for a single-process run."""
    if num_processes > 1 or coordinator_address:
        if not coordinator_address or num_processes < 1 or not 0 <= process_id < num_processes:
            raise ClusterError(f"--coordinator_address={coordinator_address!r} --num_processes={num_processes} "
                               f"--process_id={process_id}: give all three, with 0 <= process_id < num_processes")
        return Cluster(coordinator_address, num_processes, process_id, "flags")
    env_n = _int_env("JAX_NUM_PROCESSES")
    if os.environ.get("JAX_COORDINATOR_ADDRESS") and env_n and env_n > 1:
        env_id = _int_env("JAX_PROCESS_ID")
        if env_id is None or env_id >= env_n:
            raise ClusterError(f"JAX_PROCESS_ID={os.environ.get('JAX_PROCESS_ID', '')!r}: with JAX_NUM_PROCESSES="
                               f"{env_n} every process needs its index 0..{env_n - 1}")
        return Cluster(os.environ["JAX_COORDINATOR_ADDRESS"], env_n, env_id, "env")
    # srun sets SLURM_STEP_NUM_TASKS for the step it launches; a batch script or salloc shell does not
    # run inside such a step, so a plain `python -m train` there stays single-process.
    if (_int_env("SLURM_STEP_NUM_TASKS") or 1) > 1:
        return Cluster(None, None, None, "slurm")
    if (_int_env("OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return Cluster(None, None, None, "ompi")
    return None


def initialize(cluster: Cluster | None, *, init_timeout_s: int, heartbeat_timeout_s: int,
               shutdown_timeout_s: int) -> None:
    """Join the cluster (before any JAX backend use). CPU processes talk over gloo."""
    if cluster is None:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=cluster.coordinator_address, num_processes=cluster.num_processes,
        process_id=cluster.process_id,
        cluster_detection_method=cluster.method if cluster.method in ("slurm", "ompi") else "deactivate",
        initialization_timeout=init_timeout_s, heartbeat_timeout_seconds=heartbeat_timeout_s,
        shutdown_timeout_seconds=shutdown_timeout_s)
