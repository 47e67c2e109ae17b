"""A finished run's config, read back from the config.json its training wrote, for the tools that work on a
run's checkpoints (export, sampling)."""
from __future__ import annotations

import json
import pathlib
from typing import Any

import ml_collections

import checkpoint
from train.config import ConfigError, base_config


def _apply(section: ml_collections.ConfigDict, values: dict[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(section.get(key), ml_collections.ConfigDict):
            _apply(section[key], value)
        else:
            section[key] = value


def load(workdir: pathlib.Path) -> ml_collections.ConfigDict:
    path = workdir / "config.json"
    if not path.is_file():
        raise ConfigError(f"--workdir={workdir}: no config.json there; give the directory of a training run")
    try:
        saved = json.loads(path.read_text())["config"]
    except (ValueError, KeyError):
        raise ConfigError(f"--workdir={workdir}: {path} is not a run's config.json (no 'config' entry)") from None
    config = base_config()
    _apply(config, saved)
    # With plan.auto the saved mesh.* and layout knobs are the planner's choice, the layout actually trained:
    # use it as written (and let --config.mesh.* override it) rather than planning again.
    config.plan.auto = False
    return config


def checkpoints(workdir: pathlib.Path, step: int | None) -> tuple[checkpoint.Checkpoints, int, str]:
    """(the run's checkpoints, read-only; the step to use, the newest by default; the spec for messages)."""
    if not (workdir / "checkpoints").is_dir():
        raise ConfigError(f"--workdir={workdir}: no checkpoints/ there; give the directory of a training run")
    spec = str(workdir) + (f":{step}" if step is not None else "")
    source, step = checkpoint.open_source(spec)
    return source, step, spec
