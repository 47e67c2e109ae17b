"""What wrote a run's files: library versions (checkpoint meta) and, for config.json, the devices too."""
from __future__ import annotations

import importlib.metadata
import os
import pathlib
import tomllib

import jax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def project_version() -> str:
    try:
        return importlib.metadata.version("spmdtrain")
    except importlib.metadata.PackageNotFoundError:
        try:
            return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


def libraries() -> dict[str, str]:
    """The versions a checkpoint's meta records."""
    import flax
    import optax
    import orbax.checkpoint as ocp
    return {"spmdtrain": project_version(), "jax": jax.__version__, "flax": flax.__version__,
            "optax": optax.__version__, "orbax_checkpoint": ocp.__version__}


def environment() -> dict[str, str | int]:
    """The libraries and the devices, for config.json."""
    import jaxlib
    return {**libraries(), "jaxlib": jaxlib.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
            "device_count": jax.device_count(), "process_count": jax.process_count()}
