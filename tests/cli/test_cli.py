"""Every `python -m train.*` tool fails on a bad command line the way it fails on a bad setting: one line, exit 2.
Each table runs its command lines in forked children of one warm interpreter (tests/forked.py)."""
from tests.forked import run_many
from train import exit_codes

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


def _failures(cases: dict[str, tuple[str, list[str], str]], tmp_path) -> list[str]:
    """Run every (module, args, expected stderr) case; the ones that did not fail as expected, described."""
    workdirs = {name: tmp_path / name.replace(" ", "_").replace(":", "") for name in cases}
    lines = [(module, [a.replace("W", str(workdirs[name])) if a.startswith("--workdir") else a for a in args])
             for name, (module, args, _) in cases.items()]
    failures = []
    for (name, (_, _, expected)), (status, _out, err) in zip(cases.items(), run_many(lines)):
        if status != exit_codes.USER_ERROR or err.strip() != expected or workdirs[name].exists():
            failures.append(f"{name}: status {status}, stderr {err.strip()[-600:]!r}")
    return failures


def test_command_line_error_is_one_line_and_exit_2(tmp_path):
    failures = _failures({name: ("train", args, expected) for name, (args, expected) in CASES.items()}, tmp_path)
    assert not failures, "\n".join(failures)


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


def test_every_tool_fails_on_its_command_line_in_one_line(tmp_path):
    failures = _failures(TOOL_CASES, tmp_path)
    assert not failures, "\n".join(failures)


HELP_FLAGS = {  # each command's --help (absl lists only the main module's key flags) names its own flags
    "train": ["--config", "--workdir", "--compile_only", "--audit"],
    "train.prepare": ["--input", "--out", "--tokenizer", "--format"],
    "train.sample": ["--workdir", "--prompt", "--max_new_tokens", "--config"],
    "train.export_hf": ["--workdir", "--out", "--dtype", "--merge_lora"],
    "train.eval": ["--workdir", "--tasks", "--include_path", "--config"],
    "train.plan": ["--config", "--topology", "--hosts", "--calibrate"],
    "train.launch": ["--num_processes", "--max_restarts", "--emit"],
    "mesh.bench": ["--mesh", "--min_bytes", "--fit"],
}


def test_every_command_help_lists_its_own_flags():
    results = run_many([(module, ["--help"]) for module in HELP_FLAGS])
    missing = {module: [f for f in expected if f"  {f}:" not in out + err and f"  --[no]{f[2:]}:" not in out + err]
               for (module, expected), (_status, out, err) in zip(HELP_FLAGS.items(), results)}
    assert not any(missing.values()), missing
