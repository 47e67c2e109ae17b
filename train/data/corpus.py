"""The documents of `train.prepare`'s inputs: a JSONL line, a Parquet row or a dataset row is one (its
`text_field`); a text file is one, or one per paragraph or line (`--text_split`). Where the inputs live and how
they are decompressed is train/data/sources.py. Every problem is a one-line CorpusError naming the file (and line)."""
from __future__ import annotations

import json
import pathlib
import re
from typing import Iterator

from train.data import sources
from train.runtime import extras

PARQUET = (".parquet", ".pq")
JSONL = (".jsonl", ".ndjson")
TEXT_SPLITS = ("file", "blank_lines", "lines")
BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n\s*")  # a line break, one or more blank lines, what follows them


CorpusError = sources.CorpusError  # every bad input, wherever it lives


def files_under(root: pathlib.Path, skip_dirs: tuple[str, ...] = ()) -> list[pathlib.Path]:
    """Every file below `root` in sorted order, without hidden entries (.git/) or folders named in `skip_dirs`;
    the one directory walk of the text sources (train/data/loader.py) and of train.prepare's inputs."""
    return sorted(f for f in root.rglob("*") if f.is_file()
                  and not any(part.startswith(".") or part in skip_dirs for part in f.relative_to(root).parts))


def inputs(paths: list[str]) -> list[sources.Input]:
    """Every input of --input: files of each path or fsspec URL (directories walked without hidden entries or
    Python's bytecode caches: `__pycache__` holds no text), and Hugging Face datasets (hf:...)."""
    found = [item for raw in paths for item in sources.expand(raw, files_under)]
    if not found:
        raise CorpusError(f"--input={','.join(paths)}: no files there; the corpus is empty")
    parquet = next((i for i in found if i.name.endswith(PARQUET)), None)
    if parquet:
        extras.check("pyarrow", f"--input={parquet.where} (Parquet)")
    return found


def checksum(path: pathlib.Path) -> str:
    """SHA-256 of a local file."""
    return sources.fingerprint(sources.Input(str(path), 0))["sha256"]


def documents(item: sources.Input, text_field: str, text_split: str = "file") -> Iterator[str]:
    """The documents of one input, in order: a dataset's rows, a Parquet file's rows, a JSONL file's lines, or a
    text file as one document (`file`), split at blank lines (`blank_lines`) or one per non-empty line (`lines`)."""
    if item.is_dataset:
        yield from sources.dataset_rows(item.where, text_field)
    elif item.name.endswith(PARQUET):
        yield from _parquet(item, text_field)
    elif item.name.endswith(JSONL):
        yield from _jsonl(item, text_field)
    else:
        yield from split_text(_text(item), text_split)


def _text(item: sources.Input) -> str:
    try:
        with sources.open_bytes(item) as f:
            return f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{item.where}: not UTF-8 text (byte {e.start}); convert it or leave it out") from None
    except sources.read_errors() as e:
        raise CorpusError(f"{item.where}: cannot read it ({_why(e)})") from None


def _why(e: BaseException) -> str:
    """A read error in a few words: the OS's reason, else the first line of the message, else its type."""
    text = getattr(e, "strerror", None) or str(e)
    return text.splitlines()[0] if text else type(e).__name__


def split_text(text: str, how: str) -> Iterator[str]:
    """`file`: the text is one document; `blank_lines`: paragraphs separated by blank lines; `lines`: each line.
    Empty pieces are no documents."""
    if how == "file":
        pieces = [text]
    elif how == "blank_lines":
        pieces = BLANK_LINES.split(text)
    elif how == "lines":
        pieces = text.splitlines()
    else:
        raise CorpusError(f"--text_split={how}: use one of {', '.join(TEXT_SPLITS)}")
    yield from (p for p in pieces if p.strip())


def jsonl_records(item: sources.Input) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of every non-blank line of a JSONL input; a line that is not UTF-8 JSON or an
    unreadable file is a CorpusError naming the place."""
    path = item.where
    try:
        with sources.open_bytes(item) as f:
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    yield number, json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    raise CorpusError(f"{path}:{number}: not UTF-8; convert the file") from None
                except ValueError as e:
                    raise CorpusError(f"{path}:{number}: not a JSON object ({e.msg}); fix or remove the line") from None
    except sources.read_errors() as e:
        raise CorpusError(f"{path}: cannot read it ({_why(e)})") from None


def _jsonl(item: sources.Input, field: str) -> Iterator[str]:
    for number, record in jsonl_records(item):
        text = record.get(field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise CorpusError(f"{item.where}:{number}: no string field {field!r}; set --text_field to the "
                              f"field holding the text")
        yield text


def _parquet(item: sources.Input, field: str) -> Iterator[str]:
    path = item.where
    pq = extras.load("pyarrow.parquet", f"--input={path} (Parquet)")
    try:
        table = pq.ParquetFile(sources.open_bytes(item))
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
