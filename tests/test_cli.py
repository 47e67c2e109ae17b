"""Every `python -m train.*` tool fails on a bad command line the way it fails on a bad setting: one line, exit 2."""
import pytest

from tests.helpers import run_cli
from train.loop import exit_codes

CASES = {
    "misspelled override": (["--config.model.presett=x", "--workdir=W"],
                            'error: --config.model.presett: no such setting "presett"; did you mean "preset"?'),
    "misspelled override after --config": (
        ["--config=experiments/tiny.py", "--config.train.stpes=3", "--workdir=W"],
        'error: --config.train.stpes: no such setting "stpes"; did you mean "steps"?'),
    "missing config file": (["--config=experiments/nope.py", "--workdir=W"],
                            "error: --config=experiments/nope.py: no such config file; give an experiment file such "
                            "as experiments/default.py"),
    "missing workdir": ([], "error: --workdir is required; pass --workdir=VALUE"),
    "wrong type": (["--config.train.steps=abc", "--workdir=W"],
                   "error: --config.train.steps=abc: invalid literal for int() with base 10: 'abc'"),
    "unknown variant": (["--config=experiments/tiny.py:foo", "--workdir=W"],
                        "error: experiments/tiny.py:foo: this experiment has no variants"),
    "bad setting": (["--config=experiments/tiny.py", "--config.train.steps=-1", "--workdir=W"],
                    "error: train.steps=-1: must be a positive number"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_command_line_error_is_one_line_and_exit_2(name, tmp_path):
    args, expected = CASES[name]
    args = [a.replace("W", str(tmp_path / "run")) if a.startswith("--workdir") else a for a in args]
    result = run_cli(*args, timeout=120)
    assert result.returncode == exit_codes.USER_ERROR, result.stderr[-2000:]
    assert result.stderr.strip() == expected
    assert not (tmp_path / "run").exists()


TOOL_CASES = {  # each fails while parsing flags, before any work: cheap subprocesses
    "plan: missing config file": ("train.plan", ["--config=experiments/nope.py"],
                                  "error: --config=experiments/nope.py: no such config file; give an experiment "
                                  "file such as experiments/default.py"),
    "sample: misspelled override": ("train.sample", ["--workdir=W", "--config.mesh.dat=2"],
                                    'error: --config.mesh.dat: no such setting "dat"; did you mean "data"?'),
    "export_hf: missing --out": ("train.export_hf", ["--workdir=W"], "error: --out is required; pass --out=VALUE"),
    "prepare: wrong type": ("train.prepare", ["--num_workers=abc"],
                            "error: --num_workers=abc: invalid literal for int() with base 10: 'abc'"),
}


@pytest.mark.parametrize("name", sorted(TOOL_CASES))
def test_every_tool_fails_on_its_command_line_in_one_line(name, tmp_path):
    module, args, expected = TOOL_CASES[name]
    args = [a.replace("W", str(tmp_path / "run")) if a.startswith("--workdir") else a for a in args]
    result = run_cli(*args, module=module, timeout=120)
    assert result.returncode == exit_codes.USER_ERROR, result.stderr[-2000:]
    assert result.stderr.strip() == expected
    assert not (tmp_path / "run").exists()
