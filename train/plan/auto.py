"""`plan.auto=True`: before the run is resolved, replace the mesh sizes and the layout knobs with the planner's
best fitting candidate for the devices at hand (links from plan.topology, default the fitted `local` file;
memory and peak from the devices themselves, train/runtime/hardware.py), keeping plan.fixed."""
from __future__ import annotations

import dataclasses

import jax
import ml_collections

import models
from mesh import chips
from mesh import topology as topology_lib
from train.config import experiment as config_lib
from train.plan import memory as plan_memory
from train.plan import report, search
from train.plan.candidate import Prediction
from train.runtime import cpu_peak, hardware


def devices_topology(topology: str, num_devices: int, dtype: str) -> topology_lib.Topology:
    """`topology` (plan.topology; '': the fitted `local` file) sized to the devices at hand, with their memory and
    peak."""
    try:
        topo = topology_lib.get_topology(topology or "local")
    except ValueError as e:
        raise search.PlanError(f"plan.topology: {e}") from None
    hosts = jax.process_count()
    memory = hardware.memory_per_device() or topo.device_memory_gb * 1e9
    peak = dict(topo.peak_tflops)
    if hardware.peak_is_measured():  # a CPU: the one measured peak MFU divides by, not a calibration's copy of it
        peak[dtype] = hardware.peak_flops_per_device(dtype) / 1e12
    peak.setdefault(dtype, hardware.peak_flops_per_device(dtype) / 1e12)
    intra = topo.intra if not topo.intra.dims else dataclasses.replace(topo.intra, dims=())
    hbm = topo.hbm_gbps or chips.memory_gbps(jax.devices()[0].device_kind) or 0.0  # a CPU's: from --calibrate
    return dataclasses.replace(topo, hosts=hosts, devices_per_host=num_devices // hosts, intra=intra,
                               device_memory_gb=memory / 1e9, peak_tflops=peak, hbm_gbps=hbm)


def own_step_s(plan: config_lib.Plan, num_devices: int) -> float | None:
    """The step time the planner predicts for the layout a run trains (whoever chose it), on the topology plan.auto
    plans with: shown beside the measured step. None on accelerators without a plan.topology (the `local` file
    describes the CPU it was fitted on)."""
    topology = plan.planner.topology if plan.planner else ""
    if jax.devices()[0].platform != "cpu" and not topology:
        return None
    topo = devices_topology(topology, num_devices, plan.model.compute_dtype)
    candidate = plan_memory.candidate_of(plan)
    return search.evaluate(plan.model, candidate, plan.global_batch, topo, donated=False).step_time_s


def choose(config: ml_collections.ConfigDict, num_devices: int) -> list[Prediction]:
    cfg = models.from_dict(config.model.to_dict())
    topo = devices_topology(config.plan.topology, num_devices, cfg.compute_dtype)
    fixed = search.parse_fixed(config.plan.fixed, num_devices)
    donated = jax.devices()[0].platform != "cpu"  # the step donates its state only on accelerators
    ranked = search.search(cfg, int(config.train.global_batch_size), topo, fixed, donated=donated)
    search.check_fits(ranked, topo)
    return [p for p in ranked if p.fits]


def with_layout(config: ml_collections.ConfigDict, choice: dict) -> ml_collections.ConfigDict:
    """A copy of `config` set to a chosen layout (a candidate's as_json: mesh sizes and the layout knobs)."""
    config = ml_collections.ConfigDict(config.to_dict())
    config.mesh.update(choice["mesh"])
    config.sharding.strategy = "fsdp_tensor"
    config.sharding.shard_opt_state = choice["shard_opt_state"]
    config.model.remat = choice["remat"]
    config.train.grad_accum_steps = choice["grad_accum_steps"]
    if choice["mesh"]["pipeline"] > 1:
        config.pipeline.update(schedule=choice["schedule"], microbatches=choice["microbatches"],
                               virtual_stages=choice["virtual_stages"])
    return config


def _replaced(config: ml_collections.ConfigDict, choice: dict) -> list[tuple[str, object, object, str | None]]:
    """(setting, the config's value, the choice's value, the plan.fixed name that pins it) of every setting
    `with_layout` replaces."""
    rows = [(f"mesh.{axis}", config.mesh[axis], size, axis) for axis, size in choice["mesh"].items()]
    s = config.sharding
    rows += [("sharding.strategy", s.strategy, "fsdp_tensor", None),
             ("sharding.shard_opt_state", s.shard_opt_state, choice["shard_opt_state"], "shard_opt_state"),
             ("model.remat", config.model.remat, choice["remat"], "remat"),
             ("train.grad_accum_steps", config.train.grad_accum_steps, choice["grad_accum_steps"], "grad_accum_steps")]
    if choice["mesh"]["pipeline"] > 1:
        rows += [(f"pipeline.{k}", config.pipeline[k], choice[k], k) for k in ("schedule", "microbatches",
                                                                             "virtual_stages")]
    return rows


def check_replaced(config: ml_collections.ConfigDict, choice: dict, num_devices: int,
                   earlier: dict | None = None) -> None:
    """A setting the user gave (not its default, nor the `earlier` choice a continued run saved) that the planner's
    choice would replace is an error naming both, unless plan.fixed pins it (then the choice keeps it)."""
    defaults, fixed = config_lib.base_config(), search.parse_fixed(config.plan.fixed, num_devices)
    planned = {key: value for key, _, value, _ in _replaced(config, earlier)} if earlier else {}
    for key, value, chosen, pin in _replaced(config, choice):
        section, name = key.split(".")
        if value is None or value in (defaults[section][name], chosen, planned.get(key, chosen)) or pin in fixed:
            continue
        how = (f"pin it with plan.fixed={pin}:{str(value).lower() if isinstance(value, bool) else value}" if pin
               else "set plan.auto=False to lay the run out yourself")
        raise search.PlanError(f"{key}={value!r}: plan.auto=True would replace it with {chosen!r} (its layout "
                               f"{report.mesh_text(choice['mesh'])}); {how}, or drop the setting")


def apply(config: ml_collections.ConfigDict, num_devices: int,
          previous: dict | None = None) -> tuple[ml_collections.ConfigDict, dict | None]:
    """(`config` itself, None) when plan.auto is off, else (a copy running the planner's choice, the record of
    the choice and the runner-up for config.json), printed. `previous`, the config.json of the run being
    continued: its choice is kept when the devices and plan.fixed are the same, so a requeued run resumes on
    the layout it saved (a re-measured CPU peak could otherwise flip two near-equal candidates)."""
    if not config.get("plan", {}).get("auto", False):
        return config, None
    config_lib.check_settings(config)  # the user's own values first: the planner's choice replaces some of them
    record = (previous or {}).get("plan")
    if record and record["devices"] == num_devices and record["fixed"] == config.plan.fixed:
        if jax.process_index() == 0:
            print(f"plan.auto: {report.mesh_text(record['chosen']['mesh'])}, the layout this run chose before",
                  flush=True)
        check_replaced(config, record["chosen"], num_devices, record["chosen"])
        return with_layout(config, record["chosen"]), record
    fitting = choose(config, num_devices)
    runner_up = fitting[1] if len(fitting) > 1 else None
    if jax.process_index() == 0:
        if hardware.peak_is_measured():
            print(f"plan.auto peak: {hardware.peak_flops_per_device('float32') / 1e12:.4g} TFLOP/s per device, "
                  f"{cpu_peak.describe(cpu_peak.record())}", flush=True)
        for label, p in (("plan.auto", fitting[0]), ("plan.auto runner-up", runner_up)):
            if p is not None:
                print(f"{label}: {report.mesh_text(p.candidate.sizes)} | {report.knobs(p)}, predicted "
                      f"{p.step_time_s:.4g} s/step, {p.memory['total'] / 1e9:.3g} GB/device", flush=True)
    record = {"devices": num_devices, "fixed": config.plan.fixed, "chosen": fitting[0].as_json(),
              "runner_up": runner_up.as_json() if runner_up else None}
    check_replaced(config, record["chosen"], num_devices, (previous or {}).get("plan", {}).get("chosen"))
    return with_layout(config, record["chosen"]), record
