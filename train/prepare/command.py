"""`python -m train.prepare --input=PATH[,PATH...] --out=DATADIR --tokenizer=bytes|hf:PATH|train-bpe:VOCAB`:
tokenize a corpus (or, with --format=chat, conversations and their loss mask) into nanoGPT-style train.bin/val.bin
with tokenizer.json and meta.json. Documents are tokenized in parallel and streamed to disk; DATADIR only ever
sees finished files (meta.json last)."""
from __future__ import annotations

import errno
import functools
import json
import os
import pathlib
import shutil
import sys
import time
from typing import Any, Callable, Iterator

import numpy as np
from absl import app, flags

from mesh.errors import UserError
from mesh.numbers import ceil_div
from train import exit_codes
from train.data import chat, corpus, datadir, sources
from train.data import tokenizer as tok_lib
from train.data.corpus import CorpusError
from train.data.tokenizer import TokenizerError
from train.prepare import encode

_INPUT = flags.DEFINE_list("input", None, "Text, JSONL or Parquet files (.gz/.bz2/.xz/.zst too), directories, "
                           "fsspec URLs (s3://, gs://, https://, ...) or hf:DATASET[:SPLIT] (comma-separated).")
_OUT = flags.DEFINE_string("out", None, "DATADIR to write train.bin, val.bin, tokenizer.json, meta.json into.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "bytes", "bytes, hf:PATH (tokenizer.json or its directory), "
                                 "or train-bpe:VOCAB.")
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "The text field of JSONL records, Parquet and dataset rows.")
_TEXT_SPLIT = flags.DEFINE_enum("text_split", "file", ["file", "blank_lines", "lines"],
                                "Documents of a plain text file: the whole file, paragraphs between blank lines, or "
                                "each line.")
_VAL_PERCENT = flags.DEFINE_float("val_percent", 1.0, "Percent of documents (by a hash of each) held out as val.bin.")
_NUM_WORKERS = flags.DEFINE_integer("num_workers", max(1, (os.cpu_count() or 1)), "Tokenizing processes.")
_BPE_SAMPLE_MB = flags.DEFINE_float("bpe_sample_mb", 200.0, "train-bpe: train on at most this much text (MB).")
_EOS = flags.DEFINE_string("eos_token", "", "hf: the end-of-document token, when the tokenizer declares none.")
_BOS = flags.DEFINE_string("bos_token", "", "A token to put before every document (none by default).")
_OVERWRITE = flags.DEFINE_boolean("overwrite", False, "Replace a DATADIR prepared from other inputs or tokenizer.")
_FORMAT = flags.DEFINE_enum("format", "text", ["text", "chat"], "text: documents of text, every token a target; "
                            "chat: JSONL records of `messages`, rendered with the chat template, a loss mask keeping "
                            "the assistant's tokens.")
_MAX_SKIPPED = flags.DEFINE_float("max_skipped_percent", 50.0, "--format=chat: fail (writing nothing) when more than "
                                  "this percent of the records cannot be used (no assistant turn, or unrenderable).")

DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a write that fails for want of room, not a bad path


class PrepareError(UserError):
    """A bad flag or output directory; one line."""


def build_tokenizer(spec: str, files: list[sources.Input], docs_of: Callable[[sources.Input], Iterator[str]],
                    sample_mb: float, eos_token: str):
    """(tokenizer, the text of its end-of-document token); `docs_of(input)` gives an input's documents."""
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
        if not 256 < vocab <= tok_lib.MAX_TRAINED_VOCAB:  # checked before reading the sample
            tok_lib.train_bpe([], vocab)
        tok = tok_lib.train_bpe(encode.sample(files, docs_of, sample_mb * 1e6), vocab)
        return tok, tok_lib.EOS_TEXT
    raise PrepareError(f"--tokenizer={spec}: use bytes, hf:PATH or train-bpe:VOCAB")


class Progress:
    """One stderr line: documents/s, tokens/s, MB done and an ETA from the input bytes left."""

    def __init__(self, total_bytes: int):
        self.total, self.t0 = total_bytes, time.perf_counter()
        self.shown = self.t0  # the first line after 0.5 s: a small input that fails prints only its error
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


def _difference(meta: dict[str, Any], inputs: list[dict], recipe: dict) -> str:
    """How an existing DATADIR's preparation differs from this one, in the flags' words."""
    before = {"format": "text", **(meta.get("recipe") or {})}
    recipe = {"format": "text", **recipe}
    keys = [k for k in sorted(set(before) | set(recipe)) if before.get(k) != recipe.get(k)]
    if "format" in keys:  # the template follows from the format
        keys = [k for k in keys if k != "chat_template_sha256"]
    changed = [("another --tokenizer file" if k == "tokenizer_sha256" else "another chat template"
                if k == "chat_template_sha256" else f"--{k}={before.get(k, '')} (now {recipe.get(k, '')})")
               for k in keys]
    flags_text = "with " + ", ".join(changed) if changed else ""
    if meta.get("inputs") != inputs:
        return "from other inputs" + (f" and {flags_text}" if flags_text else "")
    return flags_text


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
            raise PrepareError(f"--out={out} holds data prepared {_difference(meta, inputs, recipe)}; pass "
                               f"--overwrite to replace it, or choose another --out")
    elif out.exists() and (not out.is_dir() or any(out.iterdir())):
        if overwrite:  # --overwrite replaces a DATADIR, never a folder of the user's own files
            raise PrepareError(f"--out={out} exists and is not a prepared DATADIR (no meta.json), so --overwrite "
                               f"does not replace it; choose an empty or new directory")
        raise PrepareError(f"--out={out} exists and is not a prepared DATADIR; choose an empty or new "
                           f"directory (or pass --overwrite)")
    return False


def prepare(inputs: list[str], out: str, spec: str, *, text_field: str = "text", val_percent: float = 1.0,
            num_workers: int = 1, bpe_sample_mb: float = 200.0, eos_token: str = "", bos_token: str = "",
            overwrite: bool = False, text_split: str = "file", data_format: str = "text",
            max_skipped_percent: float = 50.0) -> dict[str, Any] | None:
    """Write DATADIR; returns its meta, or None when it already held this preparation."""
    if not 0 <= val_percent < 100:
        raise PrepareError(f"--val_percent={val_percent}: use a percentage in [0, 100)")
    if num_workers < 1:
        raise PrepareError(f"--num_workers={num_workers}: use 1 or more")
    if spec.startswith("train-bpe:") and not bpe_sample_mb > 0:
        raise PrepareError(f"--bpe_sample_mb={bpe_sample_mb}: must be > 0 (the MB of text the BPE trains on)")
    if text_split not in corpus.TEXT_SPLITS:
        raise PrepareError(f"--text_split={text_split}: use one of {', '.join(corpus.TEXT_SPLITS)}")
    files = corpus.inputs(inputs)
    template = chat.check(files, spec, max_skipped_percent) if data_format == "chat" else None
    listed = [sources.fingerprint(f) for f in files]
    recipe = {"tokenizer": spec, "text_field": text_field, "val_percent": val_percent,
              "eos_token": eos_token, "bos_token": bos_token}
    if text_split != "file":  # recorded only when set: DATADIRs prepared before it existed stay the same recipe
        recipe["text_split"] = text_split
    if data_format == "chat":  # also recorded only when set
        recipe.update(format="chat", chat_template_sha256=template)
    if spec.startswith("train-bpe:"):
        recipe["bpe_sample_mb"] = bpe_sample_mb
    if spec.startswith("hf:"):
        recipe["tokenizer_sha256"] = corpus.checksum(_hf_file(spec[3:]))
    out_path = pathlib.Path(out).expanduser()
    if _check_out(out_path, listed, recipe, overwrite):
        return None
    staging = _staging_dir(out_path)
    try:
        _check_room(staging, out_path, sum(item["size"] for item in listed))
        meta = _write(staging, files, listed, recipe, text_field, val_percent, num_workers, bpe_sample_mb, bos_token,
                      max_skipped_percent)
        _publish(staging, out_path)
    except OSError as e:
        if e.errno not in DISK_FULL:
            raise
        raise PrepareError(f"--out={out_path}: the disk filled while writing ({e.strerror}); free space there or "
                           f"choose another --out; nothing was written to it") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return meta


def _check_room(staging: pathlib.Path, out: pathlib.Path, input_bytes: int) -> None:
    """A disk without room for the tokens is a one-line error before any tokenizing: the least they take is two
    bytes per token at four bytes of input a token (a byte-level tokenizer's take four times that)."""
    need, free = input_bytes // 2, shutil.disk_usage(staging).free
    if free < need:
        raise PrepareError(f"--out={out}: {free / 1e6:,.1f} MB free there, and the tokens of {input_bytes / 1e6:,.1f} "
                           f"MB of input need {need / 1e6:,.1f} MB or more; free space there or choose another --out")


def _hf_file(path: str) -> pathlib.Path:
    p = pathlib.Path(path).expanduser()
    p = p / tok_lib.FILE if p.is_dir() else p
    if not p.is_file():
        raise TokenizerError(f"--tokenizer=hf:{path}: no tokenizer.json there; give the file or its directory")
    return p


def _write(staging: pathlib.Path, files, listed, recipe, text_field, val_percent, num_workers, sample_mb,
           bos_token, max_skipped_percent) -> dict[str, Any]:
    docs_of = functools.partial(corpus.documents, text_field=text_field, text_split=recipe.get("text_split", "file"))
    renderer = chat.Renderer(recipe["tokenizer"]) if recipe.get("format") == "chat" else None
    if renderer is not None:  # the tokenizer's sample reads the conversations' text, counted by a renderer of its own
        docs_of = lambda item: (text for text, _ in chat.Renderer(recipe["tokenizer"]).documents(item))  # noqa: E731
    tok, eos_text = build_tokenizer(recipe["tokenizer"], files, docs_of, sample_mb, recipe["eos_token"])
    eos = tok_lib.token_id(tok, eos_text, "--eos_token")
    bos = tok_lib.token_id(tok, bos_token, "--bos_token") if bos_token else None
    vocab = ceil_div(tok.get_vocab_size(with_added_tokens=True), 64) * 64
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    progress = Progress(sum(item["size"] for item in listed))
    init = (tok.to_str(), eos, bos, val_percent, dtype, recipe["tokenizer"] == "bytes", renderer is not None)
    docs = encode.chunks(files, renderer.documents if renderer else docs_of)
    counts, nearest = _stream(staging, encode.encoded(docs, num_workers, init), progress)
    if renderer is not None:
        chat.check_skipped(renderer.counts, max_skipped_percent)
    if counts["train"]["tokens"] == 0:
        raise CorpusError(f"--input: the corpus has no training documents ({len(files)} files); add text")
    progress.show(final=True)  # after the checks: a failed preparation ends on its error line alone
    if val_percent > 0 and counts["val"]["documents"] == 0:
        _fill_val(staging, counts, nearest, dtype, val_percent)
    tok.save(str(staging / tok_lib.FILE))
    meta = {"vocab_size": vocab, "dtype": dtype, "eos_id": eos, "bos_id": bos, **counts,
            "tokenizer_sha256": corpus.checksum(staging / tok_lib.FILE), "inputs": listed, "recipe": recipe,
            "seconds": round(time.perf_counter() - progress.t0, 3)}
    if renderer is not None:
        meta.update(format="chat", loss_mask=True, records=renderer.counts,
                    chat_template="default" if renderer.default else "tokenizer")
    (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _stream(staging: pathlib.Path, encoded: Iterator[dict[str, Any]], progress: Progress):
    """Write the encoded chunks to train.bin and val.bin: (counts per split, the train document nearest to val
    as (hash, token offset in train.bin, tokens))."""
    counts = {s: {"documents": 0, "tokens": 0, "max_id": -1} for s in encode.SPLITS}
    nearest = None
    sinks = {s: open(staging / f"{s}.bin", "wb") for s in encode.SPLITS}
    mask_sinks: dict[str, Any] = {}
    try:
        for got in encoded:
            if got["mask"] is not None:  # conversations: the loss mask beside the tokens, and its targets counted
                for s in encode.SPLITS:
                    if s not in mask_sinks:
                        mask_sinks[s] = open(staging / datadir.MASK_FILES[s], "wb")
                    _append(mask_sinks[s], got["mask"][s])
                    counts[s]["targets"] = counts[s].get("targets", 0) + int(got["mask"][s].sum())
            if got["nearest"]:
                h, offset, n = got["nearest"]
                candidate = (h, counts["train"]["tokens"] + offset, n)
                nearest = min(nearest, candidate) if nearest else candidate
            for s in encode.SPLITS:
                ids = got["ids"][s]
                _append(sinks[s], ids)
                c = counts[s]
                c["documents"] += got["docs"][s]
                c["tokens"] += len(ids)
                c["max_id"] = max(c["max_id"], int(ids.max()) if len(ids) else -1)
            progress.add(sum(got["docs"].values()), sum(len(v) for v in got["ids"].values()), got["bytes"])
    finally:
        for sink in [*sinks.values(), *mask_sinks.values()]:
            sink.close()
    return counts, nearest


def _append(sink: Any, array: np.ndarray) -> None:
    """Write an array's bytes; unlike ndarray.tofile, a failed write raises an OSError that carries its errno
    (ENOSPC for a full disk)."""
    sink.write(np.ascontiguousarray(array).data)


def _fill_val(staging: pathlib.Path, counts: dict, nearest: tuple[int, int, int], dtype: str,
              val_percent: float) -> None:
    """No document hashed into val: move the train document nearest to it there (the same one on every rerun),
    so val is never silently empty; a corpus of one document cannot be split."""
    if counts["train"]["documents"] < 2:
        raise CorpusError(f"--val_percent={val_percent}: the corpus is one document, which cannot be split into "
                          f"train and val; add documents, split the text (--text_split=blank_lines or lines), or "
                          f"set --val_percent=0 for no val split")
    _, offset, n = nearest
    moved = _move_out(staging, "train.bin", "val.bin", dtype, offset, n)
    rest = np.memmap(staging / "train.bin", dtype=dtype, mode="r")
    step = 1 << 24
    train_max = max((int(rest[i:i + step].max()) for i in range(0, len(rest), step)), default=-1)
    del rest
    counts["train"].update(documents=counts["train"]["documents"] - 1, tokens=counts["train"]["tokens"] - n,
                           max_id=train_max)
    counts["val"].update(documents=1, tokens=n, max_id=int(moved.max()))
    if (staging / datadir.MASK_FILES["train"]).is_file():  # the document's loss mask goes with it
        targets = int(_move_out(staging, datadir.MASK_FILES["train"], datadir.MASK_FILES["val"], "uint8",
                                offset, n).sum())
        counts["train"]["targets"] -= targets
        counts["val"]["targets"] = targets


def _move_out(staging: pathlib.Path, source: str, target: str, dtype: str, offset: int, n: int) -> np.ndarray:
    """Move items [offset, offset + n) of the file `source` into the file `target`, in chunks; returns them."""
    data = np.memmap(staging / source, dtype=dtype, mode="r")
    moved = np.array(data[offset:offset + n])
    with open(staging / target, "wb") as f:
        _append(f, moved)
    step = 1 << 24
    with open(staging / f"{source}.rest", "wb") as f:
        for begin, end in ((0, offset), (offset + n, len(data))):
            for i in range(begin, end, step):
                _append(f, data[i:min(i + step, end)])
    del data
    os.replace(staging / f"{source}.rest", staging / source)
    return moved


def _publish(staging: pathlib.Path, out: pathlib.Path) -> None:
    """Move the finished files in, meta.json last: a DATADIR with meta.json is always complete."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    for name in datadir.MASK_FILES.values():  # a DATADIR prepared again as text loses its old mask
        (out / name).unlink(missing_ok=True)
    masks = [name for name in datadir.MASK_FILES.values() if (staging / name).is_file()]
    for name in ("train.bin", "val.bin", *masks, tok_lib.FILE, "meta.json"):
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
                   overwrite=_OVERWRITE.value, text_split=_TEXT_SPLIT.value, data_format=_FORMAT.value,
                   max_skipped_percent=_MAX_SKIPPED.value)
    # (a user's mistake raises a UserError: cli.run prints it, exit 2)
    if meta is None:
        print(f"{_OUT.value} already holds these inputs prepared with --tokenizer={_TOKENIZER.value}; nothing to do")
    else:
        print(f"wrote {_OUT.value}: train {meta['train']['documents']:,} documents / {meta['train']['tokens']:,} "
              f"tokens, val {meta['val']['documents']:,} / {meta['val']['tokens']:,}, vocab_size "
              f"{meta['vocab_size']} ({meta['dtype']}), eos_id {meta['eos_id']}")
        if meta.get("loss_mask"):
            print(f"{chat.summary(meta['records'])}; targets (the assistant's tokens): train "
                  f"{meta['train']['targets']:,}, val {meta['val'].get('targets', 0):,}; chat template: "
                  f"{meta['chat_template']}")
    return exit_codes.OK
