"""Token sources and batches. The batch of step s is a pure function of (seed, s), so any step can be
replayed and a resumed run sees exactly the batches it would have seen; each process builds only the
rows its own devices hold.

Sources: `text` (bytes of a file or directory; by default the running interpreter's standard library),
`tokens` (a flat uint16/uint32 token file, nanoGPT's train.bin, memory-mapped), `synthetic` (random).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import sysconfig
import zlib
from typing import Any

import jax
import numpy as np

from train.config import ConfigError

EVAL_STREAM = 1 << 30  # eval batches draw from (seed, EVAL_STREAM + k): never a training step's stream


@dataclasses.dataclass(frozen=True)
class TokenSource:
    name: str
    train: np.ndarray | None  # 1-D token arrays; None for synthetic
    eval: np.ndarray | None
    vocab_size: int

    def rows(self, seed: int, step: int, batch: int, length: int, rows: slice, split: str = "train") -> np.ndarray:
        """Rows `rows` of the [batch, length] token batch of `step`: a pure function of its arguments."""
        rng = np.random.default_rng([seed, step if split == "train" else EVAL_STREAM + step])
        if self.train is None:
            return rng.integers(0, self.vocab_size, size=(batch, length), dtype=np.int32)[rows]
        tokens = self.train if split == "train" else self.eval
        starts = rng.integers(0, len(tokens) - length, size=batch)[rows]
        return np.stack([np.asarray(tokens[s:s + length], dtype=np.int32) for s in starts])


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
        files = sorted(p for p in root.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(root).parts))  # no .git/
        if files:
            return root, files
    raise ConfigError(f"data.path={path!r}: no such text file or non-empty directory")


def _prepare_text(path: str, eval_percent: int, cache_setting: str) -> tuple[np.ndarray, np.ndarray]:
    """Bytes of every file, split into train/eval by a hash of each file's path; cached on disk, keyed
    by a hash of the file list (paths, sizes, modification times), since the corpus differs between Pythons."""
    root, files = _text_files(path)
    listing = "\n".join(f"{p.relative_to(root)}\t{p.stat().st_size}\t{p.stat().st_mtime_ns}" for p in files)
    key = hashlib.sha256(f"{root}\n{eval_percent}\n{listing}".encode()).hexdigest()[:16]
    cache = _cache_dir(cache_setting) / f"text-{key}.npz"
    if cache.exists():
        with np.load(cache) as saved:
            return saved["train"], saved["eval"]
    parts: dict[str, list[bytes]] = {"train": [], "eval": []}
    for p in files:
        held_out = zlib.crc32(str(p.relative_to(root)).encode()) % 100 < eval_percent
        parts["eval" if held_out else "train"].append(p.read_bytes())
    if not parts["eval"]:  # a single file or a tiny directory: hold out its tail instead
        data = b"".join(parts["train"])
        cut = len(data) - max(len(data) * eval_percent // 100, 1)
        parts = {"train": [data[:cut]], "eval": [data[cut:]]}
    train, held = (np.frombuffer(b"".join(parts[k]), dtype=np.uint8) for k in ("train", "eval"))
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp.npz")
    np.savez(tmp, train=train, eval=held)
    os.replace(tmp, cache)  # atomic: concurrent processes may race to write the same cache
    return train, held


def _prepare_tokens(path: str, dtype: str, eval_percent: int) -> tuple[np.ndarray, np.ndarray]:
    if not path or not pathlib.Path(path).is_file():
        raise ConfigError(f"data.path={path!r}: the tokens source needs an existing flat token file (train.bin)")
    if dtype not in ("uint16", "uint32"):
        raise ConfigError(f"data.token_dtype={dtype!r}: use uint16 or uint32")
    train = np.memmap(path, dtype=dtype, mode="r")
    sibling = pathlib.Path(path).with_name("val.bin")
    if sibling.is_file() and sibling != pathlib.Path(path):
        return train, np.memmap(sibling, dtype=dtype, mode="r")
    cut = len(train) - max(len(train) * eval_percent // 100, 1)
    return train[:cut], train[cut:]


def load(data_cfg: Any, vocab_size: int, length: int) -> TokenSource:
    """Open the configured source; `length` is the tokens per row (seq_len + 1)."""
    if data_cfg.source == "synthetic":
        return TokenSource("synthetic", None, None, vocab_size)
    if data_cfg.source == "text":
        train, held = _prepare_text(data_cfg.path, data_cfg.eval_percent, data_cfg.cache_dir)
    else:
        train, held = _prepare_tokens(data_cfg.path, data_cfg.token_dtype, data_cfg.eval_percent)
    for split, arr in (("training", train), ("held-out", held)):
        if len(arr) <= length:
            raise ConfigError(f"data.path={data_cfg.path!r}: the {split} split has {len(arr)} tokens, "
                              f"fewer than one row of {length}; use more data or a shorter model.seq_len")
    if int(train[: 1 << 20].max()) >= vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the data's token ids; raise it")
    return TokenSource(data_cfg.source, train, held, vocab_size)


def global_batch(source: TokenSource, sharding: jax.sharding.Sharding, seed: int, step: int,
                 batch: int, length: int, split: str = "train") -> jax.Array:
    """The [batch, length] int32 batch of `step` as a global array; each process fills only the
    shards of its own devices."""
    def shard(index: tuple[slice, ...]) -> np.ndarray:
        rows = source.rows(seed, step, batch, length, index[0], split)
        return rows[:, index[1]] if len(index) > 1 else rows
    return jax.make_array_from_callback((batch, length), sharding, shard)
