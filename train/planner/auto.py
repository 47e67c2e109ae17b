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
from train.planner import report, search
from train.planner.candidate import Prediction
from train.runtime import hardware


def devices_topology(config: ml_collections.ConfigDict, num_devices: int, dtype: str) -> topology_lib.Topology:
    try:
        topo = topology_lib.get_topology(config.plan.topology or "local")
    except ValueError as e:
        raise search.PlanError(f"plan.topology: {e}") from None
    hosts = jax.process_count()
    memory = hardware.memory_per_device() or topo.device_memory_gb * 1e9
    peak = dict(topo.peak_tflops)
    peak.setdefault(dtype, hardware.peak_flops_per_device(dtype) / 1e12)
    intra = topo.intra if not topo.intra.dims else dataclasses.replace(topo.intra, dims=())
    hbm = topo.hbm_gbps or chips.memory_gbps(jax.devices()[0].device_kind) or 0.0  # a CPU's: from --calibrate
    return dataclasses.replace(topo, hosts=hosts, devices_per_host=num_devices // hosts, intra=intra,
                               device_memory_gb=memory / 1e9, peak_tflops=peak, hbm_gbps=hbm)


def choose(config: ml_collections.ConfigDict, num_devices: int) -> list[Prediction]:
    cfg = models.from_dict(config.model.to_dict())
    topo = devices_topology(config, num_devices, cfg.compute_dtype)
    fixed = search.parse_fixed(config.plan.fixed, num_devices)
    donated = jax.devices()[0].platform != "cpu"  # the step donates its state only on accelerators
    ranked = search.search(cfg, int(config.train.global_batch_size), topo, fixed, donated=donated)
    search.check_fits(ranked, topo)
    return [p for p in ranked if p.fits]


def apply(config: ml_collections.ConfigDict, num_devices: int) -> ml_collections.ConfigDict:
    """`config` itself when plan.auto is off, else a copy running the planner's choice (printed with the runner-up)."""
    if not config.get("plan", {}).get("auto", False):
        return config
    fitting = choose(config, num_devices)
    best = fitting[0].candidate
    config = ml_collections.ConfigDict(config.to_dict())
    config.mesh.update(best.sizes)
    config.sharding.strategy = "fsdp_tensor"
    config.sharding.shard_opt_state = best.shard_opt_state
    config.model.remat = best.remat
    config.train.grad_accum_steps = best.grad_accum_steps
    if best.sizes["pipeline"] > 1:
        config.pipeline.update(schedule=best.schedule, microbatches=best.microbatches,
                               virtual_stages=best.virtual_stages)
    if jax.process_index() == 0:
        print(f"plan.auto: {report.mesh_text(best.sizes)} | {report.knobs(fitting[0])}, predicted "
              f"{fitting[0].step_time_s:.4g} s/step", flush=True)
        if len(fitting) > 1:
            print(f"plan.auto runner-up: {report.mesh_text(fitting[1].candidate.sizes)} | {report.knobs(fitting[1])}, "
                  f"predicted {fitting[1].step_time_s:.4g} s/step", flush=True)
    return config
