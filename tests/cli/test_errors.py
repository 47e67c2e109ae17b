"""Every error a user can cause derives from mesh.errors.UserError, and only train.cli.run turns one into the
one-line `error:` and exit status 2; any other exception is a crash with its traceback."""
import ast
import importlib
import pathlib
import subprocess
import sys
import textwrap

from mesh.errors import UserError
from train import exit_codes

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("mesh", "models", "sharding", "train", "checkpoint", "experiments")
# Raised exception classes that are not a user's mistake, each with the status it ends a run with.
NOT_USER_ERRORS = {
    "checkpoint.errors.NoRestorableCheckpoint": exit_codes.NO_CHECKPOINT,
    "checkpoint.errors.SaveFailed": exit_codes.SAVE_FAILED,
    "checkpoint.restore._Damaged": None,  # caught inside checkpoint/restore.py, which tries the next step
    "checkpoint.local.Unusable": None,  # caught inside checkpoint/restore.py, which tries the next step of either tier
    "train.exit_codes.Stop": None,  # carries its own status
    "train.data.chat.Skip": None,  # caught inside train/data/chat.py, which counts the record it skips
    "train.serve.requests.RequestError": None,  # a request's value, answered 400 by train/serve/server.py
    "train.serve.loop.QueueFull": None,  # a full queue, answered 429 by train/serve/server.py
}


def raised_classes() -> dict[str, type]:
    """{module.Class: class} of every exception class defined in the non-test tree that some `raise` names."""
    defined, raised = [], set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    defined.append((module, node.name))
                if isinstance(node, ast.Raise) and node.exc is not None:
                    exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                    raised.add(exc.attr if isinstance(exc, ast.Attribute) else getattr(exc, "id", ""))
    classes = {f"{m}.{name}": getattr(importlib.import_module(m), name) for m, name in defined if name in raised}
    return {q: cls for q, cls in classes.items() if isinstance(cls, type) and issubclass(cls, BaseException)}


def test_every_raised_error_class_is_a_user_error_or_a_documented_failure():
    classes = raised_classes()
    expected = {"train.exit_codes.ConfigError", "mesh.topology.TopologyError", "train.export_hf.command.ExportError"}
    assert expected <= set(classes)
    wrong = [q for q, cls in sorted(classes.items()) if q not in NOT_USER_ERRORS and not issubclass(cls, UserError)]
    assert not wrong, f"raised for user input but not a UserError (mesh/errors.py): {wrong}"
    for qualified, status in NOT_USER_ERRORS.items():
        assert qualified in classes and not issubclass(classes[qualified], UserError), qualified
        if status is not None:
            assert exit_codes.status_of(classes[qualified]("x")) == status


def test_user_errors_keep_catching_as_value_errors():
    from checkpoint import IncompatibleCheckpoint, RestoreFromError
    from train.config.experiment import ConfigError
    for cls in (ConfigError, IncompatibleCheckpoint, RestoreFromError):
        assert issubclass(cls, UserError) and issubclass(cls, ValueError)
    assert exit_codes.status_of(ConfigError("x")) == exit_codes.USER_ERROR


def _run_tool(body: str, tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    """A tool whose main runs `body`, started through train.cli.run as every `python -m train.*` is."""
    script = tmp_path / "tool.py"
    script.write_text(textwrap.dedent(f"""
        from train import cli
        from train.config.experiment import ConfigError

        def main(argv):
            {body}

        cli.run(main)
    """))
    return subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_cli_run_turns_a_user_error_into_one_line_and_exit_2(tmp_path):
    result = _run_tool('raise ConfigError("train.steps=-1: must be a positive number")', tmp_path)
    assert result.returncode == exit_codes.USER_ERROR
    assert result.stderr.strip() == "error: train.steps=-1: must be a positive number"


def test_a_bare_value_error_is_a_crash_not_exit_2(tmp_path):
    result = _run_tool('raise ValueError("a bug, not a setting")', tmp_path)
    assert result.returncode == exit_codes.CRASH
    assert "Traceback" in result.stderr and result.stderr.strip().endswith("ValueError: a bug, not a setting")
