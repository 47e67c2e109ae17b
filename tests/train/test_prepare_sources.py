"""train.prepare reads data where it lives: a `save_to_disk` dataset, a folder streamed by `datasets`, compressed
files (.gz, .bz2, .xz, .zst), an fsspec `memory://` path and text split at blank lines or lines all give the same
tokens as the same documents in a plain JSONL file; the val split is never silently empty; a changed --val_percent
is named as such."""
import bz2
import gzip
import json
import lzma
import zlib

import numpy as np
import pytest

from train.data.corpus import CorpusError
from train.prepare import command as prepare
from train.prepare.command import PrepareError

DOCS = [f"Document {i}: {'ünïcode and ' * (i % 3)}the quick brown fox jumps over the lazy dog.\nSecond line {i}."
        for i in range(12)]


def prepared(tmp_path, name, inputs, **kwargs) -> tuple[bytes, bytes, dict]:
    out = tmp_path / f"out-{name}"
    meta = prepare.prepare(inputs, str(out), "bytes", val_percent=30, **kwargs)
    return (out / "train.bin").read_bytes(), (out / "val.bin").read_bytes(), meta


def test_every_source_gives_the_tokens_of_the_plain_file(tmp_path):
    datasets = pytest.importorskip("datasets")
    fsspec = pytest.importorskip("fsspec")
    zstandard = pytest.importorskip("zstandard")
    jsonl = "".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode()
    paragraphs = "\n\n\n".join(DOCS).encode()  # several blank lines between documents are one break
    (tmp_path / "docs.jsonl").write_bytes(jsonl)
    (tmp_path / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl))
    (tmp_path / "docs.jsonl.bz2").write_bytes(bz2.compress(jsonl))
    (tmp_path / "docs.txt.gz").write_bytes(gzip.compress(paragraphs))
    (tmp_path / "docs.txt.xz").write_bytes(lzma.compress(paragraphs))
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "part.jsonl").write_bytes(jsonl)
    with fsspec.open("memory://corpus/docs.jsonl", "wb") as f:
        f.write(jsonl)
    train, val, meta = prepared(tmp_path, "plain", [str(tmp_path / "docs.jsonl")])
    assert meta["train"]["documents"] + meta["val"]["documents"] == len(DOCS) and meta["val"]["documents"] >= 1
    cases = {"zst": ([str(tmp_path / "docs.jsonl.zst")], {}), "bz2": ([str(tmp_path / "docs.jsonl.bz2")], {}),
             "gz blank lines": ([str(tmp_path / "docs.txt.gz")], {"text_split": "blank_lines"}),
             "xz blank lines": ([str(tmp_path / "docs.txt.xz")], {"text_split": "blank_lines"}),
             "save_to_disk": ([f"hf:{tmp_path / 'saved'}"], {}), "memory://": (["memory://corpus"], {}),
             "dataset folder, streamed": ([f"hf:{tmp_path / 'folder'}:train"], {})}
    for name, (inputs, kwargs) in cases.items():
        assert prepared(tmp_path, name.replace(" ", "-"), inputs, **kwargs)[:2] == (train, val), name
    fsspec.filesystem("memory").rm("/corpus", recursive=True)


def test_lines_split_and_the_val_split_is_never_silently_empty(tmp_path):
    (tmp_path / "lines.txt").write_text("\n".join(DOCS[:3]).replace("\nSecond", " second") + "\n\n")
    first = [d.replace("\nSecond", " second") for d in DOCS[:3]]
    hashes = [zlib.crc32(d.encode()) % 10_000 for d in first]
    assert min(hashes) >= 100  # none hashes into val at --val_percent=1: the fallback must act
    out = tmp_path / "out"
    meta = prepare.prepare([str(tmp_path / "lines.txt")], str(out), "bytes", val_percent=1, text_split="lines")
    nearest = first[int(np.argmin(hashes))]
    assert meta["val"]["documents"] == 1 and meta["train"]["documents"] == 2
    val = np.fromfile(out / "val.bin", dtype=meta["dtype"])
    assert bytes(val[:-1].astype(np.uint8)) == nearest.encode() and val[-1] == meta["eos_id"]
    train = np.fromfile(out / "train.bin", dtype=meta["dtype"])
    assert len(train) == meta["train"]["tokens"] == sum(len(d.encode()) + 1 for d in first) - len(val)
    with pytest.raises(PrepareError, match=r"prepared with --val_percent=1 \(now 10\); pass --overwrite"):
        prepare.prepare([str(tmp_path / "lines.txt")], str(out), "bytes", val_percent=10, text_split="lines")
    (tmp_path / "one.txt").write_text(DOCS[0])
    with pytest.raises(CorpusError, match=r"^--val_percent=1: the corpus is one document, which cannot be split"):
        prepare.prepare([str(tmp_path / "one.txt")], str(tmp_path / "one"), "bytes", val_percent=1)
    assert not (tmp_path / "one").exists()
