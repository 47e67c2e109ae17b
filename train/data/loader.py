"""Token sources and batches. The batch of step s is a pure function of (seed, s), so any step can be
replayed and a resumed run sees exactly the batches it would have seen; each process builds only the
rows its own devices hold.

Sources: `text` (bytes of a file or directory; by default the running interpreter's standard library),
`tokens` (a DATADIR of train.prepare, a mixture of them, or a flat nanoGPT train.bin; memory-mapped),
`synthetic` (random). `data.order=epochs` reads every window once per epoch (train/data/order.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import sysconfig
import zlib
from typing import Any

import jax
import numpy as np

from train.data import corpus, datadir
from train.data import order as order_lib
from train.exit_codes import ConfigError

EVAL_STREAM = 1 << 30  # eval batches draw from (seed, EVAL_STREAM + k): never a training step's stream


@dataclasses.dataclass(frozen=True)
class Stream:
    """One source's token arrays (memory-mapped or cached) and its epoch geometry."""
    name: str
    train: np.ndarray
    eval: np.ndarray
    train_mask: np.ndarray | None = None  # uint8 per token, 1 where the target counts (data.loss_mask)
    eval_mask: np.ndarray | None = None

    def window(self, split: str, start: int, length: int) -> np.ndarray:
        """int32 tokens [start, start + length) of a split; with a loss mask, a target that does not count is
        stored as -(id+1) (models/documents.py decodes it)."""
        tokens = np.asarray((self.train if split == "train" else self.eval)[start:start + length], dtype=np.int32)
        mask = self.train_mask if split == "train" else self.eval_mask
        if mask is None:
            return tokens
        return np.where(np.asarray(mask[start:start + length]) > 0, tokens, -tokens - 1)

    def windows(self, length: int) -> int:
        """Windows of `length` tokens starting at multiples of length - 1 (the remainder is dropped)."""
        return (len(self.train) - 1) // (length - 1)


@dataclasses.dataclass(frozen=True)
class TokenSource:
    name: str
    streams: tuple[Stream, ...]  # empty for synthetic
    vocab_size: int
    order: str = "epochs"        # or "random": windows at offsets drawn with replacement
    cumulative: tuple[int, ...] = (order_lib.WEIGHT_ONE,)  # mixture weights (train/order.integer_weights)

    @property
    def train(self) -> np.ndarray | None:
        return self.streams[0].train if self.streams else None

    @property
    def eval(self) -> np.ndarray | None:
        return self.streams[0].eval if self.streams else None

    def rows(self, seed: int, step: int, batch: int, length: int, rows: slice, split: str = "train") -> np.ndarray:
        """Rows `rows` of the [batch, length] token batch of `step`: a pure function of its arguments."""
        stream_step = step if split == "train" else EVAL_STREAM + step
        if not self.streams:
            rng = np.random.default_rng([seed, stream_step])
            return rng.integers(0, self.vocab_size, size=(batch, length), dtype=np.int32)[rows]
        counts = order_lib.rows_of_step(stream_step, batch, list(self.cumulative))
        before = order_lib.drawn_before(stream_step, batch, list(self.cumulative))
        wanted = np.arange(batch)[rows]
        out = np.empty((len(wanted), length), dtype=np.int32)
        first = 0
        for j, (stream, n) in enumerate(zip(self.streams, counts)):
            mine = (wanted >= first) & (wanted < first + n)
            if mine.any():
                tokens = stream.train if split == "train" else stream.eval
                if split == "train" and self.order == "epochs":
                    _, window = order_lib.epoch_windows(before[j] + wanted[mine] - first, stream.windows(length),
                                                        seed, stream=j)
                    starts = window * (length - 1)
                else:  # one source: exactly the draws of the releases before mixtures
                    rng = np.random.default_rng([seed, stream_step] + ([j] if len(self.streams) > 1 else []))
                    starts = rng.integers(0, len(tokens) - length, size=n)[wanted[mine] - first]
                out[mine] = np.stack([stream.window(split, s, length) for s in starts])
            first += n
        return out

    def progress(self, steps_done: int, batch: int, length: int) -> dict[str, float]:
        """What metrics.jsonl records about the data after `steps_done` steps: `epoch` (windows drawn over
        windows per epoch), and with a mixture `epoch/<source>` and the realized `share/<source>`."""
        if not self.streams:
            return {}
        drawn = order_lib.drawn_before(steps_done, batch, list(self.cumulative))
        epochs = [d / s.windows(length) for d, s in zip(drawn, self.streams)]
        if len(self.streams) == 1:
            return {"epoch": epochs[0]}
        total = max(sum(drawn), 1)
        return {**{f"epoch/{s.name}": e for s, e in zip(self.streams, epochs)},
                **{f"share/{s.name}": d / total for s, d in zip(self.streams, drawn)}}


def _cache_dir(setting: str) -> pathlib.Path:
    if setting:
        return pathlib.Path(setting)
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "spmdtrain"


def stdlib_files() -> list[pathlib.Path]:
    """The interpreter's own standard-library sources, sorted by path, without site-packages."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def _text_files(path: str) -> tuple[pathlib.Path, list[pathlib.Path]]:
    if not path:
        return pathlib.Path(sysconfig.get_paths()["stdlib"]), stdlib_files()
    root = pathlib.Path(path)
    if root.is_file():
        return root.parent, [root]
    if root.is_dir():
        files = corpus.files_under(root)  # no .git/
        if files:
            return root, files
    raise ConfigError(f"data.path={path!r}: no such text file or non-empty directory")


def _prepare_text(path: str, eval_percent: int, cache_setting: str) -> tuple[np.ndarray, np.ndarray]:
    """Bytes of every file, split into train/eval by a hash of each file's path; cached on disk as two byte
    files that are memory-mapped, keyed by a hash of the file list (paths, sizes, modification times)."""
    root, files = _text_files(path)
    listing = "\n".join(f"{p.relative_to(root)}\t{p.stat().st_size}\t{p.stat().st_mtime_ns}" for p in files)
    key = hashlib.sha256(f"{root}\n{eval_percent}\n{listing}".encode()).hexdigest()[:16]
    cache = _cache_dir(cache_setting) / f"text-{key}"
    paths = {k: cache.with_name(f"{cache.name}.{k}.bin") for k in ("train", "eval")}
    if all(p.exists() for p in paths.values()):
        return tuple(np.memmap(paths[k], dtype=np.uint8, mode="r") for k in ("train", "eval"))
    parts: dict[str, list[bytes]] = {"train": [], "eval": []}
    for p in files:
        held_out = zlib.crc32(str(p.relative_to(root)).encode()) % 100 < eval_percent
        parts["eval" if held_out else "train"].append(p.read_bytes())
    if not parts["eval"]:  # a single file or a tiny directory: hold out its tail instead
        data = b"".join(parts["train"])
        cut = len(data) - max(len(data) * eval_percent // 100, 1)
        parts = {"train": [data[:cut]], "eval": [data[cut:]]}
    cache.parent.mkdir(parents=True, exist_ok=True)
    for k in ("eval", "train"):  # train last: its presence marks a complete cache
        tmp = paths[k].with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(b"".join(parts[k]))
        os.replace(tmp, paths[k])  # atomic: concurrent processes may race to write the same cache
    return tuple(np.memmap(paths[k], dtype=np.uint8, mode="r") for k in ("train", "eval"))


def _map(path: pathlib.Path, dtype: str) -> np.ndarray:
    """A token file memory-mapped; an empty one (no held-out documents) as an empty array, which `load`
    reports as too little data rather than mmap failing."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _open_stream(source: datadir.SourceSpec, dtype: str, eval_percent: int) -> Stream:
    """A source's memory-mapped tokens, and its loss mask when it has one."""
    train, held = _open_tokens(source, dtype, eval_percent)
    if not source.masked:
        return Stream(source.name, train, held)
    where = source.train.parent
    masks = (_map(where / datadir.MASK_FILES[split], "uint8") for split in ("train", "val"))
    return Stream(source.name, train, held, *masks)


def _open_tokens(source: datadir.SourceSpec, dtype: str, eval_percent: int) -> tuple[np.ndarray, np.ndarray]:
    """Memory-mapped train and held-out tokens (val.bin, or the tail of a lone flat file)."""
    train = _map(source.train, dtype)
    if source.val is not None:
        return train, _map(source.val, dtype)
    cut = len(train) - max(len(train) * eval_percent // 100, 1)
    return train[:cut], train[cut:]


def largest_id(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    """The largest id of a memory-mapped array, read in chunks so RAM stays small."""
    return max((int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk)), default=-1)


def _scan(stream: Stream, source: datadir.SourceSpec, vocab_size: int) -> None:
    """One full read of a source's files, before anything compiles: every token id fits model.vocab_size and
    is no larger than the max_id its meta.json records (a token file from another tokenizer), and a loss mask
    holds only 0s and 1s (a damaged mask file)."""
    again = "the files do not match it: run train.prepare again with --overwrite"
    for split, tokens, mask in (("train", stream.train, stream.train_mask), ("val", stream.eval, stream.eval_mask)):
        top = largest_id(tokens)
        if top >= vocab_size:
            raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the data's token ids (up to {top} "
                              f"in {stream.name}); raise it")
        recorded = (source.meta or {}).get(split, {}).get("max_id")
        if recorded is not None and top > recorded:
            raise datadir.DataConfigError(f"data.path: {source.train.with_name(split + '.bin')} holds token id "
                                          f"{top}, above meta.json's {split}.max_id={recorded}; {again}")
        if mask is not None and largest_id(mask) > 1:
            raise datadir.DataConfigError(f"data.path: {source.train.with_name(datadir.MASK_FILES[split])} holds "
                                          f"bytes other than 0 and 1 (a damaged loss mask); {again}")


def load(data_cfg: Any, vocab_size: int, length: int, spec: datadir.DataSpec | None = None) -> TokenSource:
    """Open the configured source (`data_cfg`: Plan.data, or the data.* settings); `length` is the tokens
    per row (seq_len + 1); `spec` is the resolved token files (train/datadir.resolve; resolved here when not given)."""
    order = getattr(data_cfg, "order", "epochs")
    if data_cfg.source == "synthetic":
        return TokenSource("synthetic", (), vocab_size, order)
    if data_cfg.source == "text":
        train, held = _prepare_text(data_cfg.path, data_cfg.eval_percent, data_cfg.cache_dir)
        streams = (Stream("text", train, held),)
        cumulative = [order_lib.WEIGHT_ONE]
    else:
        spec = spec or datadir.resolve(data_cfg, None)
        streams = tuple(_open_stream(s, spec.dtype, data_cfg.eval_percent) for s in spec.sources)
        cumulative = order_lib.integer_weights([s.weight for s in spec.sources])
    # What sizes the held-out split: a DATADIR's val.bin comes from train.prepare, else data.eval_percent cuts it.
    val_files = data_cfg.source == "tokens" and all(s.val is not None for s in spec.sources)
    held_setting = "train.prepare --val_percent" if val_files else "data.eval_percent"
    for stream in streams:
        for split, arr in (("training", stream.train), ("held-out", stream.eval)):
            if len(arr) <= length:
                raise ConfigError(f"data.path={data_cfg.path!r}: the {split} split of {stream.name} has {len(arr)} "
                                  f"tokens, fewer than one row of {length}; use more data (or a larger "
                                  f"{held_setting}) or a shorter model.seq_len")
    if data_cfg.source == "tokens":
        for stream, source in zip(streams, spec.sources):
            _scan(stream, source, vocab_size)
    return TokenSource(data_cfg.source, streams, vocab_size, order, tuple(cumulative))


def copy_tokenizer(spec: datadir.DataSpec | None, workdir: pathlib.Path) -> None:
    """Put the data's tokenizer.json (and its EOS and BOS ids) in the workdir, where sampling and export look."""
    if spec is None or spec.tokenizer is None:
        return
    shutil.copyfile(spec.tokenizer, workdir / "tokenizer.json")
    bos_id = (spec.sources[0].meta or {}).get("bos_id")
    (workdir / "data_meta.json").write_text(json.dumps({"eos_id": spec.eos_id, "bos_id": bos_id,
                                                        "vocab_size": spec.vocab_size, "dtype": spec.dtype}) + "\n")


def global_batch(source: TokenSource, sharding: jax.sharding.Sharding, seed: int, step: int,
                 batch: int, length: int, split: str = "train") -> jax.Array:
    """The [batch, length] int32 batch of `step` as a global array; each process fills only the
    shards of its own devices."""
    def shard(index: tuple[slice, ...]) -> np.ndarray:
        rows = source.rows(seed, step, batch, length, index[0], split)
        return rows[:, index[1]] if len(index) > 1 else rows
    return jax.make_array_from_callback((batch, length), sharding, shard)
