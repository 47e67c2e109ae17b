"""train.prepare on a small mixed corpus (text files, JSONL, Parquet): the ids match the tokenizer it
writes, meta.json counts match the files, re-runs are no-ops, bad input is one line with nothing left."""
import json
import os
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from tests.helpers import run_cli
from train.data import tokenizer as tok_lib
from train.data.corpus import CorpusError
from train.data.tokenizer import TokenizerError
from train.prepare import command as prepare
from train.prepare import encode
from train.prepare.command import PrepareError

TEXTS = [f"Text file {i}: the quick brown fox jumps over the lazy dog, {i * 'ünïcode '}\n" * (3 + i)
         for i in range(3)]
JSON_DOCS = [f"json document {i}: lorem ipsum dolor sit amet {i}" for i in range(30)]
PARQUET_DOCS = [f"parquet row {i}: consectetur adipiscing elit {i % 7}" for i in range(20)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "texts" / ".hidden").mkdir(parents=True)
    (root / "texts" / ".hidden" / "skip.txt").write_text("never read")
    for i, text in enumerate(TEXTS):
        (root / "texts" / f"{i}.txt").write_text(text)
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(JSON_DOCS)))
    pq.write_table(pa.table({"text": PARQUET_DOCS}), root / "rows.parquet")
    return [str(root / "texts"), str(root / "docs.jsonl"), str(root / "rows.parquet")]


def test_mixed_corpus_ids_counts_and_rerun(tmp_path, corpus):
    out = tmp_path / "data"
    meta = prepare.prepare(corpus, str(out), "train-bpe:300", val_percent=0)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    train = np.fromfile(out / "train.bin", dtype=meta["dtype"])
    first = tok.encode(TEXTS[0], add_special_tokens=False).ids
    assert len(first) < len(TEXTS[0])  # merges were learned
    assert train[:len(first) + 1].tolist() == first + [meta["eos_id"]]
    assert tok.decode(first) == TEXTS[0]
    docs = TEXTS + JSON_DOCS + PARQUET_DOCS
    assert meta["train"]["documents"] == len(docs) and meta["val"] == {"documents": 0, "tokens": 0, "max_id": -1}
    assert meta["train"]["tokens"] == len(train) == sum(len(tok.encode(d).ids) + 1 for d in docs)
    assert np.sum(train == meta["eos_id"]) == len(docs) and meta["train"]["max_id"] == int(train.max())
    assert meta["vocab_size"] == 320 and meta["dtype"] == "uint16" and tok.get_vocab_size() == 300
    assert [i["size"] for i in meta["inputs"]] == [os.path.getsize(p) for p in
                                                   [f"{corpus[0]}/{i}.txt" for i in range(3)] + corpus[1:]]
    stamp = (out / "train.bin").stat().st_mtime_ns
    assert prepare.prepare(corpus, str(out), "train-bpe:300", val_percent=0) is None  # same inputs: a no-op
    assert (out / "train.bin").stat().st_mtime_ns == stamp
    with pytest.raises(PrepareError, match="--overwrite"):
        prepare.prepare(corpus, str(out), "bytes", val_percent=0)
    # Its tokenizer.json as hf:PATH gives the same ids; EOS is the one it declares.
    again = prepare.prepare(corpus, str(tmp_path / "hf"), f"hf:{out}", val_percent=0)
    assert again["eos_id"] == meta["eos_id"]
    assert np.array_equal(np.fromfile(tmp_path / "hf" / "train.bin", "uint16"), train)


def test_bytes_split_by_document_hash_and_workers_agree(tmp_path, corpus):
    """The CLI with 2 workers writes the same files as 1 worker in-process; val holds the hashed documents."""
    one = prepare.prepare(corpus, str(tmp_path / "one"), "bytes", val_percent=30, num_workers=1)
    result = run_cli(f"--input={','.join(corpus)}", f"--out={tmp_path / 'two'}", "--tokenizer=bytes",
                     "--val_percent=30", "--num_workers=2", module="train.prepare", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "docs" in result.stderr and "tokens/s" in result.stderr and "wrote" in result.stdout
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    docs = TEXTS + JSON_DOCS + PARQUET_DOCS
    held = [d for d in docs if encode.is_val(d, 30)]
    assert 0 < len(held) < len(docs) and one["val"]["documents"] == len(held)
    val = np.fromfile(tmp_path / "one" / "val.bin", dtype="uint16")
    expected = [t for d in held for t in list(d.encode()) + [256]]  # bytes: id = byte value, EOS 256
    assert val.tolist() == expected
    codec = tok_lib.Codec(Tokenizer.from_file(str(tmp_path / "one" / "tokenizer.json")), one["eos_id"])
    assert codec.decode(val[:len(held[0].encode())]) == held[0] and codec.encode(held[0]) == list(held[0].encode())


@pytest.mark.parametrize("case", ["missing", "not_utf8", "bad_json", "no_field", "empty", "small_vocab", "huge_vocab",
                                  "no_eos"])
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, case):
    src = tmp_path / "in"
    src.mkdir()
    spec, error, where = "bytes", CorpusError, None
    if case == "missing":
        inputs, where = [str(tmp_path / "nope")], "nope"
    elif case == "not_utf8":
        (src / "a.txt").write_bytes(b"ok\n\xff\xfe broken")
        inputs, where = [str(src / "a.txt")], "a.txt"
    elif case in ("bad_json", "no_field"):
        line = '{"text": "x"' if case == "bad_json" else '{"body": "x"}'
        (src / "d.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
        inputs, where = [str(src / "d.jsonl")], "d.jsonl:2"
    elif case == "empty":
        (src / "blank.jsonl").write_text("\n\n")
        inputs, where = [str(src)], "no training documents"
    else:
        (src / "a.txt").write_text("some text")
        inputs = [str(src)]
        if case == "small_vocab":
            spec, error, where = "train-bpe:100", TokenizerError, "train-bpe:100"
        elif case == "huge_vocab":  # the library's trainer would abort the process
            spec, error, where = "train-bpe:100000000000", TokenizerError, "at most 1,048,576"
        else:  # a tokenizer.json that declares no end-of-document token
            tok = tok_lib.bytes_tokenizer()
            tok.save(str(tmp_path / "plain.json"))
            data = json.loads((tmp_path / "plain.json").read_text())
            data["added_tokens"] = []
            (tmp_path / "plain.json").write_text(json.dumps(data))
            spec, error, where = f"hf:{tmp_path / 'plain.json'}", PrepareError, "--eos_token"
    out = tmp_path / "out"
    with pytest.raises(error) as caught:
        prepare.prepare(inputs, str(out), spec)
    message = str(caught.value)
    assert where in message and "\n" not in message
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["in"] + (["plain.json"] if case == "no_eos" else []))


def test_cli_bad_input_exits_2_with_one_line(tmp_path):
    result = run_cli(f"--input={tmp_path / 'nope'}", f"--out={tmp_path / 'out'}", module="train.prepare", timeout=60)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"error: --input={tmp_path / 'nope'}: no such file or directory"]


@pytest.mark.parametrize("full", ["train.bin", "meta.json"])
def test_a_full_disk_is_one_line_and_keeps_the_previous_datadir(tmp_path, corpus, monkeypatch, full):
    """Writes into /dev/full fail as a full disk does (ENOSPC), at the first token file or at the last file."""
    out = tmp_path / "out"
    prepare.prepare(corpus[1:2], str(out), "bytes")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_open, real_write = open, pathlib.Path.write_text
    if full == "train.bin":
        monkeypatch.setattr(prepare, "open", lambda path, mode="r", *a, **k: real_open(
            "/dev/full" if pathlib.Path(path).name == full else path, mode, *a, **k), raising=False)
    else:
        monkeypatch.setattr(pathlib.Path, "write_text", lambda self, *a, **k: real_write(
            pathlib.Path("/dev/full") if self.name == full else self, *a, **k))
    with pytest.raises(PrepareError) as caught:
        prepare.prepare(corpus, str(out), "bytes", overwrite=True)
    assert str(caught.value) == (f"--out={out}: the disk filled while writing (No space left on device); free "
                                 f"space there or choose another --out; nothing was written to it")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
