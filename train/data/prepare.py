"""`python -m train.prepare --input=PATH[,PATH...] --out=DATADIR --tokenizer=bytes|hf:PATH|train-bpe:VOCAB`:
tokenize a corpus into nanoGPT-style train.bin/val.bin with tokenizer.json and meta.json. Documents are
tokenized in parallel and streamed to disk; DATADIR only ever sees finished files (meta.json last)."""
from __future__ import annotations

import collections
import json
import multiprocessing
import os
import pathlib
import shutil
import sys
import time
import zlib
from typing import Any, Iterator

import numpy as np
from absl import app, flags

from mesh.errors import UserError
from train import cli
from train.data import corpus
from train.data import tokenizer as tok_lib
from train.data.corpus import CorpusError
from train.data.tokenizer import TokenizerError
from train.loop import exit_codes

_INPUT = flags.DEFINE_list("input", None, "Text files, directories, JSONL or Parquet files (comma-separated).")
_OUT = flags.DEFINE_string("out", None, "DATADIR to write train.bin, val.bin, tokenizer.json, meta.json into.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "bytes", "bytes, hf:PATH (tokenizer.json or its directory), "
                                 "or train-bpe:VOCAB.")
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "The text field of JSONL records and Parquet rows.")
_VAL_PERCENT = flags.DEFINE_float("val_percent", 1.0, "Percent of documents (by a hash of each) held out as val.bin.")
_NUM_WORKERS = flags.DEFINE_integer("num_workers", max(1, (os.cpu_count() or 1)), "Tokenizing processes.")
_BPE_SAMPLE_MB = flags.DEFINE_float("bpe_sample_mb", 200.0, "train-bpe: train on at most this much text (MB).")
_EOS = flags.DEFINE_string("eos_token", "", "hf: the end-of-document token, when the tokenizer declares none.")
_BOS = flags.DEFINE_string("bos_token", "", "A token to put before every document (none by default).")
_OVERWRITE = flags.DEFINE_boolean("overwrite", False, "Replace a DATADIR prepared from other inputs or tokenizer.")

CHUNK_BYTES = 1 << 18  # text per work unit: large enough to amortize the hand-off, small for a bounded RSS
SPLITS = ("train", "val")


class PrepareError(UserError):
    """A bad flag or output directory; one line."""


def is_val(text: str, val_percent: float) -> bool:
    """The split of a document depends on its text only, so it is stable when inputs are added."""
    return zlib.crc32(text.encode("utf-8")) % 10_000 < val_percent * 100


def build_tokenizer(spec: str, files: list[pathlib.Path], text_field: str, sample_mb: float, eos_token: str):
    """(tokenizer, the text of its end-of-document token)."""
    if spec == "bytes":
        return tok_lib.bytes_tokenizer(), tok_lib.EOS_TEXT
    if spec.startswith("hf:"):
        tok = tok_lib.load_file(spec[3:])
        eos = eos_token or tok_lib.declared_eos(tok)
        if eos is None:
            raise PrepareError(f"--tokenizer={spec}: the tokenizer declares no end-of-document token; "
                               f"give one with --eos_token=TEXT")
        return tok, eos
    if spec.startswith("train-bpe:"):
        try:
            vocab = int(spec.split(":", 1)[1])
        except ValueError:
            raise PrepareError(f"--tokenizer={spec}: VOCAB must be an integer, e.g. train-bpe:8192") from None
        if vocab <= 256:  # checked before reading the sample
            tok_lib.train_bpe([], vocab)
        tok = tok_lib.train_bpe(_sample(files, text_field, sample_mb * 1e6), vocab)
        return tok, tok_lib.EOS_TEXT
    raise PrepareError(f"--tokenizer={spec}: use bytes, hf:PATH or train-bpe:VOCAB")


def _sample(files: list[pathlib.Path], text_field: str, limit: float) -> Iterator[str]:
    taken = 0
    for path in files:
        for doc in corpus.documents(path, text_field):
            yield doc
            taken += len(doc)
            if taken >= limit:
                return


def _chunks(files: list[pathlib.Path], text_field: str) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for path in files:
        for doc in corpus.documents(path, text_field):
            chunk.append(doc)
            size += len(doc)
            if size >= CHUNK_BYTES:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_json: str, eos: int, bos: int | None, val_percent: float, dtype: str,
                 byte_ids: bool) -> None:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(tokenizer_json)
    if byte_ids:  # the bytes tokenizer's id is the byte value: skip the library's per-token objects
        encode = lambda docs: [np.frombuffer(d.encode("utf-8"), dtype=np.uint8) for d in docs]  # noqa: E731
    else:  # no offsets: faster, and far less memory per token
        fast = getattr(tok, "encode_batch_fast", tok.encode_batch)
        encode = lambda docs: [e.ids for e in fast(docs, add_special_tokens=False)]  # noqa: E731
    _WORKER.update(encode=encode, eos=eos, bos=bos, val_percent=val_percent, dtype=dtype)


def _encode(docs: list[str]) -> dict[str, Any]:
    """Token ids of each split (EOS after every document), document counts and the text bytes seen."""
    w = _WORKER
    out: dict[str, list] = {s: [] for s in SPLITS}
    counts = dict.fromkeys(SPLITS, 0)
    eos = np.array([w["eos"]], dtype=w["dtype"])
    bos = np.array([] if w["bos"] is None else [w["bos"]], dtype=w["dtype"])
    for doc, ids in zip(docs, w["encode"](docs)):
        split = "val" if is_val(doc, w["val_percent"]) else "train"
        out[split] += [bos, np.asarray(ids, dtype=w["dtype"]), eos]
        counts[split] += 1
    return {"ids": {s: np.concatenate(out[s]) if out[s] else np.zeros(0, w["dtype"]) for s in SPLITS},
            "docs": counts, "bytes": sum(len(d.encode("utf-8")) for d in docs)}


def _encoded(chunks: Iterator[list[str]], workers: int, init_args: tuple) -> Iterator[dict[str, Any]]:
    """Encoded chunks in input order; at most 2 per worker in flight, so memory stays bounded."""
    if workers == 1:
        _init_worker(*init_args)
        yield from map(_encode, chunks)
        return
    with multiprocessing.get_context("fork").Pool(workers, _init_worker, init_args) as pool:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class Progress:
    """One stderr line: documents/s, tokens/s, MB done and an ETA from the input bytes left."""

    def __init__(self, total_bytes: int):
        self.total, self.t0, self.shown = total_bytes, time.perf_counter(), 0.0
        self.docs = self.tokens = self.bytes = 0

    def add(self, docs: int, tokens: int, nbytes: int) -> None:
        self.docs, self.tokens, self.bytes = self.docs + docs, self.tokens + tokens, self.bytes + nbytes
        now = time.perf_counter()
        if now - self.shown > 0.5:
            self.shown = now
            self.show(final=False)

    def show(self, final: bool) -> None:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        eta = max(self.total - self.bytes, 0) / max(self.bytes / dt, 1e-9)
        line = (f"{self.docs:,} docs ({self.docs / dt:,.0f} docs/s), {self.tokens:,} tokens ({self.tokens / dt:,.0f} "
                f"tokens/s), {self.bytes / 1e6:,.1f}/{self.total / 1e6:,.1f} MB ({self.bytes / 1e6 / dt:.2f} MB/s)")
        print(f"\r{line}, {'done in %.1fs' % dt if final else 'ETA %.0fs' % eta}   ", end="\n" if final else "",
              file=sys.stderr, flush=True)


def _staging_dir(out: pathlib.Path) -> pathlib.Path:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = out.parent / f".{out.name}.prepare-{os.getpid()}"
        staging.mkdir()
    except OSError as e:
        raise PrepareError(f"--out={out}: cannot write there ({e.strerror}); choose a writable directory") from None
    return staging


def _check_out(out: pathlib.Path, inputs: list[dict], recipe: dict, overwrite: bool) -> bool:
    """True when DATADIR already holds exactly this preparation (a no-op)."""
    meta_path = out / "meta.json"
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except ValueError:
            meta = {}
        if meta.get("inputs") == inputs and meta.get("recipe") == recipe:
            return True
        if not overwrite:
            raise PrepareError(f"--out={out} holds data prepared from other inputs or another tokenizer; "
                               f"pass --overwrite to replace it, or choose another --out")
    elif out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise PrepareError(f"--out={out} exists and is not a prepared DATADIR; choose an empty or new "
                           f"directory (or pass --overwrite)")
    return False


def prepare(inputs: list[str], out: str, spec: str, *, text_field: str = "text", val_percent: float = 1.0,
            num_workers: int = 1, bpe_sample_mb: float = 200.0, eos_token: str = "", bos_token: str = "",
            overwrite: bool = False) -> dict[str, Any] | None:
    """Write DATADIR; returns its meta, or None when it already held this preparation."""
    if not 0 <= val_percent < 100:
        raise PrepareError(f"--val_percent={val_percent}: use a percentage in [0, 100)")
    if num_workers < 1:
        raise PrepareError(f"--num_workers={num_workers}: use 1 or more")
    files = corpus.input_files(inputs)
    listed = [{"path": str(f.resolve()), "size": f.stat().st_size, "sha256": corpus.checksum(f)} for f in files]
    recipe = {"tokenizer": spec, "text_field": text_field, "val_percent": val_percent,
              "eos_token": eos_token, "bos_token": bos_token}
    if spec.startswith("train-bpe:"):
        recipe["bpe_sample_mb"] = bpe_sample_mb
    if spec.startswith("hf:"):
        recipe["tokenizer_sha256"] = corpus.checksum(_hf_file(spec[3:]))
    out_path = pathlib.Path(out).expanduser()
    if _check_out(out_path, listed, recipe, overwrite):
        return None
    staging = _staging_dir(out_path)
    try:
        meta = _write(staging, files, listed, recipe, text_field, val_percent, num_workers, bpe_sample_mb, bos_token)
        _publish(staging, out_path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return meta


def _hf_file(path: str) -> pathlib.Path:
    p = pathlib.Path(path).expanduser()
    p = p / tok_lib.FILE if p.is_dir() else p
    if not p.is_file():
        raise TokenizerError(f"--tokenizer=hf:{path}: no tokenizer.json there; give the file or its directory")
    return p


def _write(staging: pathlib.Path, files, listed, recipe, text_field, val_percent, num_workers, sample_mb,
           bos_token) -> dict[str, Any]:
    tok, eos_text = build_tokenizer(recipe["tokenizer"], files, text_field, sample_mb, recipe["eos_token"])
    eos = tok_lib.token_id(tok, eos_text, "--eos_token")
    bos = tok_lib.token_id(tok, bos_token, "--bos_token") if bos_token else None
    vocab = -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    counts = {s: {"documents": 0, "tokens": 0, "max_id": -1} for s in SPLITS}
    progress = Progress(sum(item["size"] for item in listed))
    sinks = {s: open(staging / f"{s}.bin", "wb") for s in SPLITS}
    try:
        for got in _encoded(_chunks(files, text_field), num_workers,
                            (tok.to_str(), eos, bos, val_percent, dtype, recipe["tokenizer"] == "bytes")):
            for s in SPLITS:
                ids = got["ids"][s]
                ids.tofile(sinks[s])
                c = counts[s]
                c["documents"] += got["docs"][s]
                c["tokens"] += len(ids)
                c["max_id"] = max(c["max_id"], int(ids.max()) if len(ids) else -1)
            progress.add(sum(got["docs"].values()), sum(len(v) for v in got["ids"].values()), got["bytes"])
    finally:
        for sink in sinks.values():
            sink.close()
    progress.show(final=True)
    if counts["train"]["tokens"] == 0:
        raise CorpusError(f"--input: the corpus has no training documents ({len(files)} files); add text")
    tok.save(str(staging / tok_lib.FILE))
    meta = {"vocab_size": vocab, "dtype": dtype, "eos_id": eos, "bos_id": bos, **counts,
            "tokenizer_sha256": corpus.checksum(staging / tok_lib.FILE), "inputs": listed, "recipe": recipe,
            "seconds": round(time.perf_counter() - progress.t0, 3)}
    (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _publish(staging: pathlib.Path, out: pathlib.Path) -> None:
    """Move the finished files in, meta.json last: a DATADIR with meta.json is always complete."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    for name in ("train.bin", "val.bin", tok_lib.FILE, "meta.json"):
        os.replace(staging / name, out / name)


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # parallelism comes from --num_workers processes
    if not _INPUT.value or not _OUT.value:
        raise PrepareError("--input and --out are required: --input=PATH[,PATH...] --out=DATADIR")
    meta = prepare(_INPUT.value, _OUT.value, _TOKENIZER.value, text_field=_TEXT_FIELD.value,
                   val_percent=_VAL_PERCENT.value, num_workers=_NUM_WORKERS.value,
                   bpe_sample_mb=_BPE_SAMPLE_MB.value, eos_token=_EOS.value, bos_token=_BOS.value,
                   overwrite=_OVERWRITE.value)  # a user's mistake raises a UserError: cli.run prints it, exit 2
    if meta is None:
        print(f"{_OUT.value} already holds these inputs prepared with --tokenizer={_TOKENIZER.value}; nothing to do")
    else:
        print(f"wrote {_OUT.value}: train {meta['train']['documents']:,} documents / {meta['train']['tokens']:,} "
              f"tokens, val {meta['val']['documents']:,} / {meta['val']['tokens']:,}, vocab_size "
              f"{meta['vocab_size']} ({meta['dtype']}), eos_id {meta['eos_id']}")
    return exit_codes.OK


if __name__ == "__main__":
    cli.run(main)
