"""The `data.*` settings resolved before anything is built: which token files a run reads (a prepared
DATADIR with meta.json, a mixture `DIR_A:0.7,DIR_B:0.3`, or a flat nanoGPT train.bin), their vocabulary,
dtype and tokenizer. Reads only small JSON files, so config validation can call it."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from typing import Any

import numpy as np

from mesh.errors import UserError, check_writable
from train.data import tokenizer

ORDERS = ("epochs", "random")
DTYPES = ("uint16", "uint32")
# A loss mask beside each token file (train.prepare --format=chat): one uint8 per token, 1 where the token is a
# target that counts, 0 where it is context only.
MASK_FILES = {"train": "train_mask.bin", "val": "val_mask.bin"}


class DataConfigError(UserError):
    """A data.* setting or prepared directory the user can fix; one line."""


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    name: str                 # for the epoch/<name> and share/<name> metrics
    train: pathlib.Path
    val: pathlib.Path | None  # None: hold out the tail of train (flat files without val.bin)
    weight: float
    meta: dict[str, Any] | None  # meta.json of a prepared DATADIR

    @property
    def masked(self) -> bool:
        """Whether the DATADIR carries a loss mask (train_mask.bin, val_mask.bin)."""
        return bool(self.meta and self.meta.get("loss_mask"))


@dataclasses.dataclass(frozen=True)
class DataSpec:
    sources: tuple[SourceSpec, ...]
    dtype: str
    vocab_size: int | None    # from meta.json; None for flat files
    tokenizer: pathlib.Path | None
    eos_id: int | None
    loss_mask: bool = False   # every source carries a loss mask (data.loss_mask trains on it)


def _split_mixture(path: str) -> list[tuple[str, float]]:
    parts = [p for p in path.split(",") if p]
    if len(parts) == 1 and ":" not in parts[0]:
        return [(parts[0], 1.0)]
    out = []
    for part in parts:
        where, _, weight = part.rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = -1.0
        if not where or not value > 0:
            raise DataConfigError(f"data.path={path!r}: a mixture is DIR:WEIGHT[,DIR:WEIGHT...] with positive "
                                  f"weights, e.g. 'data/web:0.7,data/code:0.3'")
        out.append((where, value))
    return out


def read_meta(directory: pathlib.Path, setting: str) -> dict[str, Any]:
    try:
        meta = json.loads((directory / "meta.json").read_text())
        assert meta["dtype"] in DTYPES and int(meta["vocab_size"]) > 0
        return meta
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise DataConfigError(f"{setting}: {directory / 'meta.json'} is damaged; run train.prepare again "
                              f"with --overwrite") from None


def _source(where: str, weight: float, setting: str, name: str) -> SourceSpec:
    p = pathlib.Path(where).expanduser()
    if p.is_dir():
        if not (p / "meta.json").is_file():
            raise DataConfigError(f"{setting}: {p} has no meta.json; prepare it with python -m train.prepare "
                                  f"--input=... --out={p}")
        meta = read_meta(p, setting)
        for split in ("train", "val"):
            f = p / f"{split}.bin"
            if not f.is_file():
                raise DataConfigError(f"{setting}: {f} is missing; run train.prepare again with --overwrite")
            _check_size(f, meta["dtype"], setting, meta.get(split, {}).get("tokens"))
            if meta.get("loss_mask"):
                mask = p / MASK_FILES[split]
                if not mask.is_file():
                    raise DataConfigError(f"{setting}: {mask} is missing; run train.prepare again with --overwrite")
                _check_size(mask, "uint8", setting, meta.get(split, {}).get("tokens"))
        if not (p / tokenizer.FILE).is_file():  # the run copies it beside its checkpoints
            raise DataConfigError(f"{setting}: {p / tokenizer.FILE} is missing; run train.prepare again with "
                                  f"--overwrite")
        _check_tokenizer(p / tokenizer.FILE, setting)
        _check_meta(p, meta, setting)
        return SourceSpec(name, p / "train.bin", p / "val.bin", weight, meta)
    if p.is_file():
        sibling = p.with_name("val.bin")
        return SourceSpec(name, p, sibling if sibling.is_file() and sibling != p else None, weight, None)
    raise DataConfigError(f"{setting}: no such DATADIR or token file; prepare one with python -m train.prepare")


def _check_size(path: pathlib.Path, dtype: str, setting: str, tokens: int | None) -> None:
    """A token file holds whole tokens, as many as meta.json counts (a copy cut short is caught here)."""
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    if size % itemsize:
        raise DataConfigError(f"{setting}: {path} has {size} bytes, not a whole number of {dtype} tokens; the file "
                              f"is damaged or has another dtype (data.token_dtype); prepare or copy it again")
    if tokens is not None and size != int(tokens) * itemsize:
        raise DataConfigError(f"{setting}: {path} holds {size // itemsize:,} tokens but its meta.json says "
                              f"{int(tokens):,}; the copy is incomplete or damaged: prepare or copy it again")


def _check_tokenizer(path: pathlib.Path, setting: str) -> None:
    try:
        tokenizer.load_file(str(path), setting)
    except tokenizer.TokenizerError:
        raise DataConfigError(f"{setting}: {path} is not a Hugging Face tokenizer.json (damaged?); run "
                              f"train.prepare again with --overwrite") from None


def _check_meta(directory: pathlib.Path, meta: dict[str, Any], setting: str) -> None:
    """What meta.json says agrees with itself and with the tokenizer.json beside it (cheap: no token is read)."""
    vocab, again = int(meta["vocab_size"]), "run train.prepare again with --overwrite"
    declared = meta.get("tokenizer_sha256")
    if declared and hashlib.sha256((directory / tokenizer.FILE).read_bytes()).hexdigest() != declared:
        raise DataConfigError(f"{setting}: {directory / tokenizer.FILE} is not the tokenizer the tokens were made "
                              f"with (its SHA-256 differs from meta.json's); restore that file, or {again}")
    ids = {"eos_id": meta.get("eos_id"), "bos_id": meta.get("bos_id"),
           **{f"{split}.max_id": meta.get(split, {}).get("max_id") for split in ("train", "val")}}
    for key, value in ids.items():
        if value is not None and not (isinstance(value, int) and -1 <= value < vocab):
            raise DataConfigError(f"{setting}: {directory / 'meta.json'} says {key}={value!r}, outside its "
                                  f"vocab_size={vocab}; the file is damaged: {again}")


def _names(paths: list[str]) -> list[str]:
    names = [pathlib.Path(p).name or "data" for p in paths]
    return [n if names.count(n) == 1 else f"{n}{i}" for i, n in enumerate(names)]


def _check_loss_mask(data: Any, sources: tuple[SourceSpec, ...] | None) -> bool:
    """data.loss_mask must match the data: training on a mask that is not there, or on every token of
    conversations prepared with one (the prompts too), is a mistake caught before the run."""
    wanted = bool(data.get("loss_mask", False))
    masked = {s.masked for s in sources or ()}
    if len(masked) > 1:
        raise DataConfigError(f"data.path={data.path!r}: some sources carry a loss mask (train.prepare "
                              f"--format=chat) and some do not; mix only sources prepared with the same --format")
    if wanted and masked != {True}:
        where = f"data.path={data.path!r} has" if sources else f"data.source={data.source} gives"
        raise DataConfigError(f"data.loss_mask=True: {where} no loss mask; prepare conversations with python -m "
                              f"train.prepare --format=chat, or set data.loss_mask=False")
    if masked == {True} and not wanted:
        raise DataConfigError(f"data.path={data.path!r} holds conversations with a loss mask, which "
                              f"data.loss_mask=False would ignore (training on the prompts too); set "
                              f"data.loss_mask=True, or prepare the data with --format=text")
    return wanted


def resolve(data: Any, global_batch: int | None) -> DataSpec | None:
    """Check the data.* settings; the token files a `tokens` source reads (None for other sources).
    `global_batch` (None: not checked) must give every mixture source at least one row per batch."""
    order = data.get("order", "epochs")
    if order not in ORDERS:
        raise DataConfigError(f"data.order={order!r}: use epochs (each window once per epoch) or random")
    if data.source != "tokens":
        _check_loss_mask(data, None)
        if data.source == "text" and "," in str(data.path):
            raise DataConfigError(f"data.path={data.path!r}: mixtures need data.source=tokens and prepared DATADIRs")
        if data.source == "text" and data.get("cache_dir"):  # written at the start of training: checked now
            check_writable("data.cache_dir", str(data.cache_dir), "directory", parents=True)
        return None
    if not data.path:
        raise DataConfigError("data.path='': the tokens source needs a DATADIR (python -m train.prepare) or a "
                              "flat token file (train.bin)")
    setting = f"data.path={data.path!r}"
    parts = _split_mixture(str(data.path))
    sources = tuple(_source(w, x, setting, n) for (w, x), n in zip(parts, _names([w for w, _ in parts])))
    total = sum(s.weight for s in sources)
    loss_mask = _check_loss_mask(data, sources)
    if len(sources) > 1:
        if any(s.meta is None for s in sources):
            raise DataConfigError(f"{setting}: every source of a mixture must be a DATADIR made by train.prepare")
        if len({s.meta.get("tokenizer_sha256") for s in sources}) > 1:
            raise DataConfigError(f"{setting}: the sources were prepared with different tokenizers; prepare them "
                                  f"with the same --tokenizer (e.g. hf:{sources[0].train.parent}/tokenizer.json)")
        for s in sources:
            if global_batch and s.weight / total * global_batch < 1:
                raise DataConfigError(f"{setting}: {s.name}'s weight {s.weight / total:.3f} gives less than one row "
                                      f"of train.global_batch_size={global_batch}; raise the weight or the batch")
    meta = sources[0].meta
    if meta is None:
        if data.token_dtype not in DTYPES:
            raise DataConfigError(f"data.token_dtype={data.token_dtype!r}: use uint16 or uint32")
        for f in (sources[0].train, sources[0].val):
            if f is not None:
                _check_size(f, data.token_dtype, setting, None)
        return DataSpec(sources, data.token_dtype, None, None, None)
    return DataSpec(sources, meta["dtype"], int(meta["vocab_size"]), sources[0].train.parent / "tokenizer.json",
                    meta.get("eos_id"), loss_mask)
