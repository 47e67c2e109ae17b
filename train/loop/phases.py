"""A run across phases. `config.json` records the config a run trains with; `python -m train --workdir=DIR` alone
continues from it with every override it had. A later phase may change the settings of PHASE_SETTINGS (how long,
how often, where the data and the layout are): they are taken and recorded in config.json's `history`; any other
change (the model, the optimizer, the seed, the batch, what the data is) is refused, naming the setting, once
the run has saved a checkpoint (before that, nothing trained with the old value lives on)."""
from __future__ import annotations

import datetime
import importlib.util
import json
import pathlib
from typing import Any

import ml_collections

from train.config.experiment import ConfigError, apply_saved, base_config, read_run_json

# A key equal to an entry, or under an entry ending in "." (a whole section).
PHASE_SETTINGS = (
    "train.steps", "optimizer.decay_steps",  # how long (and the schedule's length)
    "train.log_every", "train.eval_every", "train.eval_batches", "train.profile_steps", "train.loggers",
    "train.actions", "checkpoint.",  # how often: logging, evaluation, checkpoints (and where they come from)
    "data.path", "data.cache_dir",  # the data of a new phase, and where caches go
    "mesh.", "sharding.", "pipeline.", "plan.", "train.grad_accum_steps", "model.remat", "model.attention",
    "model.loss_chunk_size",  # the layout and the kernels: the same function, computed another way
    "train.memory_check", "train.on_nonfinite", "train.step_timeout_s", "fault_injection.",  # supervision
)


def may_change(key: str) -> bool:
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in PHASE_SETTINGS)


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _comparable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))  # as config.json holds it (tuples as lists, ...)


def read(workdir: pathlib.Path) -> dict[str, Any] | None:
    """The run's config.json, or None when the directory holds no run."""
    return read_run_json(workdir)


def changes(saved: dict[str, Any], config: dict[str, Any], workdir: pathlib.Path,
            saved_state: bool = True) -> dict[str, list[Any]]:
    """{key: [before, now]} of the settings this phase changes; a change PHASE_SETTINGS does not allow is a
    ConfigError naming it, unless the run never saved a checkpoint (`saved_state` False: nothing trained with the
    old value lives on, so a corrected setting is taken). A key the saved config lacks (added to the project
    since) is no change."""
    before, now = _flat(_comparable(saved)), _flat(_comparable(config))
    changed = {k: [before[k], v] for k, v in now.items() if k in before and before[k] != v}
    for key, (old, new) in changed.items():
        if saved_state and not may_change(key):
            raise ConfigError(f"{key}={new!r}: the run in {workdir} trains with {key}={old!r}, and that cannot "
                              f"change between phases (steps, cadences, loggers, actions, data.path and the layout "
                              f"can); set it back, or use a new --workdir")
    return changed


def with_history(resolved: dict[str, Any], saved: dict[str, Any] | None, changed: dict[str, list[Any]],
                 config_file: str) -> dict[str, Any]:
    """config.json's new content: `resolved`, the experiment file, and the history of phase changes."""
    history = list((saved or {}).get("history", []))
    if changed:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        history.append({"time": now, "changes": changed})
    source = config_file or (saved or {}).get("config_file", "")
    return {**resolved, "config_file": source, "history": history}


def _import_experiment(config_file: str) -> None:
    """Import the experiment file the run started from, so the actions it registers exist again."""
    path = pathlib.Path(config_file.split(":", 1)[0])
    if not path.is_file():
        return  # moved away: an action it registered is then named as unknown
    spec = importlib.util.spec_from_file_location(f"_experiment_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def resume_config(workdir: pathlib.Path, overrides: dict[str, Any]) -> ml_collections.ConfigDict | None:
    """The config `--workdir=DIR` alone continues with: config.json's, then `overrides` ({"train.steps": 9});
    None when DIR holds no run."""
    saved = read(workdir)
    if saved is None:
        return None
    config = base_config()
    apply_saved(config, saved["config"])
    config.update_from_flattened_dict(overrides)
    if saved.get("config_file") and config.train.actions:
        _import_experiment(saved["config_file"])
    return config
