"""train.prepare's tokenizing: documents split between train and val by a hash of their text, grouped into work
units of about CHUNK_BYTES, and encoded to token arrays (and a chat's loss mask) in worker processes, in order."""
from __future__ import annotations

import collections
import multiprocessing
import zlib
from typing import Any, Iterator

import numpy as np

from train.data import chat, sources

CHUNK_BYTES = 1 << 18  # text per work unit: large enough to amortize the hand-off, small for a bounded RSS
SPLITS = ("train", "val")


def split_hash(text: str) -> int:
    """0..9999, from the document's text only: it goes to val when below val_percent x 100."""
    return zlib.crc32(text.encode("utf-8")) % 10_000


def is_val(text: str, val_percent: float) -> bool:
    """The split of a document depends on its text only, so it is stable when inputs are added."""
    return split_hash(text) < val_percent * 100


def sample(files: list[sources.Input], docs_of, limit: float) -> Iterator[str]:
    taken = 0
    for item in files:
        for doc in docs_of(item):
            yield doc
            taken += len(doc)
            if taken >= limit:
                return


def _text_of(doc: str | tuple[str, list]) -> str:
    """A document's text: a plain one, or a conversation's (text, assistant spans)."""
    return doc if isinstance(doc, str) else doc[0]


def chunks(files: list[sources.Input], docs_of) -> Iterator[list]:
    chunk: list = []
    size = 0
    for item in files:
        for doc in docs_of(item):
            chunk.append(doc)
            size += len(_text_of(doc))
            if size >= CHUNK_BYTES:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_json: str, eos: int, bos: int | None, val_percent: float, dtype: str,
                 byte_ids: bool, masked: bool = False) -> None:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(tokenizer_json)
    if masked:  # conversations: the whole text at once (as transformers tokenizes a rendered template), offsets
        def encode(docs):  # give each token's characters, which say whether it is the assistant's
            got = tok.encode_batch([text for text, _ in docs], add_special_tokens=False)
            return [(e.ids, chat.target_mask(e.offsets, spans)) for e, (_, spans) in zip(got, docs)]
    elif byte_ids:  # the bytes tokenizer's id is the byte value: skip the library's per-token objects
        encode = lambda docs: [np.frombuffer(d.encode("utf-8"), dtype=np.uint8) for d in docs]  # noqa: E731
    else:  # no offsets: faster, and far less memory per token
        fast = getattr(tok, "encode_batch_fast", tok.encode_batch)
        encode = lambda docs: [e.ids for e in fast(docs, add_special_tokens=False)]  # noqa: E731
    _WORKER.update(encode=encode, eos=eos, bos=bos, val_percent=val_percent, dtype=dtype, masked=masked)


def _encode(docs: list) -> dict[str, Any]:
    """Token ids of each split (EOS after every document), document counts, the text bytes seen, and the train
    document nearest to val (hash, token offset in this chunk's train ids, tokens): val's fallback. For
    conversations also their loss mask (`mask`: uint8 per token; BOS and EOS are never targets)."""
    w = _WORKER
    out: dict[str, list] = {s: [] for s in SPLITS}
    masks: dict[str, list] = {s: [] for s in SPLITS}
    counts = dict.fromkeys(SPLITS, 0)
    eos = np.array([w["eos"]], dtype=w["dtype"])
    bos = np.array([] if w["bos"] is None else [w["bos"]], dtype=w["dtype"])
    nearest, offset = None, 0
    for doc, got in zip(docs, w["encode"](docs)):
        ids, mask = got if w["masked"] else (got, None)
        h = split_hash(_text_of(doc))
        split = "val" if h < w["val_percent"] * 100 else "train"
        out[split] += [bos, np.asarray(ids, dtype=w["dtype"]), eos]
        if mask is not None:
            masks[split] += [np.zeros(len(bos), np.uint8), mask, np.zeros(1, np.uint8)]
        counts[split] += 1
        if split == "train":
            n = len(bos) + len(ids) + 1
            nearest = min(nearest, (h, offset, n)) if nearest else (h, offset, n)
            offset += n
    joined = lambda parts, dtype: {s: np.concatenate(parts[s]) if parts[s] else np.zeros(0, dtype)  # noqa: E731
                                   for s in SPLITS}
    return {"ids": joined(out, w["dtype"]), "mask": joined(masks, np.uint8) if w["masked"] else None,
            "docs": counts, "bytes": sum(len(_text_of(d).encode("utf-8")) for d in docs), "nearest": nearest}


def encoded(chunks: Iterator[list[str]], workers: int, init_args: tuple) -> Iterator[dict[str, Any]]:
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
