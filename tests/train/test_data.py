"""Batches are pure functions of (seed, step), independent of the layout; splits and caches behave."""
import hashlib
import json

import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ml_collections import ConfigDict

from mesh import make_mesh
from train.config.experiment import ConfigError
from train.data import datadir
from train.data import loader as data_lib
from train.data import order as order_lib
from train.data import tokenizer as tokenizer_lib


def _cfg(tmp_path, **kw):
    return ConfigDict(dict(dict(source="text", path="", token_dtype="uint16", eval_percent=5,
                                cache_dir=str(tmp_path / "cache")), **kw))


def test_stdlib_corpus_split_and_cache(tmp_path, monkeypatch):
    src = data_lib.load(_cfg(tmp_path), 256, 65)
    assert src.train.dtype == np.uint8 and len(src.train) > 1_000_000 and len(src.eval) > 10_000
    assert not any("site-packages" in str(p) for p in data_lib.stdlib_files())
    # The second load reads the cache instead of the files.
    monkeypatch.setattr(data_lib.pathlib.Path, "read_bytes", lambda self: pytest.fail("rebuilt the corpus"))
    again = data_lib.load(_cfg(tmp_path), 256, 65)
    assert np.array_equal(again.train, src.train) and np.array_equal(again.eval, src.eval)


def test_batch_is_pure_and_layout_independent(tmp_path):
    src = data_lib.load(_cfg(tmp_path), 256, 65)
    whole = src.rows(0, 7, 16, 65, slice(None))
    assert np.array_equal(whole, src.rows(0, 7, 16, 65, slice(None)))
    assert not np.array_equal(whole, src.rows(0, 8, 16, 65, slice(None)))
    assert not np.array_equal(whole, src.rows(1, 7, 16, 65, slice(None)))
    assert not np.array_equal(whole, src.rows(0, 7, 16, 65, slice(None), split="eval"))
    for sizes in ({"data": 8}, {"data": 2, "fsdp": 2, "tensor": 2}):
        mesh = make_mesh(sizes)
        spec = P(("data", "fsdp")) if sizes.get("fsdp") else P("data")
        batch = data_lib.global_batch(src, NamedSharding(mesh, spec), 0, 7, 16, 65)
        assert np.array_equal(np.asarray(batch), whole)


def test_text_file_and_token_file_sources(tmp_path):
    text = tmp_path / "book.txt"
    text.write_bytes(bytes(range(32, 127)) * 200)
    src = data_lib.load(_cfg(tmp_path, path=str(text)), 256, 65)
    assert len(src.train) + len(src.eval) == text.stat().st_size
    tokens = np.arange(10_000, dtype=np.uint16) % 1000
    tokens.tofile(tmp_path / "train.bin")
    (tokens[:500]).tofile(tmp_path / "val.bin")
    src = data_lib.load(_cfg(tmp_path, source="tokens", path=str(tmp_path / "train.bin")), 1024, 65)
    assert len(src.train) == 10_000 and len(src.eval) == 500
    row = src.rows(0, 0, 2, 65, slice(None))
    assert np.all(np.diff(row, axis=1) % 1000 == 1)  # contiguous windows of the file
    with pytest.raises(ConfigError, match="model.vocab_size=512"):
        data_lib.load(_cfg(tmp_path, source="tokens", path=str(tmp_path / "train.bin")), 512, 65)


def test_too_little_data_is_a_clear_error(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("hello")
    with pytest.raises(ConfigError, match="fewer than one row"):
        data_lib.load(_cfg(tmp_path, path=str(small)), 256, 65)


def _datadir(path, tokens, vocab=320, tokenizer="same"):
    """A DATADIR as train.prepare writes it (meta.json fields the loader reads)."""
    path.mkdir(parents=True)
    np.asarray(tokens, dtype=np.uint16).tofile(path / "train.bin")
    np.asarray(tokens[:200], dtype=np.uint16).tofile(path / "val.bin")
    tok = path / "tokenizer.json"
    tokenizer_lib.bytes_tokenizer().save(str(tok))
    if tokenizer != "same":  # another tokenizer.json: the same ids in another file
        tok.write_text(tok.read_text() + "\n")
    sha = hashlib.sha256(tok.read_bytes()).hexdigest()
    meta = dict(vocab_size=vocab, dtype="uint16", eos_id=0, tokenizer_sha256=sha)
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_feistel_permutation_is_a_bijection():
    for n in (1, 2, 3, 17, 64, 1000, 4097):
        perm = order_lib.permute(np.arange(n), n, seed=3, epoch=1)
        assert sorted(perm.tolist()) == list(range(n))
    epoch0, epoch1 = (order_lib.permute(np.arange(100), 100, seed=0, epoch=e) for e in (0, 1))
    assert not np.array_equal(epoch0, epoch1)


def test_epochs_use_every_window_once_and_replay(tmp_path):
    seq = 8
    d = _datadir(tmp_path / "d", np.arange(8 * 48 + 5) % 300)  # 48 windows of 9 tokens at multiples of 8
    src = data_lib.load(_cfg(tmp_path, source="tokens", path=str(d)), 320, seq + 1)
    assert src.streams[0].windows(seq + 1) == 48
    starts = np.concatenate([src.rows(5, s, 6, seq + 1, slice(None))[:, 0] for s in range(8)])  # 8 x 6 = 48
    assert sorted(starts.tolist()) == sorted((8 * w) % 300 for w in range(48))  # each start once
    assert np.all(np.diff(src.rows(5, 3, 6, seq + 1, slice(None)), axis=1) % 300 == 1)  # whole windows
    other = np.concatenate([src.rows(6, s, 6, seq + 1, slice(None))[:, 0] for s in range(8)])
    assert sorted(other.tolist()) == sorted(starts.tolist()) and not np.array_equal(other, starts)
    resumed = data_lib.load(_cfg(tmp_path, source="tokens", path=str(d)), 320, seq + 1)  # a new process
    assert np.array_equal(resumed.rows(5, 7, 6, seq + 1, slice(2, 4)), src.rows(5, 7, 6, seq + 1, slice(None))[2:4])
    next_epoch = np.concatenate([src.rows(5, s, 6, seq + 1, slice(None))[:, 0] for s in range(8, 16)])
    assert sorted(next_epoch.tolist()) == sorted(starts.tolist()) and not np.array_equal(next_epoch, starts)
    assert src.progress(12, 6, seq + 1) == {"epoch": 1.5}


def test_mixture_shares_epochs_and_tokenizer_check(tmp_path):
    a = _datadir(tmp_path / "web", np.arange(5000) % 100)            # ids < 100
    b = _datadir(tmp_path / "code", 100 + np.arange(3000) % 100)     # ids >= 100
    cfg = _cfg(tmp_path, source="tokens", path=f"{a}:0.7,{b}:0.3")
    src = data_lib.load(cfg, 320, 17)
    from_a = sum(int(np.sum(src.rows(1, s, 10, 17, slice(None))[:, 0] < 100)) for s in range(200))
    assert abs(from_a / 2000 - 0.7) < 0.05
    progress = src.progress(200, 10, 17)
    assert progress["share/web"] == from_a / 2000 and progress["share/code"] == 1 - from_a / 2000
    assert progress["epoch/web"] == from_a / ((5000 - 1) // 16)
    _datadir(tmp_path / "other", np.arange(3000) % 100, tokenizer="different")
    with pytest.raises(datadir.DataConfigError, match="different tokenizers"):
        datadir.resolve(_cfg(tmp_path, source="tokens", path=f"{a}:0.5,{tmp_path / 'other'}:0.5"), 16)
    with pytest.raises(datadir.DataConfigError, match="DIR:WEIGHT"):
        datadir.resolve(_cfg(tmp_path, source="tokens", path=f"{a}:0.5,{b}:x"), 16)


def test_datadir_sets_the_vocabulary_and_checks_every_id(tmp_path):
    from tests.helpers import tiny_config
    from train.config.experiment import resolve
    d = _datadir(tmp_path / "d", np.arange(3000) % 300)
    config = tiny_config("tokens")
    config.data.path = str(d)
    assert resolve(config, 1).model.vocab_size == 320  # from meta.json (the tiny preset says 256)
    config.model.vocab_size = 300
    with pytest.raises(ConfigError, match="model.vocab_size=300 is smaller"):
        resolve(config, 1)
    late = np.zeros((1 << 20) + 100, dtype=np.uint16)
    late[-1] = 400  # past the first 2^20 tokens, and past meta.json's vocabulary
    big = _datadir(tmp_path / "big", late)
    with pytest.raises(ConfigError, match="up to 400"):
        data_lib.load(_cfg(tmp_path, source="tokens", path=str(big)), 320, 65)


def test_an_empty_held_out_split_is_a_one_line_error(tmp_path):
    d = _datadir(tmp_path / "d", np.arange(3000) % 300)
    (d / "val.bin").write_bytes(b"")  # a corpus too small for any document to land in val.bin
    with pytest.raises(ConfigError, match="held-out split of .* has 0 tokens"):
        data_lib.load(_cfg(tmp_path, source="tokens", path=str(d)), 320, 65)
