"""Async checkpoints with Orbax: DIR/checkpoints/<step>/ holds the PyTree item `state` and the JSON item
`meta`. The caller blocks only while arrays are copied to host; Orbax writes and commits in the
background (a save killed midway stays a `*.orbax-checkpoint-tmp` folder that is never listed), and a
background failure is raised on the caller's thread by the next poll() or wait(), its partial files removed
and the older checkpoints left as they were, so the caller may go on and save again."""
from __future__ import annotations

import dataclasses
import pathlib
import re
import shutil
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from checkpoint import cadence, integrity
from checkpoint import meta as meta_lib
from checkpoint.errors import SaveFailed
from checkpoint.meta_handler import DeferredMeta, MetaRestore, MetaSave

ITEMS = ("state", "meta")
HOST_KIND = "pinned_host"


def pinned_host_copy_applies(tree: Any) -> bool:
    """Whether a save first copies `tree` into pinned host memory itself: on accelerators whose devices have
    a `pinned_host` memory (GPUs; TPUs), not on CPU, where the arrays already are in host memory."""
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    if not leaves:
        return False
    device = next(iter(leaves[0].sharding.device_set))
    if device.platform == "cpu":
        return False
    try:
        return any(m.kind == HOST_KIND for m in device.addressable_memories())
    except (AttributeError, NotImplementedError, RuntimeError):  # a backend without memory spaces
        return False


def to_pinned_host(tree: Any) -> Any:
    """One batched device-to-host copy of every array into pinned memory (DMA at link speed, all copies in
    flight together), waited for; Orbax then writes host arrays and its own transfer has nothing to move."""
    leaves, treedef = jax.tree.flatten(tree)
    at = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    moved = jax.device_put([leaves[i] for i in at], [leaves[i].sharding.with_memory_kind(HOST_KIND) for i in at])
    for i, x in zip(at, jax.block_until_ready(moved)):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


@dataclasses.dataclass(frozen=True)
class SavePolicy:
    """When to save: every `every_steps` steps and/or every `every_minutes` of wall time (0 = never);
    the caller also saves at the final step and on preemption. With `mtbf_hours` (the job's mean time
    between failures) the time interval is Young/Daly's for the measured save cost, capped by every_minutes."""
    every_steps: int = 0
    every_minutes: float = 0.0
    mtbf_hours: float = 0.0

    def step_due(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def interval_s(self, save_cost_s: float | None = None) -> float:
        """Seconds between time-based saves (0 = none); before a save cost is measured, every_minutes."""
        cap = 60.0 * self.every_minutes
        if not self.mtbf_hours or not save_cost_s:
            return cap
        best = cadence.optimal_interval_s(save_cost_s, 3600.0 * self.mtbf_hours)
        return min(best, cap) if cap else best

    def time_due(self, seconds_since_last_save: float, save_cost_s: float | None = None) -> bool:
        interval = self.interval_s(save_cost_s)
        return bool(interval) and seconds_since_last_save >= interval


@dataclasses.dataclass(frozen=True)
class SaveRecord:
    step: int
    blocked_s: float  # the caller's wait: device-to-host copy and the start of the write
    save_s: float     # start of the save to its commit, from Orbax's own timestamps


def brief(error: BaseException, limit: int = 160) -> str:
    """An error in one short line: Orbax's messages run to pages, and their cause comes last, except for
    TensorStore's, whose operating-system cause comes before a page of its spec."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    os_error = re.search(r"(Failed to \w+ [^\[\]]{0,200}?) \[os_error_code=", text)
    if os_error:
        return f"{type(error).__name__}: {os_error.group(1)}"
    return text if len(text) <= limit else f"{type(error).__name__}: ...{text[-limit:]}"


def _one_writer_per_array() -> None:
    """With one process, Orbax's replica-parallel saving (its default on CPU) cuts every replicated array
    into per-device slices, compiling a slice program per shape on each process's first save (seconds
    of blocked time on CPU) for no I/O gain, since one process writes everything anyway. Turn it off
    then, as Orbax already does on GPU; with several processes keep Orbax's choice."""
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if jax.process_count() == 1 and getattr(handler, "_use_replica_parallel", False):
        handler._use_replica_parallel = False


def _retention(keep: int, keep_period: int) -> policies.PreservationPolicy:
    latest = policies.LatestN(keep)
    return policies.AnyPreservationPolicy([latest, policies.EveryNSteps(keep_period)]) if keep_period else latest


class OneSaveInFlight:
    """poll() and wait() over at most one asynchronous save in flight (`_inflight`, None when idle): a tier says
    whether its save is still writing (`_writing`) and how one is finished (`_finish`: join, record into `_done`,
    or raise SaveFailed)."""
    _inflight: Any
    _done: list[SaveRecord]

    def _writing(self) -> bool:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def poll(self) -> list[SaveRecord]:
        """Non-blocking: records of saves committed since the last call; raises SaveFailed if one failed."""
        if self._inflight is not None and not self._writing():
            self._finish()
        done, self._done = self._done, []
        return done

    def wait(self) -> list[SaveRecord]:
        """Like poll(), but first blocks until the save in flight has committed."""
        if self._inflight is not None:
            self._finish()
        return self.poll()


class Checkpoints(OneSaveInFlight):
    """The checkpoints of one run directory (`read_only` for another run's, as with restore_from)."""

    def __init__(self, directory: str | pathlib.Path, *, keep: int = 3, keep_period: int = 0,
                 read_only: bool = False, async_save: bool = True, pinned_host_copy: bool | None = None):
        self.directory = pathlib.Path(directory).expanduser().absolute()  # Orbax needs absolute paths
        _one_writer_per_array()
        # read_only: a manager that is never asked to save, so it writes nothing (Orbax's own read_only
        # mode would log a warning on every run that merely peeks at its checkpoints).
        self.read_only = read_only
        self.pinned_host_copy = pinned_host_copy  # None: where pinned_host_copy_applies; True/False: forced
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_save, create=not read_only,
            cleanup_tmp_directories=not read_only,  # leftovers of saves killed midway
            preservation_policy=None if read_only else _retention(keep, keep_period))
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        self._inflight: tuple[int, float] | None = None  # (step, blocked seconds) of the save in flight
        self._done: list[SaveRecord] = []
        self._failed: set[int] = set()  # steps whose save failed: their partial files are removed

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return sorted(self.manager.all_steps())

    def reload(self) -> None:
        self.manager.reload()

    def step_dir(self, step: int) -> pathlib.Path:
        return self.directory / str(step)

    def save(self, step: int, tree: Any, info: dict[str, Any],
             checksums: tuple[list[str], Any] | None = None, waited_s: float = 0.0) -> float:
        """Start saving `tree` (a plain nested dict of arrays) as `step`, with a meta of `info` plus every
        array's shape, dtype and checksum. `checksums`: integrity.device_checksums(tree) dispatched earlier,
        while the arrays were still being computed, so that on CPU (where a dispatch with ready inputs runs
        inline) they do not block here either. Returns the seconds the caller was blocked, including any
        wait for the previous save (whose failure is raised here) and the caller's `waited_s` for it."""
        assert not self.read_only, "a read-only Checkpoints never saves"
        start = time.perf_counter() - waited_s
        if self._inflight is not None:
            self._finish()
        names, sums = checksums or integrity.device_checksums(tree)  # the commit fetches them
        pinned = self.pinned_host_copy if self.pinned_host_copy is not None else pinned_host_copy_applies(tree)
        if pinned:
            tree = to_pinned_host(tree)
        meta = DeferredMeta(meta_lib.build(tree, {}, step=step, **info), names, sums)
        try:
            self.manager.save(step, force=True, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                                         meta=MetaSave(meta)))
        except Exception as e:  # noqa: BLE001  (the synchronous part: directories, host copies)
            self._discard(step)
            raise SaveFailed(f"saving checkpoint {self.step_dir(step)} failed ({brief(e)}); check the space and "
                             f"permissions of {self.directory}", step) from e
        blocked = time.perf_counter() - start
        self._inflight = (step, blocked)
        return blocked

    def _finish(self) -> None:
        step, blocked = self._inflight
        self._inflight = None
        try:
            self.manager.wait_until_finished()  # joins at once if done; raises the background error
        except Exception as e:  # noqa: BLE001
            self._discard(step)
            raise SaveFailed(f"background save of checkpoint {self.step_dir(step)} failed ({brief(e)}); the newest "
                             f"complete checkpoint is intact: check the space and permissions of "
                             f"{self.directory}", step) from e
        if step not in self.manager.all_steps():
            self._discard(step)
            raise SaveFailed(f"background save of checkpoint {self.step_dir(step)} did not commit; "
                             f"the newest complete checkpoint is intact", step)
        self._remove_leftovers()  # of an earlier failed save, written on after its failure was raised
        timing = self.manager.metadata(step)
        saved = ((timing.commit_timestamp_nsecs or 0) - (timing.init_timestamp_nsecs or 0)) / 1e9
        self._done.append(SaveRecord(step, blocked, max(saved, blocked)))

    def _discard(self, step: int) -> None:
        """After a failed save of `step`: remove its partial files (on the primary process, which owns the
        directory) and re-read the committed steps, since Orbax already dropped from its list the old steps
        the failed save would have retired (they are still on disk and must stay counted). Orbax reports
        the first item that failed while another may still be writing: the next commit removes again."""
        self._failed.add(step)
        self._remove_leftovers()
        self.manager.reload()

    def _remove_leftovers(self) -> None:
        if jax.process_index() == 0:
            for step in self._failed:
                for leftover in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                    shutil.rmtree(leftover, ignore_errors=True)

    def _writing(self) -> bool:
        return self.manager.is_saving_in_progress()

    def read_meta(self, step: int) -> dict[str, Any]:
        return self.manager.restore(step, args=ocp.args.Composite(meta=MetaRestore()))["meta"]

    def restore_state(self, step: int, target: Any) -> Any:
        """The `state` item of `step` restored straight into `target`'s shardings (ShapeDtypeStructs),
        each device reading only its own slices."""
        return self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target)))["state"]

    def restore_subtree(self, step: int, target: Any) -> Any:
        """Only the arrays named in `target` (e.g. {'params': ...}); the others are never read."""
        with ocp.PyTreeCheckpointer() as reader:
            return reader.restore(self.step_dir(step) / "state", args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True))

    def close(self) -> None:
        self.manager.close()
        self._remove_leftovers()
