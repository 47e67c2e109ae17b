"""Dependencies: every package the project imports is declared (a dependency or an extra of pyproject.toml), the
Makefile installs every extra the tests use, and a feature whose extra is missing is one line naming the pip
install, raised before any work."""
import ast
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tomllib

import pytest

from tests.helpers import ROOT, tiny_config
from train.data import corpus
from train.loop import runner as loop
from train.runtime import extras, hub

PACKAGES = ("mesh", "models", "sharding", "train", "checkpoint", "experiments")
BROUGHT_BY = {"jaxlib": "jax"}  # installed by the declared package on the right, with a matching version


def _declared() -> dict[str, str]:
    """{normalized distribution name: "" for a dependency, else its extra}."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda spec: re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].lower().replace("_", "-")  # noqa: E731
    declared = {name(spec): "" for spec in project["dependencies"]}
    for extra, specs in project["optional-dependencies"].items():
        for spec in specs:
            declared.setdefault(name(spec), extra)
    return declared


def _imported() -> set[str]:
    """Top-level names of every module the project's packages import (at module top or inside functions)."""
    names = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - set(PACKAGES) - {"__future__"}


def test_every_imported_package_is_declared_and_make_test_installs_the_extras():
    declared, owners = _declared(), importlib.metadata.packages_distributions()
    undeclared = []
    for module in sorted(_imported()):
        dists = {d.lower().replace("_", "-") for d in owners.get(module, [module])} | {BROUGHT_BY.get(module, "")}
        if not dists & set(declared):
            undeclared.append(f"{module} ({', '.join(sorted(dists))})")
    assert not undeclared, f"imported but not in pyproject.toml: {undeclared}"
    assert {"parquet", "plots", "wandb", "data"} <= {e for e in declared.values() if e}
    make_test = re.search(r"pip install --quiet -e '\.\[([^\]]*hf[^\]]*)\]'", (ROOT / "Makefile").read_text())
    assert make_test and set(make_test.group(1).split(",")) >= {"test", "parquet", "plots", "wandb", "data", "hf"}
    assert set(extras.EXTRAS.values()) <= set(declared.values())
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    [everything] = optional["all"]  # every feature, for `pip install 'spmdtrain[all]'`
    assert set(everything[everything.index("[") + 1:-1].split(",")) == set(optional) - {"all", "hf", "test", "cuda",
                                                                                         "cuda12"}


@pytest.fixture
def missing(monkeypatch):
    """Pretend the named packages are not installed."""
    absent: set[str] = set()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in absent else find_spec(name, *a))
    return absent


def test_a_missing_extra_is_one_line_naming_the_pip_install(tmp_path, missing):
    missing.update({"pyarrow", "wandb"})
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    with pytest.raises(extras.MissingExtra) as error:
        corpus.inputs([str(tmp_path)])
    assert str(error.value) == (f"--input={tmp_path / 'a.parquet'} (Parquet) needs pyarrow, which is not installed: "
                                f"pip install 'spmdtrain[parquet]' (or pip install -e '.[parquet]' in a checkout)")
    config = tiny_config()
    config.train.loggers = "tensorboard,wandb"
    with pytest.raises(extras.MissingExtra, match=r"^train.loggers=wandb needs wandb, .*spmdtrain\[wandb\]"):
        loop.run(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("mode,expected", [(None, "1 127.0.0.1 cannot be reached from here"), ("0", "0 ")])
def test_an_unreachable_hub_turns_on_offline_mode_unless_the_user_chose_one(mode, expected):
    """Offline, the Hub client retries each request for about 25 s; in offline mode it reads the cache at once."""
    env = {k: v for k, v in os.environ.items() if k not in (*hub.PROXIES, "HF_HUB_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:1", **({"HF_HUB_OFFLINE": mode} if mode else {}))
    code = ("import os; from train.runtime import hub; hub.go_offline_if_unreachable(); "
            "print(os.environ.get('HF_HUB_OFFLINE'), hub.note())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith(expected), out.stdout + out.stderr
