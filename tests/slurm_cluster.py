"""A one-node SLURM cluster on localhost for the tests: munged, slurmctld and slurmd (Debian's slurm-wlm and munge)
with their key, slurm.conf and cgroup.conf written to a temporary folder and their own ports, so nothing of the
machine's own configuration is read or changed. `start` returns the running cluster or the reason it cannot be."""
from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import socket
import subprocess
import time

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "sinfo", "srun")
# What the one node needs on a machine without systemd or a delegated cgroup tree: processes tracked by their
# parent pids, no task binding, and cgroups probed but never required.
SLURM_CONF = """\
ClusterName=spmdtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long SLURM holds a requeued job before it may start again (default 120 s).
AuthInfo=socket={munge_socket},cred_expire={cred_expire}
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# A requeued job waits for a scheduling pass once eligible: every 2 s here (60 s and 30 s by default).
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=5
MinJobAge=600
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""
CRED_EXPIRE_S = 5
CGROUP_CONF = "CgroupPlugin=autodetect\nIgnoreSystemd=yes\n"


@dataclasses.dataclass
class Cluster:
    """The running daemons and the environment that points SLURM's commands at them (SLURM_CONF)."""
    dir: pathlib.Path
    env: dict[str, str]
    version: str
    daemons: list[subprocess.Popen]

    def run(self, *args: str, timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
        """A SLURM command (sbatch, scontrol, ...) against this cluster, text output captured."""
        return subprocess.run(list(args), env={**self.env, **kwargs.pop("env", {})}, capture_output=True,
                              text=True, timeout=timeout, **kwargs)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, ExitCode, ...); {} once the job is forgotten."""
        out = self.run("scontrol", "show", "job", "--oneliner", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))


def missing() -> str:
    """Why a cluster cannot be started here, or '' when it can."""
    if os.name != "posix" or os.geteuid() != 0:
        return "starting slurmctld, slurmd and munged needs root (CI runs as root)"
    absent = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None
              and not pathlib.Path("/usr/sbin", name).exists()]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} missing): apt-get install slurm-wlm munge"
    return ""


def _binary(name: str) -> str:
    return shutil.which(name) or str(pathlib.Path("/usr/sbin", name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpus() -> int:
    """The CPUs slurmd finds on this machine (`slurmd -C`): a node configured with more is drained."""
    out = subprocess.run([_binary("slurmd"), "-C"], capture_output=True, text=True, timeout=30).stdout
    found = re.search(r"CPUs=(\d+)", out)
    return int(found.group(1)) if found else os.cpu_count() or 1


def write_config(folder: pathlib.Path) -> dict[str, str]:
    """The munge key, slurm.conf and cgroup.conf in `folder`; the environment SLURM's commands need."""
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    host = socket.gethostname().split(".")[0]
    conf = folder / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, ctld_port=_free_port(), slurmd_port=_free_port(), dir=folder,
                                      munge_socket=folder / "munge.sock", cpus=_cpus(), cred_expire=CRED_EXPIRE_S))
    (folder / "cgroup.conf").write_text(CGROUP_CONF)
    # An allocation the tests themselves run in must not leak into the jobs they submit.
    own = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**own, "SLURM_CONF": str(conf)}


def _daemon_commands(folder: pathlib.Path, host: str) -> list[list[str]]:
    munge = [_binary("munged"), "--foreground", "--force", f"--socket={folder / 'munge.sock'}",
             f"--key-file={folder / 'munge.key'}", f"--pid-file={folder / 'munged.pid'}",
             f"--log-file={folder / 'munged.log'}", f"--seed-file={folder / 'munged.seed'}"]
    conf = str(folder / "slurm.conf")
    return [munge, [_binary("slurmctld"), "-D", "-i", "-f", conf], [_binary("slurmd"), "-D", "-f", conf, "-N", host]]


def _wait(condition, what: str, timeout: float, daemons: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        dead = [p.args[0] for p in daemons if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {'exited: ' + ', '.join(dead) if dead else f'not within {timeout:.0f}s'}")
        time.sleep(0.2)


def start(folder: pathlib.Path, timeout: float = 60) -> Cluster:
    """munged, then slurmctld, then slurmd, each waited for; the node is idle when this returns. Raises
    RuntimeError (with the daemons stopped) when one does not come up."""
    env = write_config(folder)
    host = socket.gethostname().split(".")[0]
    daemons: list[subprocess.Popen] = []
    ready = [lambda: (folder / "munge.sock").exists(),
             lambda: subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True,
                                    timeout=10).stdout.count("UP") > 0,
             lambda: _node_state(env, host) == "idle"]
    try:
        for command, condition in zip(_daemon_commands(folder, host), ready):
            log = open(folder / f"{pathlib.Path(command[0]).name}.out", "w")
            # In the test process's group: a `timeout` or Ctrl-C that ends the suite ends the daemons too.
            daemons.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
            _wait(condition, f"{pathlib.Path(command[0]).name} did not come up (logs in {folder})", timeout, daemons)
    except Exception:
        stop(Cluster(folder, env, "", daemons))
        raise
    version = subprocess.run(["sinfo", "--version"], env=env, capture_output=True, text=True, timeout=10).stdout
    return Cluster(folder, env, version.strip(), daemons)


def _node_state(env: dict[str, str], host: str) -> str:
    out = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%T", f"--nodes={host}"], env=env,
                         capture_output=True, text=True, timeout=10).stdout
    return out.strip().rstrip("*")


def stop(cluster: Cluster, timeout: float = 30) -> None:
    """Cancel every job, then stop slurmd, slurmctld and munged (newest first); killed if they linger."""
    if len(cluster.daemons) == len(DAEMONS):
        cluster.run("scancel", "--full", "--signal=KILL", f"--user={os.getuid()}", timeout=10)
        deadline = time.monotonic() + timeout
        while cluster.run("squeue", "--noheader", timeout=10).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.5)
    for daemon in reversed(cluster.daemons):
        daemon.terminate()
        try:
            daemon.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=timeout)
