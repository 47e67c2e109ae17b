"""What `python -m train.eval` is asked to do, checked before anything is loaded or written."""
from __future__ import annotations

import dataclasses
import pathlib

from mesh.errors import UserError, check_writable


class EvalError(UserError):
    """An evaluation flag the user can fix; one line naming it."""


@dataclasses.dataclass(frozen=True)
class Options:
    workdir: pathlib.Path
    tasks: tuple[str, ...]
    num_fewshot: int | None = None
    limit: int | None = None
    batch_size: int = 16
    include_path: str | None = None
    step: int | None = None
    json_path: str | None = None
    mesh: dict = dataclasses.field(default_factory=dict)  # --config.mesh.* overrides of the run's mesh
    num_devices: int | None = None  # None: every device


def parse_tasks(text: str | None) -> tuple[str, ...]:
    names = tuple(t.strip() for t in (text or "").split(",") if t.strip())
    if not names:
        raise EvalError("--tasks is required: give task names, comma-separated (e.g. --tasks=hellaswag,arc_easy)")
    return names


def check(options: Options) -> None:
    """Flag values, before the checkpoint or lm_eval's task index is read."""
    for name, value, ok, rule in (("num_fewshot", options.num_fewshot, (options.num_fewshot or 0) >= 0, ">= 0"),
                                  ("limit", options.limit, options.limit is None or options.limit >= 1, ">= 1"),
                                  ("batch_size", options.batch_size, options.batch_size >= 1, ">= 1")):
        if not ok:
            raise EvalError(f"--{name}={value}: must be {rule}")
    if options.json_path is not None:  # before the tasks run, not after
        check_writable("--json", options.json_path)
    if options.workdir.is_dir():  # where DIR/eval/step_N.json goes (a missing run is named by the run's checks)
        check_writable("--workdir", str(options.workdir / "eval"), "directory", parents=True)
    if options.include_path is not None and not pathlib.Path(options.include_path).expanduser().exists():
        raise EvalError(f"--include_path={options.include_path}: no such file or directory; give a folder of task "
                        f"YAML files (or one YAML file)")
