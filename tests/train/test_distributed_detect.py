"""Which runs join a cluster: flags, JAX variables, a multi-task SLURM step, Open MPI; never a lone process."""
import pytest

from train.runtime.distributed import Cluster, detect

CLEAN = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_STEP_NUM_TASKS",
         "SLURM_JOB_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in CLEAN:
        monkeypatch.delenv(name, raising=False)


def test_single_process_joins_nothing_even_inside_a_slurm_allocation(monkeypatch):
    assert detect() is None
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_NTASKS", "16")  # the allocation, not a step of 16 tasks
    assert detect() is None


def test_flags_env_slurm_and_mpi(monkeypatch):
    c = detect("10.0.0.1:1234", 4, 3)
    assert (c.coordinator_address, c.num_processes, c.process_id, c.method) == ("10.0.0.1:1234", 4, 3, "flags")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:99")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    assert detect() == Cluster("127.0.0.1:99", 2, 1, "env")
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "16")
    assert detect().method == "slurm"
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    assert detect().method == "ompi"


@pytest.mark.parametrize("args", [("", 2, 0), ("127.0.0.1:1", 2, 2), ("127.0.0.1:1", 2, -1)])
def test_incomplete_flags_are_an_error(args):
    with pytest.raises(ValueError, match="--coordinator_address"):
        detect(*args)


def test_env_without_process_id_is_an_error(monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:99")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match="JAX_PROCESS_ID"):
        detect()
