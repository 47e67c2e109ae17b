"""`python -m train.plan --config=FILE --topology=NAME|FILE --hosts=N`: rank every layout of the config's model
on a cluster by predicted step time, analytically (nothing is compiled); `--calibrate=FILE` measures this
machine (its matmul efficiency, memory bandwidth, and the config's model's step against the roofline) into a user
topology file; `--measure_peak` measures this machine's CPU peak again (the figure MFU and calibrations divide by)."""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import jax
from absl import app, flags
from ml_collections import config_flags

import models
from checkpoint import cadence
from mesh import topology as topology_lib
from mesh.errors import check_writable
from train import cli, exit_codes
from train.plan import calibrate, report, search
from train.runtime import cpu_peak

_CONFIG = cli.config_file("config", "experiments/default.py", "Experiment config file.")
_TOPOLOGY = flags.DEFINE_string("topology", "dgx-h100", "Cluster: a preset name or a topology JSON file.")
_HOSTS = flags.DEFINE_integer("hosts", 1, "Hosts of --topology.")
_DPH = flags.DEFINE_integer("devices_per_host", 0, "Devices per host (0: the topology's).")
_TOP = flags.DEFINE_integer("top", 10, "Rows of the ranked table.")
_JSON = flags.DEFINE_string("json", "", "Write the ranked candidates to this JSON file.")
_CALIBRATE = flags.DEFINE_string("calibrate", "",
                                  "Measure this machine (matmul efficiency, memory bandwidth, a step of the "
                                  "--config model) and write --topology plus them to FILE.")
_MEASURE_PEAK = flags.DEFINE_boolean("measure_peak", False, "Measure this machine's CPU peak again (cached for MFU "
                                     "and --calibrate), print it and exit.")
_MTBF = flags.DEFINE_float("mtbf_hours", 0.0, "Mean time between failures of one device or host (0: no cadence).")
_SCOPE = flags.DEFINE_enum("mtbf_scope", "device", ["device", "host"], "What --mtbf_hours describes.")
_RESTART = flags.DEFINE_float("restart_s", 300.0,
                               "Seconds from a failure to training again (restart, restore, compile).")
_SAVE = flags.DEFINE_float("save_s", 0.0, "Measured seconds a save blocks the loop (0: predict from the state size).")
_DONATED = flags.DEFINE_boolean("donated", True, "The step donates its state (accelerators do; CPU does not).")
# The loop waits while the state is copied device -> host: 1.5 GB/s was measured for an Orbax async save of a
# device-resident state on one H200 by this project (shared/CONVENTIONS.md, 2026-11-30).
HOST_COPY_GBPS = 1.5


def _check_numbers() -> None:
    """The table's length and the cadence's inputs, each a one-line error before the search."""
    if _TOP.value < 1:
        raise search.PlanError(f"--top={_TOP.value}: must be >= 1 (rows of the ranked table)")
    for flag, why in ((_MTBF, "0: no cadence"), (_RESTART, "seconds"), (_SAVE, "0: predict from the state size")):
        if not (math.isfinite(flag.value) and flag.value >= 0):
            raise search.PlanError(f"--{flag.name}={flag.value}: must be a number >= 0 ({why})")


def _plan(config) -> int:
    if _HOSTS.value < 1:
        raise search.PlanError(f"--hosts={_HOSTS.value}: must be >= 1")
    _check_numbers()
    if _JSON.value:
        check_writable("--json", _JSON.value)  # before the search, not after it
    topo = topology_lib.get_topology(_TOPOLOGY.value, hosts=_HOSTS.value)
    if _DPH.value:
        topo = dataclasses.replace(topo, devices_per_host=_DPH.value)
    if not topo.device_memory_gb:
        raise search.PlanError(f"--topology={_TOPOLOGY.value}: no device_memory_gb; add it to the topology file")
    cfg = models.from_dict(config.model.to_dict())
    batch = int(config.train.global_batch_size)
    fixed = search.parse_fixed(config.plan.fixed, topo.num_devices)
    ranked, skipped = search.explore(cfg, batch, topo, fixed, donated=_DONATED.value)
    search.check_fits(ranked, topo)
    fitting = [p for p in ranked if p.fits]
    print(f"{models.param_count(cfg) / 1e9:,.2f}B parameters, global batch {batch} x {cfg.seq_len} tokens, on "
          f"{topo.num_devices} devices of {topo.name} ({topo.hosts} hosts); {len(ranked)} candidates, "
          f"{len(fitting)} fit" + (f"; meshes {search.skipped_text(skipped)}" if skipped else ""))
    dtype = cfg.compute_dtype
    print(f"  peak {dtype}: {topo.peak_tflops.get(dtype, 0.0):.4g} TFLOP/s per device, from "
          f"{calibrate.peak_source(_TOPOLOGY.value, dtype)}")
    print(report.table(ranked, _TOP.value))
    print(report.breakdown(fitting[0], fitting[1] if len(fitting) > 1 else None))
    if report.kv_cache(cfg):
        print(report.kv_cache(cfg))
    if topo.step_overhead != 1.0:
        print(f"  (matmuls and memory-bound work include the calibrated step_overhead x{topo.step_overhead:g})")
    flag = flags.FLAGS[_CONFIG.name]
    print(report.run_line(config_flags.get_config_filename(flag), config_flags.get_override_values(flag), fitting[0],
                          bool(config.plan.auto)))
    if _MTBF.value:
        _cadence(config, fitting[0], topo)
    if _JSON.value:
        path = pathlib.Path(_JSON.value)
        try:
            path.write_text(json.dumps({"candidates": [p.as_json() for p in fitting[:max(_TOP.value, 1)]],
                                        "skipped": dict(skipped.most_common())}, indent=2) + "\n")
        except OSError as e:
            raise search.PlanError(f"--json={path}: cannot write there ({e.strerror}); "
                                   "choose a writable file") from None
        print(f"wrote {path}")
    return exit_codes.OK


def _cadence(config, best, topo) -> None:
    m = best.memory
    state = m["params"] + m["optimizer_state"]
    save_s = _SAVE.value or state / (HOST_COPY_GBPS * 1e9)
    mtbf = cadence.system_mtbf_s(_MTBF.value, _SCOPE.value, topo.num_devices, topo.devices_per_host)
    tau = cadence.optimal_interval_s(save_s, mtbf)
    configured = 60.0 * config.checkpoint.every_minutes or config.checkpoint.every_steps * best.step_time_s
    commit = state * topo.devices_per_host / (topo.storage_gbps * 1e9) if topo.storage_gbps else float("nan")
    print(f"checkpoints: job MTBF {mtbf / 3600:,.2f} h, save blocks {save_s:.3g} s "
          f"({'measured' if _SAVE.value else f'{state / 1e9:,.2f} GB per device at {HOST_COPY_GBPS} GB/s host copy'}), "
          f"commit ~{commit:.3g} s at {topo.storage_gbps:g} GB/s per host, restart {_RESTART.value:g} s")
    print(f"  best interval (Young/Daly) {tau / 60:,.1f} min ({tau / best.step_time_s:,.0f} steps): goodput "
          f"{100 * cadence.expected_goodput(tau, save_s, mtbf, _RESTART.value):.2f}%")
    if configured:
        print(f"  configured interval {configured / 60:,.1f} min: goodput "
              f"{100 * cadence.expected_goodput(configured, save_s, mtbf, _RESTART.value):.2f}%")


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if _MEASURE_PEAK.value:
        if jax.devices()[0].platform != "cpu":
            raise search.PlanError(f"--measure_peak: this machine's devices are {jax.devices()[0].platform}, whose "
                                   "peak is the datasheet's (mesh/chips.py); the flag measures a CPU")
        entry = cpu_peak.record("asked for: python -m train.plan --measure_peak")
        print(f"CPU peak {entry['flops']:.4g} float32 FLOP/s for the machine, {cpu_peak.describe(entry)}")
        return exit_codes.OK
    if _CALIBRATE.value:
        cfg = models.from_dict(_CONFIG.value.model.to_dict())
        path = calibrate.write(_TOPOLOGY.value, _CALIBRATE.value, cfg, int(_CONFIG.value.train.global_batch_size))
        print(f"wrote {path}; its {cfg.compute_dtype} peak is from "
              f"{calibrate.peak_source(str(path), cfg.compute_dtype)}")
        return exit_codes.OK
    return _plan(_CONFIG.value)  # a user's mistake raises a UserError: cli.run prints it and exits 2
