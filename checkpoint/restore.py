"""Restore the newest intact checkpoint: check its meta against the target arrays, restore straight into
the target shardings, verify every checksum. A damaged checkpoint is moved aside (kept for inspection,
so a later save of that step succeeds) and the next older one is tried; when checkpoints exist or were
set aside but none restores, stop: never start again from step 0 over them. With a local tier, its newest
step wins when it is newer than the newest persistent one and verifies."""
from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import sys
import time
from typing import Any, Callable

import jax

from checkpoint import collective, integrity
from checkpoint import local as local_lib
from checkpoint import meta as meta_lib
from checkpoint.errors import NoRestorableCheckpoint, RestoreFromError
from checkpoint.local import LocalCheckpoints
from checkpoint.manager import Checkpoints

SET_ASIDE = "checkpoints.set_aside"  # next to DIR/checkpoints


def _quiet_closed_loop_callbacks() -> None:
    """A restore that fails on a missing file leaves TensorStore callbacks that fire after Orbax closed their
    asyncio loop; Python would print each one's 'Event loop is closed' traceback around the one line that
    names the damage. Only those are dropped; every other unraisable exception reaches the previous hook."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
                and unraisable.object is None):
            previous(unraisable)
    sys.unraisablehook = hook


_quiet_closed_loop_callbacks()


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    tree: Any              # plain nested dict of arrays in the target shardings
    meta: dict[str, Any]
    where: pathlib.Path    # the step directory it came from
    tier: str = "persistent"  # or "local" (checkpoint.local_dir)


class _Damaged(Exception):
    pass


def set_aside_dir(ckpts: Checkpoints) -> pathlib.Path:
    return ckpts.directory.parent / SET_ASIDE


def set_aside_entries(ckpts: Checkpoints) -> list[pathlib.Path]:
    folder = set_aside_dir(ckpts)
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _move_aside(ckpts: Checkpoints, step: int, reason: str) -> pathlib.Path:
    stamp = time.strftime('%Y%m%dT%H%M%S')
    dest = set_aside_dir(ckpts) / f"{step}.{stamp}"
    for n in range(1, 1000):  # the same step may be set aside again (saved anew, damaged anew)
        if not dest.exists():
            break
        dest = set_aside_dir(ckpts) / f"{step}.{stamp}.{n}"
    if jax.process_index() == 0:
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(ckpts.step_dir(step), dest)  # a rename on the same filesystem: atomic, nothing copied
        (dest / "SET_ASIDE_REASON.txt").write_text(reason + "\n")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(f"checkpoint_set_aside_{step}")
    ckpts.reload()
    return dest


def _load(ckpts: Checkpoints, step: int, target: Any, params_only: bool) -> tuple[Any, dict[str, Any]]:
    """Restore and verify one step; raises _Damaged with the reason, or IncompatibleCheckpoint."""
    where = ckpts.step_dir(step)
    try:
        meta = ckpts.read_meta(step)
        if not isinstance(meta.get("arrays"), dict):
            raise ValueError("it lists no arrays")
    except Exception as e:  # noqa: BLE001  (unreadable meta: overwritten, truncated, missing)
        raise _Damaged(f"its meta does not read ({type(e).__name__}: {str(e)[:200]})") from None
    meta_lib.check_compatible(meta, target, str(where), prefix="params/" if params_only else "")
    tree, error = None, None
    try:
        tree = ckpts.restore_subtree(step, target) if params_only else ckpts.restore_state(step, target)
    except Exception as e:  # noqa: BLE001  (torn or corrupt data files)
        error = f"its arrays do not restore ({type(e).__name__}: {str(e)[:200]})"
    if not collective.everyone(error is None):
        raise _Damaged(error or "another process could not restore its arrays")
    expected = {name: entry["checksum"] for name, entry in meta["arrays"].items()}
    bad = integrity.mismatches(tree, expected)
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise _Damaged(f"checksum mismatch in {bad[0]}{more}")
    return tree, meta


def restore_newest(ckpts: Checkpoints, target: Any, warn: Callable[[str], None] = print) -> Restored | None:
    """The newest checkpoint that restores into `target` and verifies; None when there are none at all."""
    for step in reversed(ckpts.steps()):
        try:
            tree, meta = _load(ckpts, step, target, params_only=False)
            return Restored(step, tree, meta, ckpts.step_dir(step))
        except _Damaged as e:
            dest = _move_aside(ckpts, step, str(e))
            warn(f"warning: checkpoint {ckpts.step_dir(step)} is damaged: {e}; moved it to {dest}, "
                 f"falling back to the previous one")
    aside = set_aside_entries(ckpts)
    if aside:
        raise NoRestorableCheckpoint(
            f"no checkpoint in {ckpts.directory} restores and {len(aside)} are set aside in {set_aside_dir(ckpts)}; "
            f"refusing to start again from step 0 over them: inspect them, then delete them or use a new --workdir")
    return None


def parse_restore_from(spec: str) -> tuple[pathlib.Path, int | None]:
    """'PATH[:STEP]' -> (PATH/checkpoints, STEP); only a trailing ':digits' is a step."""
    match = re.fullmatch(r"(.+?)(?::(\d+))?", spec)
    path, step = match.group(1), match.group(2)
    return pathlib.Path(path).expanduser() / "checkpoints", int(step) if step is not None else None


def open_source(spec: str) -> tuple[Checkpoints, int]:
    """The read-only checkpoints of `checkpoint.restore_from` and the step to take (the newest if unset)."""
    directory, step = parse_restore_from(spec)
    if not directory.is_dir():
        raise RestoreFromError(f"checkpoint.restore_from={spec!r}: {directory} does not exist; "
                               f"give a run directory that holds checkpoints/ (optionally PATH:STEP)")
    source = Checkpoints(directory, read_only=True)
    steps = source.steps()
    if not steps:
        raise RestoreFromError(f"checkpoint.restore_from={spec!r}: {directory} holds no complete checkpoint")
    if step is not None and step not in steps:
        raise RestoreFromError(f"checkpoint.restore_from={spec!r}: no step {step} in {directory} "
                               f"(it has {', '.join(map(str, steps))})")
    return source, step if step is not None else steps[-1]


def restore_source(source: Checkpoints, step: int, target: Any, params_only: bool, spec: str,
                   named: tuple[str, str] | None = None) -> Restored:
    """Restore another run's checkpoint, read-only: a damaged one is an error, never moved. `named`: (the setting,
    how to name an older step) in the words of a tool that takes no checkpoint.restore_from (train.sample)."""
    setting, older = named or (f"checkpoint.restore_from={spec!r}", "name an older step as PATH:STEP")
    try:
        tree, meta = _load(source, step, target, params_only)
    except _Damaged as e:
        raise RestoreFromError(f"{setting}: {source.step_dir(step)} is damaged ({e}); {older}") from None
    return Restored(step, tree, meta, source.step_dir(step))


def _load_local(local: LocalCheckpoints, step: int, target: Any) -> Restored:
    """One local step, read by every process from its own folder and verified together; raises Unusable."""
    tree, meta, error = None, None, None
    try:
        meta, blob = local.fetch(step)
        if meta.get("copied_from") is not None:  # this process's own copy is gone (a replaced node)
            print(f"local checkpoint {local.step_dir(step)} is missing here; its copy on process "
                  f"{meta['copied_from']} restores it", flush=True)
        tree = local_lib.read_shards(meta, blob, target, str(local.step_dir(step)))
    except local_lib.Unusable as e:
        error = str(e)
    if not collective.everyone(error is None):
        raise local_lib.Unusable(error or "another process could not read its shards")
    local_lib.verify(tree, meta)
    return Restored(step, tree, meta, local.step_dir(step), tier="local")


def restore_tiers(ckpts: Checkpoints, local: LocalCheckpoints | None, target: Any,
                  warn: Callable[[str], None] = print) -> Restored | None:
    """The newest step across both tiers: a local step every process holds and that is newer than the newest
    persistent one, else (one damaged: set aside, the next tried) the persistent tier as restore_newest does."""
    persistent = ckpts.steps()
    newest = persistent[-1] if persistent else -1
    candidates = local.restorable() if local is not None else []
    for step in reversed([s for s in candidates if s > newest]):
        try:
            return _load_local(local, step, target)
        except local_lib.Unusable as e:
            dest = local.set_aside(step, str(e))
            moved = f"moved it to {dest}" if dest else "this process holds no copy of its own"
            warn(f"warning: local checkpoint {local.step_dir(step)} is unusable: {e}; {moved}, falling back to the "
                 f"next newest step of either tier")
    return restore_newest(ckpts, target, warn)
