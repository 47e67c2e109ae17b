"""The documents of `train.prepare`'s inputs: a text file is one document, a JSONL line or a Parquet row is
one (its `text_field`). Every problem is a one-line CorpusError naming the file (and line)."""
from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Iterator

from mesh.errors import UserError
from train.runtime import extras

PARQUET = (".parquet", ".pq")
JSONL = (".jsonl", ".ndjson")


class CorpusError(UserError):
    """Bad input: names the file (and line) and what is wrong."""


def files_under(root: pathlib.Path, skip_dirs: tuple[str, ...] = ()) -> list[pathlib.Path]:
    """Every file below `root` in sorted order, without hidden entries (.git/) or folders named in `skip_dirs`;
    the one directory walk of the text sources (train/data/loader.py) and of train.prepare's inputs."""
    return sorted(f for f in root.rglob("*") if f.is_file()
                  and not any(part.startswith(".") or part in skip_dirs for part in f.relative_to(root).parts))


def input_files(paths: list[str]) -> list[pathlib.Path]:
    """Files of every input path; directories walked without hidden entries or Python's bytecode caches
    (`__pycache__`: a source tree's compiled files are never text)."""
    files: list[pathlib.Path] = []
    for raw in paths:
        p = pathlib.Path(raw).expanduser()
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files += files_under(p, skip_dirs=("__pycache__",))
        else:
            raise CorpusError(f"--input={raw}: no such file or directory")
    if not files:
        raise CorpusError(f"--input={','.join(paths)}: no files there; the corpus is empty")
    parquet = next((f for f in files if f.name.lower().endswith(PARQUET)), None)
    if parquet:
        extras.check("pyarrow", f"--input={parquet} (Parquet)")
    return files


def checksum(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    except OSError as e:
        raise CorpusError(f"{path}: cannot read it ({e.strerror})") from None
    return digest.hexdigest()


def documents(path: pathlib.Path, text_field: str) -> Iterator[str]:
    """The documents of one file, in order."""
    name = path.name.lower()
    if name.endswith(PARQUET):
        yield from _parquet(path, text_field)
    elif name.endswith(JSONL):
        yield from _jsonl(path, text_field)
    else:
        try:
            yield path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorpusError(f"{path}: not UTF-8 text (byte {e.start}); convert it or leave it out") from None
        except OSError as e:
            raise CorpusError(f"{path}: cannot read it ({e.strerror})") from None


def _jsonl(path: pathlib.Path, field: str) -> Iterator[str]:
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    raise CorpusError(f"{path}:{number}: not UTF-8; convert the file") from None
                except ValueError as e:
                    raise CorpusError(f"{path}:{number}: not a JSON object ({e.msg}); fix or remove the line") from None
                text = record.get(field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise CorpusError(f"{path}:{number}: no string field {field!r}; set --text_field to the "
                                      f"field holding the text")
                yield text
    except OSError as e:
        raise CorpusError(f"{path}: cannot read it ({e.strerror})") from None


def _parquet(path: pathlib.Path, field: str) -> Iterator[str]:
    pq = extras.load("pyarrow.parquet", f"--input={path} (Parquet)")
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001  (pyarrow raises several types for a damaged file)
        raise CorpusError(f"{path}: not a readable Parquet file ({type(e).__name__}); regenerate it") from None
    if field not in table.schema_arrow.names:
        raise CorpusError(f"{path}: no column {field!r} (columns: {', '.join(table.schema_arrow.names)}); "
                          f"set --text_field")
    for batch in table.iter_batches(batch_size=1024, columns=[field]):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise CorpusError(f"{path}: column {field!r} holds {type(text).__name__}, not text")
            yield text
