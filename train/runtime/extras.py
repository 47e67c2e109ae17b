"""The optional parts of the project and the pip extra that brings each (pyproject.toml): a feature whose package is
missing stops with one line naming the `pip install` to run, instead of an ImportError traceback."""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from mesh.errors import UserError

EXTRAS = {"pyarrow": "parquet", "matplotlib": "plots", "wandb": "wandb", "datasets": "data", "fsspec": "data",
          "zstandard": "data", "lm_eval": "eval", "jinja2": "chat", "fastapi": "serve", "uvicorn": "serve",
          "prometheus_client": "serve"}


class MissingExtra(UserError):
    """A feature needs a package of an extra that is not installed."""


def message(package: str, what: str) -> str:
    return (f"{what} needs {package}, which is not installed: pip install 'spmdtrain[{EXTRAS[package]}]' "
            f"(or pip install -e '.[{EXTRAS[package]}]' in a checkout)")


def check(package: str, what: str) -> None:
    """Raise MissingExtra unless `package` can be imported (nothing is imported: a cheap check before the work)."""
    if importlib.util.find_spec(package) is None:
        raise MissingExtra(message(package, what))


def load(module: str, what: str) -> ModuleType:
    """Import `module` (e.g. "pyarrow.parquet") of an optional package, or raise MissingExtra naming the extra."""
    package = module.split(".")[0]
    check(package, what)
    return importlib.import_module(module)
