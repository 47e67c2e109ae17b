"""Batches are pure functions of (seed, step), independent of the layout; splits and caches behave."""
import numpy as np
import pytest
from ml_collections import ConfigDict

from mesh import make_mesh
from train import data as data_lib
from train.config import ConfigError
from jax.sharding import NamedSharding, PartitionSpec as P


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
