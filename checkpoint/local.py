"""The local tier: frequent checkpoints on node-local storage (checkpoint.local_dir), each process writing the shards
it holds as one raw file and a manifest with the persistent tier's checksums, in a background thread, plus a copy of
its neighbour's (peer.py); renaming a step's folder commits it. Why not Orbax's emergency one: see LocalCheckpoints."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import threading
import time
from typing import Any

import jax
import numpy as np

from checkpoint import collective, integrity, peer, plain
from checkpoint import meta as meta_lib
from checkpoint.errors import SaveFailed
from checkpoint.manager import OneSaveInFlight, SaveRecord, brief

KEEP = 2  # the newest committed steps kept: one to restore while the next is written, one more if it is damaged
MANIFEST, DATA = "manifest.json", "shards.bin"
TMP = ".tmp"


class Unusable(Exception):
    """A local step that cannot be restored (unreadable, damaged, or written for another layout)."""


def run_folder(local_dir: str | pathlib.Path, workdir: str | pathlib.Path) -> pathlib.Path:
    """LOCAL_DIR/<workdir's name>-<hash of its absolute path>: runs sharing a local_dir never meet."""
    workdir = pathlib.Path(workdir).expanduser().absolute()
    digest = hashlib.sha1(str(workdir).encode()).hexdigest()[:10]
    return pathlib.Path(local_dir).expanduser().absolute() / f"{workdir.name}-{digest}"


def process_folder(root: pathlib.Path, process: int, count: int) -> pathlib.Path:
    """What process `process` of `count` keeps on its node: own/ (its shards) and peer/ (process (i+1) % n's).
    Another process count finds none of it, and the persistent tier reshards."""
    return root / f"process_{process}_of_{count}"


def _index(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[list[int]]:
    """A shard's slices as [[start, stop], ...], the key a restore looks a device's shard up by."""
    return [[s.start or 0, dim if s.stop is None else s.stop] for s, dim in zip(index, shape)]


def host_shards(tree: Any) -> list[tuple[str, list[list[int]], np.ndarray]]:
    """(name, index, host copy) of every distinct shard this process holds: the data a restore on the same
    layout needs here. Copied, since the next step may reuse (donate) the device buffers."""
    out = []
    for name, x in plain.flatten(tree).items():
        seen = set()
        for shard in x.addressable_shards:
            index = _index(shard.index, x.shape)
            key = json.dumps(index)
            if key in seen:
                continue
            seen.add(key)
            data = np.asarray(shard.data)
            out.append((name, index, data if data.flags.owndata else data.copy()))
    return out


def _fsynced(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def layout(shards: list) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """(the manifest's shard entries with their offsets in the data file, the arrays in that order)."""
    entries, chunks, offset = [], [], 0
    for name, index, data in shards:
        data = data if data.flags.c_contiguous else np.ascontiguousarray(data).reshape(data.shape)  # keeps 0-d
        entries.append({"name": name, "index": index, "dtype": str(data.dtype), "offset": offset,
                        "shape": list(data.shape)})
        chunks.append(data)
        offset += data.nbytes
    return entries, chunks


def write_step(folder: pathlib.Path, step: int, entries: list, chunks: list[np.ndarray], meta: dict[str, Any]) -> None:
    """Write `step` into FOLDER/<step>.tmp, then rename it to FOLDER/<step>: the commit."""
    tmp = folder / f"{step}{TMP}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / DATA, "wb") as f:
        for data in chunks:
            data.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    (tmp / MANIFEST).write_text(json.dumps({**meta, "shards": entries}))
    _fsynced(tmp / MANIFEST)
    final = folder / str(step)
    shutil.rmtree(final, ignore_errors=True)  # the same step saved again after a restore from an older one
    os.replace(tmp, final)
    _fsynced(folder)


def read_files(step_dir: pathlib.Path) -> tuple[dict[str, Any], np.ndarray]:
    """(manifest, the data file's bytes, mapped); raises Unusable."""
    try:
        meta = json.loads((step_dir / MANIFEST).read_text())
        blob = np.memmap(step_dir / DATA, dtype=np.uint8, mode="r") if (step_dir / DATA).stat().st_size else \
            np.zeros(0, np.uint8)
        if not isinstance(meta.get("shards"), list) or not isinstance(meta.get("arrays"), dict):
            raise ValueError("no shards or arrays listed")
    except Exception as e:  # noqa: BLE001  (missing, truncated, not JSON)
        raise Unusable(f"its manifest or data does not read ({type(e).__name__})") from None
    return meta, blob


def read_shards(meta: dict[str, Any], blob: np.ndarray, target: Any, where: str) -> Any:
    """The arrays of `target` (ShapeDtypeStructs in their shardings) from this process's shards; raises
    Unusable. Collective-free: the caller agrees with the other processes before verifying."""
    found = {(e["name"], json.dumps(e["index"])): e for e in meta["shards"]}
    try:
        meta_lib.check_compatible(meta, target, where)
    except Exception as e:  # noqa: BLE001
        raise Unusable(str(e)) from None
    flat = {}
    for name, want in plain.flatten(target).items():
        pieces = []
        for device, index in want.sharding.addressable_devices_indices_map(want.shape).items():
            entry = found.get((name, json.dumps(_index(index, want.shape))))
            if entry is None:
                raise Unusable(f"it holds no shard {_index(index, want.shape)} of {name} for this layout")
            dtype = np.dtype(jax.numpy.dtype(entry["dtype"]))
            count = int(np.prod(entry["shape"], dtype=np.int64))
            if entry["offset"] + count * dtype.itemsize > blob.size:
                raise Unusable(f"its data file is truncated (in {name})")
            host = np.frombuffer(blob, dtype, count, entry["offset"]).reshape(entry["shape"])
            pieces.append(jax.device_put(host, device))
        flat[name] = jax.make_array_from_single_device_arrays(want.shape, want.sharding, pieces)
    return plain.nest(flat)


def verify(tree: Any, meta: dict[str, Any]) -> None:
    """Every array's checksum (computed on the devices, across processes) against the manifest's."""
    bad = integrity.mismatches(tree, {name: entry["checksum"] for name, entry in meta["arrays"].items()})
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise Unusable(f"checksum mismatch in {bad[0]}{more}")


class LocalCheckpoints(OneSaveInFlight):
    """This process's local steps of one run: async saves, one in flight, the newest KEEP kept.

    Not Orbax's experimental emergency checkpointer, which needs at least two data-parallel replicas (a run on one
    process, or with one model replica over every device, has none), writes the persistent tier itself from replica
    0 only (replacing this project's, with its checksums, fallback and resharding restore), and carries no checksums.
    """

    def __init__(self, local_dir: str | pathlib.Path, workdir: str | pathlib.Path, keep: int = KEEP):
        self.root = run_folder(local_dir, workdir)
        node = process_folder(self.root, jax.process_index(), jax.process_count())
        self.directory, self.peer_dir = node / "own", node / "peer"  # peer: process (i+1) % n's steps
        self.keep = keep
        self._inflight: tuple[int, float, threading.Thread] | None = None  # (step, blocked seconds, writer)
        self._started = self._committed = 0.0  # perf_counter at the save's start and at its commit
        self._error: BaseException | None = None
        self._done: list[SaveRecord] = []

    def steps(self, folder: pathlib.Path | None = None) -> list[int]:
        """Committed steps (of this process's own folder, or `folder`), oldest first."""
        folder = folder or self.directory
        if not folder.is_dir():
            return []
        return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and (p / MANIFEST).is_file())

    def step_dir(self, step: int) -> pathlib.Path:
        return self.directory / str(step)

    def save(self, step: int, tree: Any, info: dict[str, Any],
             checksums: tuple[list[str], Any] | None = None, waited_s: float = 0.0) -> float:
        """Like Checkpoints.save: blocks while this process's shards are copied to host memory, then writes
        them in a background thread. Returns the seconds blocked (with `waited_s` and the previous save's wait)."""
        start = time.perf_counter() - waited_s
        if self._inflight is not None:
            self._finish()
        self._started = start
        names, sums = checksums or integrity.device_checksums(tree)
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
        entries, chunks = layout(host_shards(tree))
        # The copy for the neighbour is dispatched here, on the caller's thread, so that every process issues
        # its collectives in the same order as the train steps'.
        moved = peer.send(peer.pack({"shards": entries}, chunks), toward=1)[0] if jax.process_count() > 1 else None
        self._error = None
        thread = threading.Thread(target=self._write, args=(step, (entries, chunks, moved), shapes, info,
                                                            (names, sums)),
                                  name=f"local-checkpoint-{step}", daemon=True)
        thread.start()
        blocked = time.perf_counter() - start
        self._inflight = (step, blocked, thread)
        return blocked

    def _write(self, step: int, data: tuple, shapes: Any, info: dict[str, Any], checksums: tuple) -> None:
        """Own shards, then the neighbour's copy (its arrays' meta is the same: the checksums are global)."""
        entries, chunks, moved = data
        try:
            meta = meta_lib.build(shapes, integrity.to_hex(*checksums), step=step, **info)
            write_step(self.directory, step, entries, chunks, meta)
            if moved is not None:
                header, blob = peer.unpack(peer.received(moved))
                size = sum(int(np.prod(e["shape"], dtype=np.int64)) * np.dtype(jax.numpy.dtype(e["dtype"])).itemsize
                           for e in header["shards"])
                write_step(self.peer_dir, step, header["shards"], [blob[:size]], meta)
            for folder in (self.directory, self.peer_dir):
                for old in self.steps(folder)[:-self.keep]:
                    shutil.rmtree(folder / str(old), ignore_errors=True)
            self._committed = time.perf_counter()
        except BaseException as e:  # noqa: BLE001  (raised on the caller's thread by the next poll or wait)
            self._error = e

    def _finish(self) -> None:
        step, blocked, thread = self._inflight
        thread.join()
        self._inflight = None
        if self._error is not None:
            error, self._error = self._error, None
            for folder in (self.directory, self.peer_dir):
                shutil.rmtree(folder / f"{step}{TMP}", ignore_errors=True)
            raise SaveFailed(f"local save of {self.step_dir(step)} failed ({brief(error)}); check the space and "
                             f"permissions of checkpoint.local_dir", step) from error
        self._done.append(SaveRecord(step, blocked, max(self._committed - self._started, blocked)))

    def _writing(self) -> bool:
        return self._inflight[2].is_alive()

    def restorable(self) -> list[int]:
        """Steps every process can restore, from its own folder or its neighbour's copy (collective)."""
        return collective.restorable_steps(self.steps(), self.steps(self.peer_dir))

    def fetch(self, step: int) -> tuple[dict[str, Any], np.ndarray]:
        """(manifest, data) of this process's shards of `step`: its own, or, when some process lacks its own
        (a replaced node), the copy its neighbour keeps, sent back around the ring. Collective with several
        processes; raises Unusable after the others' exchange, so that every process meets in it."""
        own, error = None, None
        try:
            own = read_files(self.step_dir(step))
        except Unusable as e:
            error = e
        if jax.process_count() == 1 or collective.everyone(own is not None):
            if own is None:
                raise error
            return own
        try:
            meta, blob = read_files(self.peer_dir / str(step))
            held = peer.pack({**meta, "copied_from": jax.process_index()}, [np.asarray(blob)])
        except Unusable:
            held = np.zeros(0, np.uint8)
        got = peer.received(peer.send(held, toward=-1)[0])  # process p receives what p-1 keeps of it
        if own is not None:
            return own
        meta, blob = peer.unpack(got)
        if not meta:
            raise Unusable(f"{error}, and its neighbour keeps no copy of it")
        return meta, blob

    def set_aside(self, step: int, reason: str) -> pathlib.Path | None:
        """Move a damaged step out of the list (kept for inspection, at most one per step); None where this
        process has no copy of its own."""
        dest = self.directory / f"{step}.damaged"
        if not self.step_dir(step).is_dir():
            return None
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(self.step_dir(step), dest)
        (dest / "REASON.txt").write_text(reason + "\n")
        return dest
