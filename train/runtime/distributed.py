"""Joining a multi-process run (`jax.distributed.initialize`): from flags, from the JAX_* variables,
or from a SLURM step / Open MPI job that launched several tasks. A single process joins nothing, even
inside a SLURM allocation, so it never waits for peers that were never started.

The coordination service's timeouts default to minutes in JAX; here they are short, so when a process
dies the survivors fail within seconds instead of hanging in a collective.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import time

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


def _host_port(address: str, setting: str) -> tuple[str, int]:
    """(host, port) of a HOST:PORT, else a one-line error naming `setting`."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterError(f"{setting}={address!r}: give HOST:PORT (process 0's host and a free port), e.g. "
                           f"10.0.0.1:1234")
    return host.strip("[]"), int(port)


# The client's side of an HTTP/2 connection (RFC 9113 3.4): the preface, then an empty SETTINGS frame. JAX's
# coordinator is a gRPC server, which answers with a SETTINGS frame (type 4) of its own.
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _speaks_grpc(connection: socket.socket, deadline: float) -> bool | None:
    """Whether the server behind `connection` answers as a gRPC server: True, False (it answered something
    else), or None (no answer before `deadline`)."""
    try:
        connection.settimeout(max(deadline - time.monotonic(), 0.1))
        connection.sendall(_HTTP2_HELLO)
        header = connection.recv(9)
    except TimeoutError:
        return None
    except OSError:
        return False
    finally:
        connection.close()
    return len(header) >= 4 and header[3] == 4


def _wait_for_coordinator(cluster: Cluster, timeout_s: int) -> None:
    """Within --init_timeout_s the coordinator's host must resolve (a pod's DNS name may appear late, so it is
    retried), and a process other than 0 must reach process 0's coordinator over TCP and find it answering as
    gRPC: failing any is a line naming the address, where JAX would abort the process (a core dump) once its
    own timeout ran out."""
    setting = "--coordinator_address" if cluster.method == "flags" else "JAX_COORDINATOR_ADDRESS"
    address = cluster.coordinator_address
    host, port = _host_port(address, setting)
    deadline, why = time.monotonic() + timeout_s, None
    while True:
        try:
            socket.getaddrinfo(host, port)
            why = None
            if cluster.process_id == 0:
                return
            _check_answer(socket.create_connection((host, port), timeout=1.0), deadline, setting, address,
                          timeout_s)
            return
        except socket.gaierror as e:
            why = e.strerror or str(e)
        except OSError:
            pass
        if time.monotonic() > deadline:
            if why:
                raise ClusterError(f"{setting}={address!r}: the host {host!r} does not resolve ({why}); give "
                                   f"process 0's host name or address")
            raise ClusterError(f"{setting}={address!r}: process 0's coordinator did not answer within "
                               f"--init_timeout_s={timeout_s}; start process 0 there, or fix the address or port")
        time.sleep(0.5)


def _check_answer(connection: socket.socket, deadline: float, setting: str, address: str, timeout_s: int) -> None:
    answer = _speaks_grpc(connection, deadline)
    if answer is None:
        raise ClusterError(f"{setting}={address!r}: a server there accepts connections but did not answer as JAX's "
                           f"coordinator within --init_timeout_s={timeout_s}; give process 0's address and port")
    if answer is False:
        raise ClusterError(f"{setting}={address!r}: the server there is not JAX's coordinator (it does not speak "
                           f"gRPC); give process 0's address and port")


def initialize(cluster: Cluster | None, *, init_timeout_s: int, heartbeat_timeout_s: int,
               shutdown_timeout_s: int) -> None:
    """Join the cluster (before any JAX backend use). CPU processes talk over gloo."""
    if cluster is None:
        return
    for name, value in (("--init_timeout_s", init_timeout_s), ("--heartbeat_timeout_s", heartbeat_timeout_s),
                        ("--shutdown_timeout_s", shutdown_timeout_s)):
        if value < 1:
            raise ClusterError(f"{name}={value}: must be >= 1 (seconds)")
    if cluster.coordinator_address is not None:
        _wait_for_coordinator(cluster, init_timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=cluster.coordinator_address, num_processes=cluster.num_processes,
        process_id=cluster.process_id,
        cluster_detection_method=cluster.method if cluster.method in ("slurm", "ompi") else "deactivate",
        initialization_timeout=init_timeout_s, heartbeat_timeout_seconds=heartbeat_timeout_s,
        shutdown_timeout_seconds=shutdown_timeout_s)
