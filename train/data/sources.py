"""Where train.prepare's inputs live, and how their bytes are read: local files and directories, remote paths
through fsspec (`s3://`, `gs://`, `https://`, `memory://`, ... whichever filesystems are installed), compressed
files (.gz, .bz2, .xz, .zst, decompressed as they stream), and Hugging Face datasets (`hf:NAME_OR_DIR[:SPLIT]`:
a `save_to_disk` folder, a local folder of JSON/Parquet/text, or a Hub name), streamed: nothing is held whole."""
from __future__ import annotations

import bz2
import dataclasses
import gzip
import hashlib
import importlib
import importlib.util
import io
import logging
import lzma
import pathlib
from typing import IO, Any, Iterator

from mesh.errors import UserError
from train.runtime import extras, hub

HF = "hf:"
COMPRESSED = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstandard"}


class CorpusError(UserError):
    """Bad input: names the input (file, line, dataset) and what is wrong; one line."""


@dataclasses.dataclass(frozen=True)
class Input:
    """One input: a file (`where` a local path or an fsspec URL) or a Hugging Face dataset (`where` hf:...)."""
    where: str
    size: int  # bytes; 0 when unknown (a Hub dataset)

    @property
    def is_dataset(self) -> bool:
        return self.where.startswith(HF)

    @property
    def name(self) -> str:
        """The file name without its compression suffix: what says its format (a.jsonl.zst -> a.jsonl)."""
        name = self.where.rstrip("/").rsplit("/", 1)[-1].lower()
        suffix = next((s for s in COMPRESSED if name.endswith(s)), "")
        return name[:len(name) - len(suffix)] if suffix else name

    @property
    def compression(self) -> str | None:
        return next((c for s, c in COMPRESSED.items() if self.where.lower().endswith(s)), None)


def is_url(path: str) -> bool:
    return "://" in path and not path.startswith(HF)


def expand(raw: str, files_under) -> list[Input]:
    """The inputs one --input names: a dataset, or the files of a path or URL (directories walked)."""
    if raw.startswith(HF):
        return [Input(raw, 0)]
    if is_url(raw):
        return _remote(raw)
    p = pathlib.Path(raw).expanduser()
    if p.is_file():
        return [Input(str(p), p.stat().st_size)]
    if p.is_dir():
        return [Input(str(f), f.stat().st_size) for f in files_under(p, skip_dirs=("__pycache__",))]
    raise CorpusError(f"--input={raw}: no such file or directory")


def _filesystem(url: str):
    fsspec = extras.load("fsspec", f"--input={url} (a remote path)")
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:  # an unknown protocol, or its filesystem package missing
        raise CorpusError(f"--input={url}: {e}") from None


def _remote(url: str) -> list[Input]:
    fs, root = _filesystem(url)
    if fs.isdir(root):
        found = sorted(p for p in fs.find(root) if not any(part.startswith(".") for part in p.split("/")))
    elif fs.exists(root):
        found = [root]
    else:
        raise CorpusError(f"--input={url}: no such file or directory")
    return [Input(fs.unstrip_protocol(p), int(fs.size(p) or 0)) for p in found]


def fingerprint(item: Input) -> dict[str, Any]:
    """What identifies an input's content for a rerun: a file's size and SHA-256 (a remote file's: the checksum its
    filesystem reports, from its metadata); a dataset's fingerprint, or its name alone for a Hub dataset."""
    if item.is_dataset:
        return {"path": item.where, "size": item.size, "fingerprint": dataset_fingerprint(item.where)}
    if is_url(item.where):
        fs, path = _filesystem(item.where)
        return {"path": item.where, "size": item.size, "checksum": str(fs.checksum(path))}
    digest = hashlib.sha256()
    with open_raw(item) as f:  # the file as stored: compressed files are hashed without decompressing
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return {"path": str(pathlib.Path(item.where).resolve()), "size": item.size, "sha256": digest.hexdigest()}


def open_raw(item: Input) -> IO[bytes]:
    """The file's bytes as stored (still compressed)."""
    try:
        if is_url(item.where):
            fs, path = _filesystem(item.where)
            return fs.open(path, "rb")
        return open(item.where, "rb")
    except OSError as e:
        raise CorpusError(f"{item.where}: cannot read it ({e.strerror or e})") from None


def open_bytes(item: Input) -> IO[bytes]:
    """The file's bytes, decompressed as they are read."""
    raw = open_raw(item)
    kind = item.compression
    if kind == "gzip":
        return gzip.GzipFile(fileobj=raw)
    if kind == "bzip2":
        return bz2.BZ2File(raw)
    if kind == "xz":
        return lzma.LZMAFile(raw)
    if kind == "zstandard":
        zstd = extras.load("zstandard", f"--input={item.where} (.zst)")
        return io.BufferedReader(zstd.ZstdDecompressor().stream_reader(raw, closefd=True))
    return raw


def read_errors() -> tuple[type[BaseException], ...]:
    """What a damaged compressed stream raises while it is read (zstandard's own error where it is installed)."""
    zstd = (importlib.import_module("zstandard").ZstdError,) if importlib.util.find_spec("zstandard") else ()
    return (OSError, EOFError, lzma.LZMAError, ValueError, *zstd)


def _dataset_parts(spec: str) -> tuple[str, str]:
    """hf:NAME_OR_DIR[:SPLIT] -> (NAME_OR_DIR, SPLIT, default train)."""
    body = spec[len(HF):]
    name, _, split = body.rpartition(":") if ":" in body else (body, "", "")
    return (name, split) if name and split else (body, "train")


def _saved(path: str) -> bool:
    p = pathlib.Path(path).expanduser()
    return p.is_dir() and any((p / f).is_file() for f in ("dataset_info.json", "dataset_dict.json", "state.json"))


def dataset_fingerprint(spec: str) -> str:
    name, split = _dataset_parts(spec)
    if _saved(name):
        return str(getattr(_load_saved(spec, name, split), "_fingerprint", ""))
    return ""  # a Hub or folder dataset streams: it is named by name and split only


def _datasets(spec: str):
    """The `datasets` library, its own log lines and progress bars off: what a bad input gets is this project's
    one line (the Hub client's retries and warnings would come first)."""
    logging.getLogger("datasets").setLevel(logging.ERROR)  # before the import, which logs the versions it found
    hub.go_offline_if_unreachable()  # also before it: offline, a Hub name fails at once instead of after retries
    datasets = extras.load("datasets", f"--input={spec}")
    datasets.logging.set_verbosity_error()
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # after: its import sets its own level
    datasets.disable_progress_bars()
    return datasets


def _load_saved(spec: str, name: str, split: str):
    datasets = _datasets(spec)
    data = datasets.load_from_disk(str(pathlib.Path(name).expanduser()))
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise CorpusError(f"--input={spec}: no split {split!r} (it has {', '.join(data)}); write hf:DIR:SPLIT")
        data = data[split]
    return data


def dataset_rows(spec: str, field: str) -> Iterator[str]:
    """The `field` of every row of a dataset, streamed (a saved one memory-mapped, batch by batch)."""
    name, split = _dataset_parts(spec)
    datasets = _datasets(spec)
    if _saved(name):
        rows = _load_saved(spec, name, split).iter(batch_size=1024)
        batches = (batch.get(field) for batch in rows)
    else:
        try:
            stream = datasets.load_dataset(name, split=split, streaming=True)
        except Exception as e:  # noqa: BLE001  (datasets raises many types: missing, unreachable, bad split)
            offline = f"; {hub.note()}" if hub.note() else ""
            raise CorpusError(f"--input={spec}: cannot load it ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}){offline}") from None
        batches = ([row.get(field)] for row in stream)
    for values in batches:
        if values is None:
            raise CorpusError(f"--input={spec}: no field {field!r} in its rows; set --text_field")
        for text in values:
            if not isinstance(text, str):
                raise CorpusError(f"--input={spec}: field {field!r} holds {type(text).__name__}, not text; "
                                  f"set --text_field")
            yield text
