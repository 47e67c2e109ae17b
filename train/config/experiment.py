"""The experiment config (an ml_collections ConfigDict) and its validation into a resolved plan.

Every check a user can fail runs here, before anything touches the workdir or compiles, and raises
a one-line error that names the setting and what to do.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

import jax
import ml_collections

import checkpoint
import models
from mesh import resolve_axis_sizes
from models import attention as attention_lib
from sharding import rules as sharding_rules
from sharding import schedules
from train.config import model_settings, sections
from train.config.settings import ConfigError
from train.data import datadir
from train.hf import model as hf_model


def base_config() -> ml_collections.ConfigDict:
    """Every key the system reads, with its default (declared in train/config/sections.py and
    train/config/model_settings.py; docs/configuration.md lists them). Experiment files start from this."""
    c = ml_collections.ConfigDict()
    c.model = model_settings.model_keys()
    for section in sections.SECTIONS:
        c[section.KEY] = section.defaults()
    return c


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """The pipeline settings of a run with mesh.pipeline > 1 (see sharding/schedules.py)."""
    schedule: str
    stages: int
    microbatches: int
    virtual_stages: int

    def build(self) -> schedules.Schedule:
        return schedules.build(self.schedule, self.stages, self.microbatches, self.virtual_stages)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything resolved from a config before any device work: the contract of the run. A new setting
    is declared in the section that owns it (train/config/sections.py explains how); code below __main__ reads the
    plan."""
    model: models.ModelConfig
    mesh_sizes: dict[str, int]
    rules: dict[str, tuple[str, ...]]
    global_batch: int
    grad_accum: int
    steps: int
    decay_steps: int
    profile_steps: tuple[int, int] | None
    pipeline: PipelinePlan | None = None  # None when mesh.pipeline == 1
    # The sections the loop, its actions and the saver read (train/config/sections.py says how a new setting joins).
    train: sections.TrainSection | None = None
    checkpoint: sections.CheckpointSection | None = None
    faults: sections.FaultSection | None = None
    optimizer: sections.OptimizerSection | None = None
    data: sections.DataSection | None = None  # the data.* settings and their token files (`data.files`)
    serve: sections.ServeSection | None = None
    planner: sections.PlanSection | None = None  # plan.*: what the planner lays out and on which topology
    shard_opt_state: bool = False  # sharding.shard_opt_state: optimizer moments also split over data


def _profile_range(text: str, steps: int) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        first, last = (int(x) for x in str(text).split(":"))
    except ValueError:
        raise ConfigError(f"train.profile_steps={text!r}: use FIRST:LAST, e.g. '10:12'") from None
    if not 1 <= first <= last:
        raise ConfigError(f"train.profile_steps={text!r}: need 1 <= FIRST <= LAST")
    if last > steps:
        raise ConfigError(f"train.profile_steps={text!r}: LAST is past train.steps={steps}; lower it")
    return first, last


def _pipeline(section: Any, model: models.ModelConfig, mesh_sizes: dict[str, int], batch: int, accum: int,
              replicas: int) -> PipelinePlan | None:
    """Check the pipeline settings against the model, the mesh and the batch (`replicas`: the batch's mesh ways)."""
    name, m, v = section.schedule, section.microbatches, section.virtual_stages
    p = mesh_sizes["pipeline"]
    if name not in schedules.NAMES:  # a typo is an error even before mesh.pipeline > 1 uses it
        schedules.check_config(name, p, m, v)
    if p == 1:
        return None
    schedules.check_config(name, p, m, v)
    if model.n_layers % (p * v):
        raise ConfigError(f"model.n_layers={model.n_layers} is not divisible by mesh.pipeline={p} x "
                          f"pipeline.virtual_stages={v}; change the layer count or the pipeline shape")
    if models.stack_length(model) % (p * v):
        raise ConfigError(f"model.n_layers={model.n_layers} / model.moe_every={model.moe_every} groups are not "
                          f"divisible by mesh.pipeline={p} x pipeline.virtual_stages={v}; change the layer count, "
                          f"moe_every or the pipeline shape")
    if batch % (replicas * accum * m):
        raise ConfigError(f"train.global_batch_size={batch} is not divisible by the data-parallel size {replicas} x "
                          f"pipeline.microbatches={m} x train.grad_accum_steps={accum}; change the batch or the "
                          f"microbatch count")
    return PipelinePlan(name, p, m, v)


def check_settings(config: ml_collections.ConfigDict) -> None:
    """Every declared check of every section (train/config/sections.py), then the checks across settings."""
    for section in sections.SECTIONS:
        section.check(config[section.KEY])
    model_settings.check(config.model)
    sharding_rules.check_strategy(config.sharding.strategy)  # registered at run time, so no declared choices
    ck = config.checkpoint
    local_dir, every = ck.local_dir, ck.local_every_steps
    if bool(local_dir) != bool(every):
        raise ConfigError(f"checkpoint.local_dir={local_dir!r} and checkpoint.local_every_steps={every}: set both "
                          f"(a node-local directory and a step interval) for a local tier, or neither")
    if ck.restore_params_only and not ck.restore_from:
        raise ConfigError("checkpoint.restore_params_only=True needs checkpoint.restore_from=PATH[:STEP]")


def _check_model_splits(model: models.ModelConfig, rules: dict, mesh_sizes: dict[str, int]) -> None:
    """Every model size a sharded logical axis has must divide by that axis's mesh ways (e.g. model.n_kv_heads
    by mesh.tensor), named before anything compiles."""
    for logical, settings in models.family_of(model).parallel.divisibility(model).items():
        axes = [a for a in rules.get(logical, ()) if mesh_sizes.get(a, 1) > 1]
        ways = math.prod(mesh_sizes[a] for a in axes)
        for setting, size in settings:
            if size % ways:
                split = " x ".join(f"{a}={mesh_sizes[a]}" for a in axes)
                raise ConfigError(f"{setting}={size} is not divisible by mesh axes {split} (they split "
                                  f"`{logical}`); change mesh.* or the model")


def _check_experts(model: models.ModelConfig, rules: dict, mesh_sizes: dict[str, int], rows: int,
                   batch_setting: str) -> None:
    """The layouts a mixture of experts supports (README, "Mixture of experts"): data, fsdp, expert, tensor,
    context and pipeline; the `expert` axis must split both the batch and the experts,
    as every built-in strategy does.
    `rows`: the rows the mixture takes at once (the batch over train.grad_accum_steps, and over the microbatches
    of a pipeline), set by `batch_setting`."""
    if not models.is_moe(model):
        return
    context = mesh_sizes.get("context", 1)
    replicas = math.prod(mesh_sizes[a] for a in rules.get("batch", ()) if a in mesh_sizes)
    if context > 1 and (rows // replicas) % context:
        raise ConfigError(f"mesh.context={context} with model.n_experts={model.n_experts}: the mixture splits each "
                          f"device's {rows // replicas} rows over context; make them a multiple of {context} "
                          f"({batch_setting})")
    if mesh_sizes.get("expert", 1) > 1 and ("expert" not in rules.get("batch", ())
                                            or rules.get("experts", ()) != ("expert",)):
        raise ConfigError("mesh.expert > 1 needs sharding rules batch -> (..., 'expert') and experts -> ('expert',), "
                          "as the built-in strategies have; fix sharding.rules")


def _document_eos_id(data_config: Any, data: datadir.DataSpec | None) -> int:
    """The model's `document_eos_id`: the DATADIR's eos id with data.document_mask on, else -1 (off)."""
    if not data_config.get("document_mask", False):
        return -1
    if data is None or data.eos_id is None:
        raise ConfigError("data.document_mask=True needs the end-of-document id of a DATADIR: set data.source=tokens "
                          "and data.path to a directory made by python -m train.prepare (its meta.json has eos_id)")
    return int(data.eos_id)


def _resolve_attention(model: models.ModelConfig, platform: str | None, context: int = 1) -> models.ModelConfig:
    """The model with `attention` resolved for the platform the run is on (auto -> xla on CPU, and wherever
    mesh.context > 1: the ring is built from XLA blocks); a family without that setting is left as it is."""
    if not hasattr(model, "attention"):
        return model
    if context > 1:
        if model.attention == "cudnn":
            raise ConfigError(f"model.attention=cudnn with mesh.context={context}: ring attention is built from "
                              f"XLA blocks only (a cuDNN ring needs its own backward); use model.attention=auto or xla")
        return dataclasses.replace(model, attention="xla") if model.attention == "auto" else model
    platform = platform or jax.devices()[0].platform
    try:
        kernel = attention_lib.resolve(model.attention, platform, model.compute_dtype, model.head_dim)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return dataclasses.replace(model, attention=kernel)


def _long_sequences(config: ml_collections.ConfigDict, model: models.ModelConfig, mesh_sizes: dict[str, int],
                    rules: dict) -> dict:
    """Check context parallelism (mesh.context) and sequence parallelism (sharding.sequence_parallel) against
    the model and the other settings; returns the rules, with `seq -> tensor` added under sequence parallelism."""
    context, tensor, sp = mesh_sizes["context"], mesh_sizes["tensor"], config.sharding.sequence_parallel
    if sp and tensor == 1:
        raise ConfigError("sharding.sequence_parallel=True needs mesh.tensor > 1 (it splits the sequence over "
                          "`tensor` between the tensor-parallel matmuls); set mesh.tensor or turn it off")
    if sp and "tensor" not in rules.get("heads", ()):
        raise ConfigError(f"sharding.sequence_parallel=True needs a tensor-parallel strategy (`heads` on `tensor`), "
                          f"not sharding.strategy={config.sharding.strategy!r}; use tensor_parallel or fsdp_tensor")
    if context > 1:
        if model.seq_len % (2 * context):
            raise ConfigError(f"model.seq_len={model.seq_len} is not divisible by 2 x mesh.context={context} (the "
                              f"zigzag layout cuts every row into 2 x context chunks); change one of them")
        if "context" not in rules.get("seq", ()):
            raise ConfigError(f"mesh.context={context} needs the rule seq -> context; remove the override of "
                              f"sharding.rules.seq")
    if sp:
        rules = {**rules, "seq": tuple(rules.get("seq", ())) + ("tensor",)}
    return rules


def _model_values(config: ml_collections.ConfigDict, data: datadir.DataSpec | None) -> dict[str, Any]:
    """The model section with what the data decides: the vocabulary, packed documents, the loss mask."""
    # Started from hf:DIR: the shapes and options its config.json decides (a contradicting override is an error).
    model_values = hf_model.model_values(config.model.to_dict(), config.checkpoint.get("restore_from", ""))
    if data and data.vocab_size and model_values.get("vocab_size") is None:
        model_values["vocab_size"] = data.vocab_size  # the model's vocabulary comes from meta.json
    eos_id = _document_eos_id(config.data, data)
    if eos_id >= 0:  # only then: a family without packed-document support keeps working unmasked
        model_values["document_eos_id"] = eos_id
    if data and data.loss_mask:  # only then, as above: rows then encode masked targets (models/documents.py)
        model_values["masked_targets"] = True
    return model_values


def resolve(config: ml_collections.ConfigDict, num_devices: int, platform: str | None = None) -> Plan:
    """Validate `config` for `num_devices` devices of `platform` (default: this process's first device's);
    raises a UserError (mesh/errors.py) naming the setting."""
    check_settings(config)
    data = datadir.resolve(config.data, config.train.global_batch_size)
    model = models.from_dict(_model_values(config, data))
    if data and data.vocab_size and model.vocab_size < data.vocab_size:
        raise ConfigError(f"model.vocab_size={model.vocab_size} is smaller than the vocabulary of data.path "
                          f"({data.vocab_size}, its meta.json); raise it or leave it unset")
    mesh_sizes = resolve_axis_sizes(config.mesh.to_dict(), num_devices)
    model = _resolve_attention(model, platform, mesh_sizes["context"])
    rules = sharding_rules.resolve(config.sharding.strategy, config.sharding.rules.to_dict(), mesh_sizes)
    rules = _long_sequences(config, model, mesh_sizes, rules)
    _check_model_splits(model, rules, mesh_sizes)
    micro = config.pipeline.get("microbatches", 1) if mesh_sizes["pipeline"] > 1 else 1
    micro = micro if isinstance(micro, int) and micro > 0 else 1  # checked with the pipeline settings below
    _check_experts(model, rules, mesh_sizes, config.train.global_batch_size // config.train.grad_accum_steps // micro,
                   "train.global_batch_size" if micro == 1 else "train.global_batch_size or pipeline.microbatches")
    t = config.train
    decay_steps = config.optimizer.decay_steps or t.steps
    if config.optimizer.warmup_steps >= decay_steps:  # name the setting that makes the schedule this short
        length = (f"optimizer.decay_steps={decay_steps}" if config.optimizer.decay_steps else
                  f"train.steps={t.steps} (the schedule's length while optimizer.decay_steps=0)")
        raise ConfigError(f"{length} is not longer than optimizer.warmup_steps={config.optimizer.warmup_steps}; "
                          f"raise {length.split('=')[0]} or lower optimizer.warmup_steps")
    batch_ways = math.prod(mesh_sizes[a] for a in rules.get("batch", ()) if a in mesh_sizes)
    per_update = t.global_batch_size // t.grad_accum_steps
    if t.global_batch_size % t.grad_accum_steps or per_update % batch_ways:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must be divisible by train.grad_accum_steps="
            f"{t.grad_accum_steps} x the batch-sharding mesh axes ({batch_ways} ways); change the batch size")
    pipeline = _pipeline(config.pipeline, model, mesh_sizes, t.global_batch_size, t.grad_accum_steps, batch_ways)
    if config.data.source == "text" and model.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={model.vocab_size}: byte-level text needs at least 256")
    return Plan(model=model, mesh_sizes=mesh_sizes, rules=rules, global_batch=t.global_batch_size,
                grad_accum=t.grad_accum_steps, steps=t.steps, decay_steps=decay_steps,
                profile_steps=_profile_range(t.profile_steps, t.steps), pipeline=pipeline,
                train=sections.TrainSection.from_config(t),
                checkpoint=sections.CheckpointSection.from_config(config.checkpoint),
                faults=sections.FaultSection.from_config(config.fault_injection),
                optimizer=sections.OptimizerSection.from_config(config.optimizer),
                data=sections.DataSection.from_config(config.data, files=data),
                serve=sections.ServeSection.from_config(config.serve),
                planner=sections.PlanSection.from_config(config.plan),
                shard_opt_state=bool(config.sharding.shard_opt_state))


def apply_saved(section: ml_collections.ConfigDict, values: dict[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(section.get(key), ml_collections.ConfigDict):
            apply_saved(section[key], value)
        else:
            section[key] = value


def pin_layout_if_mesh_given(config: ml_collections.ConfigDict, overrides: dict[str, Any]) -> None:
    """A `--config.mesh.*` on the command line is the user's own layout: it turns plan.auto off (unless
    plan.auto itself is given too), so an experiment that leaves the mesh to the planner still runs as told."""
    if "plan.auto" not in overrides and any(k.startswith("mesh.") for k in overrides):
        config.plan.auto = False


def read_run_json(workdir: pathlib.Path) -> dict[str, Any] | None:
    """The config.json a run's training wrote ({"config": {...}, ...}), or None when there is none; a file that is
    not one (damaged, or some other JSON) is a one-line error."""
    path = workdir / "config.json"
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict) or not all(
                isinstance(v, dict) for v in saved["config"].values()):
            raise ValueError
    except (OSError, ValueError):
        raise ConfigError(f"--workdir={workdir}: {path} is not a run's config.json (no 'config' entry of "
                          f"sections); move it away or choose another --workdir") from None
    return saved


def load_run_config(workdir: pathlib.Path) -> ml_collections.ConfigDict:
    """A finished run's config, read back from the config.json its training wrote (for export and sampling)."""
    saved = read_run_json(workdir)
    if saved is None:
        raise ConfigError(f"--workdir={workdir}: no config.json there; give the directory of a training run")
    config = base_config()
    apply_saved(config, saved["config"])
    # With plan.auto the saved mesh.* and layout knobs are the planner's choice, the layout actually trained:
    # use it as written (and let --config.mesh.* override it) rather than planning again.
    config.plan.auto = False
    return config


def run_checkpoints(workdir: pathlib.Path, step: int | None) -> tuple[checkpoint.Checkpoints, int, str]:
    """(the run's checkpoints, read-only; the step to use, the newest by default; the spec for messages)."""
    if not (workdir / "checkpoints").is_dir():
        raise ConfigError(f"--workdir={workdir}: no checkpoints/ there; give the directory of a training run")
    source, newest = checkpoint.open_source(str(workdir))
    steps = source.steps()
    if step is not None and step not in steps:
        raise ConfigError(f"--step={step}: {workdir} has no checkpoint of that step (it has "
                          f"{', '.join(map(str, steps))}); give one of them, or no --step for the newest")
    spec = str(workdir) + (f":{step}" if step is not None else "")
    return source, newest if step is None else step, spec
