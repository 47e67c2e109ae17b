"""`python -m train --config=experiments/<file>.py[:variant] --workdir=DIR [--config.train.steps=N ...]`; with
an existing run in DIR and no --config, `python -m train --workdir=DIR [--config.train.steps=N ...]` continues it
with the config it trained with (train/loop/phases.py)."""
from __future__ import annotations

import math
import os
import pathlib
import signal

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from mesh import topology as topology_lib
from mesh import use_cpu_devices
from mesh.errors import check_writable
from train import cli, exit_codes
from train.config import experiment as train_config
from train.loop import phases
from train.loop import runner as loop
from train.runtime import distributed, xla_env

_CONFIG = cli.config_file("config", "experiments/default.py", "Experiment config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: metrics, reports, checkpoints.", required=True)
_NUM_CPU_DEVICES = flags.DEFINE_integer("num_cpu_devices", 8, "Virtual devices when the platform is CPU.")
_COMPILE_ONLY = flags.DEFINE_boolean("compile_only", False, "Compile the step, write compile_report.json, exit.")
_PEAK_TFLOPS = flags.DEFINE_float("peak_tflops", 0.0, "Peak TFLOP/s per device for MFU (0: datasheet or measured).")
_AUDIT = flags.DEFINE_boolean("audit", False, "Audit the step's collectives against the layout's needs.")
_TOPOLOGY = flags.DEFINE_string("topology", "dgx-h100",
                                "With --audit: cluster to project onto (preset or JSON file; '' for none).")
_HOSTS = flags.DEFINE_integer("hosts", 1, "With --audit: hosts of --topology; the data axis grows to fill them.")
_AUDIT_MFU = flags.DEFINE_float("audit_mfu", 0.4, "With --audit: MFU assumed for the projected compute time.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", "", "host:port of process 0, for multi-process runs.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "Processes in the run (with --coordinator_address).")
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "This process's index, 0..num_processes-1.")
_INIT_TIMEOUT = flags.DEFINE_integer("init_timeout_s", 120, "Seconds to wait for every process to join.")
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer("heartbeat_timeout_s", 15,
                                          "A process silent this long is declared dead and the run fails.")
_SHUTDOWN_TIMEOUT = flags.DEFINE_integer("shutdown_timeout_s", 30, "Seconds to wait for peers at exit.")
_CACHE = flags.DEFINE_string("compilation_cache", "~/.cache/spmdtrain/xla",
                             "JAX persistent compilation cache ('' to disable); restarts then skip compilation.")


def _config():
    """(the config, the experiment file it came from): --config's, or without --config the run in --workdir's
    (with this command line's overrides); without --config, a workdir that holds no run is an error."""
    flag = flags.FLAGS[_CONFIG.name]
    if not flag.present:
        workdir = pathlib.Path(_WORKDIR.value).expanduser()
        resumed = phases.resume_config(workdir, config_flags.get_override_values(flag))
        if resumed is None and (workdir / "checkpoints").is_dir():
            raise exit_codes.ConfigError(f"--workdir={workdir}: its config.json is missing, though checkpoints/ "
                                         f"is there; restore the file, or give the --config the run trained with")
        if resumed is None:  # a mistyped path would otherwise start the default experiment there
            raise exit_codes.ConfigError(f"--workdir={workdir}: no run to continue there (no config.json); start "
                                         f"one with --config=EXPERIMENT.py, e.g. --config=experiments/default.py")
        return resumed, ""
    config = _CONFIG.value
    train_config.pin_layout_if_mesh_given(config, config_flags.get_override_values(flag))
    return config, flag.config_filename


def _check_flags() -> None:
    """The command's own flags, each a one-line error before any device work."""
    if not _WORKDIR.value.strip():  # '' would train into the current directory
        raise exit_codes.ConfigError("--workdir='': give the run's directory, e.g. --workdir=runs/mine")
    if not (math.isfinite(_PEAK_TFLOPS.value) and _PEAK_TFLOPS.value >= 0):
        raise exit_codes.ConfigError(f"--peak_tflops={_PEAK_TFLOPS.value}: must be a number >= 0 (0: the "
                                     f"datasheet's or the measured peak)")
    if _AUDIT.value and _HOSTS.value < 1:
        raise exit_codes.ConfigError(f"--hosts={_HOSTS.value}: must be >= 1")
    if _AUDIT.value and not 0 < _AUDIT_MFU.value <= 1:
        raise exit_codes.ConfigError(f"--audit_mfu={_AUDIT_MFU.value}: must be in (0, 1] (the MFU assumed)")
    if _AUDIT.value and _TOPOLOGY.value:  # a TopologyError names --topology before the compile, not after it
        topology_lib.get_topology(_TOPOLOGY.value, hosts=_HOSTS.value)
    if _CACHE.value and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        check_writable("--compilation_cache", _CACHE.value, "directory", parents=True)


def main(argv: list[str], build=None) -> int:
    """The command; `build` (config -> Trainer) is another command's run on the same start-up (train/rl)."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    # A save asked for (SIGUSR1, e.g. SLURM's --signal=USR1@N) before the run has started has nothing to save:
    # ignored until the run's own handler (train/loop/preemption.py) replaces this, rather than killing the process.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    _check_flags()
    logging.set_verbosity(logging.WARNING)  # keep the progress line readable
    # Importing jax starts no backend: the XLA flags, device count and cluster below still take effect.
    xla_env.apply()  # GPU XLA flags and memory fraction the user has not set; recorded in config.json
    use_cpu_devices(_NUM_CPU_DEVICES.value)
    cluster = distributed.detect(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    distributed.initialize(cluster, init_timeout_s=_INIT_TIMEOUT.value, heartbeat_timeout_s=_HEARTBEAT_TIMEOUT.value,
                           shutdown_timeout_s=_SHUTDOWN_TIMEOUT.value)
    if _CACHE.value and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(_CACHE.value))
    audit = dict(topology=_TOPOLOGY.value, hosts=_HOSTS.value, mfu=_AUDIT_MFU.value) if _AUDIT.value else None
    config, config_file = _config()
    if build is None and config.get("rl", {}).get("prompts"):
        raise exit_codes.ConfigError(f"rl.prompts={config.rl.prompts!r}: this is a reinforcement-learning run; "
                                     f"start it with python -m train.rl")
    # user errors and expected failures end with their documented status in cli.run
    loop.run(config, _WORKDIR.value, compile_only=_COMPILE_ONLY.value, peak_tflops=_PEAK_TFLOPS.value,
             audit=audit, config_file=config_file, logs=True, **({"build": build} if build else {}))
    return exit_codes.OK


if __name__ == "__main__":
    cli.run(main)
