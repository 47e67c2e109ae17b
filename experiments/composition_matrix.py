"""The composition matrix of docs/testing.md: every pair of parallel axes, two ways each, built by Trainer.build on the
tiny model (moe-tiny with `expert` or `moe`; a packed-documents column for each), each with the one-line error it
gives or the tests that hold a layout with both axes to one device (read from pytest's ids).

    python -m experiments.composition_matrix [--markdown]
"""
from __future__ import annotations

import itertools
import json
import math
import pathlib
import re
import subprocess
import sys
import tempfile

import numpy as np
from absl import flags

from mesh import use_cpu_devices
from mesh.errors import UserError
from train import cli

# `sp`: tensor=2 with sequence parallelism; `moe`: the moe-tiny mixture of experts with no `expert` axis.
AXES = ("data", "fsdp", "tensor", "sp", "pipeline", "context", "expert", "moe")
SAME = ({"tensor", "sp"}, {"expert", "moe"})  # a variant of the other, listed with every third axis instead
# Files whose test ids name meshes ("data=2,context=2,tensor=2-sp"): a layout that one of them runs is checked
# against one device there (test_documents names its meshes in the code, listed below by hand).
TEST_FILES = ("tests/sharding/test_compositions.py", "tests/sharding/test_context.py", "tests/models/test_moe.py",
              "tests/sharding/test_pipeline.py", "tests/sharding/test_equivalence.py")
DOCUMENT_TESTS = {("data", "tensor"): "test_documents::test_masked_loss_is_the_global_mean_in_every_layout",
                  ("data", "pipeline"): "test_documents::test_masked_loss_is_the_global_mean_in_every_layout",
                  ("pipeline", "tensor"): "test_documents::test_masked_loss_is_the_global_mean_in_every_layout",
                  ("pipeline", "sp"): "test_documents::test_masked_loss_is_the_global_mean_in_every_layout",
                  ("data", "sp"): "test_documents::test_masked_loss_is_the_global_mean_in_every_layout"}
_MARKDOWN = flags.DEFINE_bool("markdown", False, "Print the table of docs/testing.md rather than JSON lines.")


def _config(axes: tuple[str, ...], documents: pathlib.Path | None = None):
    """The tiny model on a mesh of 2 ways per axis (`sp`: tensor=2 with sequence parallelism)."""
    from experiments.tiny import get_config
    config = get_config()
    config.plan.auto = False
    config.data.source = "synthetic"
    config.model.preset = "moe-tiny" if {"expert", "moe"} & set(axes) else "tiny"
    config.mesh.update({"data": 1, **{("tensor" if a == "sp" else a): 2 for a in axes if a != "moe"}})
    config.sharding.sequence_parallel = "sp" in axes
    if documents is not None:
        config.data.update(source="tokens", path=str(documents), document_mask=True)
    return config


def build_outcome(axes: tuple[str, ...], documents: pathlib.Path | None = None) -> str:
    """'OK' when Trainer.build accepts the layout (nothing is compiled), else its one-line error."""
    from train.trainer import Trainer
    config = _config(axes, documents)
    try:
        Trainer.build(config, num_devices=math.prod(config.mesh.to_dict().values()))
    except UserError as e:
        return str(e)
    return "OK"


def _datadir(path: pathlib.Path) -> pathlib.Path:
    """A token directory of random ids with an end-of-document id about every 9 tokens (what document_mask needs)."""
    path.mkdir()
    rng = np.random.default_rng(0)
    tokens = np.where(rng.random(6000) < 0.11, 0, rng.integers(1, 256, 6000)).astype(np.uint16)
    tokens.tofile(path / "train.bin")
    tokens[:1000].tofile(path / "val.bin")
    (path / "meta.json").write_text(json.dumps(dict(vocab_size=256, dtype="uint16", eos_id=0)))
    return path


def _layout_of(test_id: str) -> frozenset[str] | None:
    """The axes of the mesh a test id names ('...[data=2,context=2,tensor=2-sp]'), `sp` for sequence parallelism."""
    params = test_id.partition("[")[2].rstrip("]")
    sizes = dict(re.findall(r"(\w+)=(\d+)", params))
    if not sizes:
        return None
    axes = {a for a, n in sizes.items() if int(n) > 1}
    return frozenset(axes | ({"sp"} if "sp" in params.split("-") else set()))


def _moe(test_id: str) -> bool:
    return "moe" in test_id or "expert_layout" in test_id


def tested_layouts() -> dict[str, frozenset[str]]:
    """{test id: its layout's axes} of every test in TEST_FILES that holds a named mesh to one device."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *TEST_FILES],
                         capture_output=True, text=True, check=True).stdout
    tests = {}
    for line in out.splitlines():
        if "matches_single_device" in line or "match_single_device" in line:
            layout = _layout_of(line)
            if layout:
                tests[line.strip().removeprefix("tests/")] = layout | ({"moe"} if _moe(line) else set())
    return tests


def _tested_by(pair: tuple[str, ...], tests: dict[str, frozenset[str]], documents: bool) -> str:
    """The shortest id of a test holding both axes to one device, on the pair's model (dense unless it names one;
    `moe` without `expert` on a mesh without that axis)."""
    moe, expert = bool({"expert", "moe"} & set(pair)), "expert" in pair
    names = [t for t, axes in tests.items() if set(pair) <= axes and ("documents" in t) == documents
             and ("moe" in axes) == moe and (expert or "expert" not in axes)]
    if documents and tuple(sorted(pair)) in DOCUMENT_TESTS:
        names.append(DOCUMENT_TESTS[tuple(sorted(pair))])
    return min(names, key=len) if names else ""


def rows(documents: pathlib.Path) -> list[dict]:
    """One record per pair of AXES: its build outcome and test, without and with packed documents."""
    tests = tested_layouts()
    out = []
    for pair in itertools.combinations(AXES, 2):
        if set(pair) in SAME:
            continue
        out.append({"axes": pair, "build": build_outcome(pair), "tested": _tested_by(pair, tests, False),
                    "build_documents": build_outcome(pair, documents),
                    "tested_documents": _tested_by(pair, tests, True)})
    wider = sorted({axes for axes in tests.values() if len(axes - {"moe"}) >= 3}, key=lambda a: (len(a), sorted(a)))
    for axes in wider:
        names = [t for t, a in tests.items() if a == axes]
        shown = axes - {"moe"} if "expert" in axes else axes  # the expert axis implies the mixture
        out.append({"axes": tuple(a for a in AXES if a in shown), "build": "OK", "tested": min(names, key=len),
                    "build_documents": "", "tested_documents": ""})
    return out


def _cell(outcome: str, test: str) -> str:
    if outcome == "OK":
        return f"tested equal to one device (`{test}`)" if test else "builds; no test yet"
    return f"error: `{outcome}`" if outcome else ""


def main(argv):
    del argv
    use_cpu_devices(8)
    with tempfile.TemporaryDirectory() as tmp:
        records = rows(_datadir(pathlib.Path(tmp) / "data"))
    if not _MARKDOWN.value:
        for record in records:
            print(json.dumps(record))
        return
    print("| axes | synthetic rows | packed documents (`data.document_mask=True`) |")
    print("|---|---|---|")
    for r in records:
        print(f"| {' x '.join(r['axes'])} | {_cell(r['build'], r['tested'])} | "
              f"{_cell(r['build_documents'], r['tested_documents'])} |")


if __name__ == "__main__":
    cli.run(main)  # a bad flag or setting: one line, exit 2
