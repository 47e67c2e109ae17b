"""The storage failure class in one process, without a model: a background write that fails (a wrapper
that raises ENOSPC), a real small filesystem that fills up and then turns read-only (a tmpfs, where the
tests may mount one), and a save slower than the interval. Each failed save leaves no partial files and
the older checkpoints as they were; the next save commits."""
import asyncio
import errno
import subprocess

import jax
import numpy as np
import pytest

import checkpoint
from checkpoint.meta_handler import MetaHandler
from mesh.errors import UserError
from tests.helpers import tiny_config
from train.config.experiment import resolve

# 2 x 1.5 MiB of random float32 (incompressible): a checkpoint is about 3 MiB.
TREE = {name: jax.random.normal(jax.random.key(seed), (384 << 10,)) for seed, name in enumerate("ab")}


def names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def assert_restores(ckpts, step):
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), TREE)
    restored = ckpts.restore_state(step, target)
    for key in TREE:
        np.testing.assert_array_equal(np.asarray(restored[key]), np.asarray(TREE[key]))


def save(ckpts, step):
    ckpts.save(step, TREE, {})
    return ckpts.wait()


def test_a_failed_background_write_is_removed_and_the_next_save_commits(tmp_path, monkeypatch):
    ckpts = checkpoint.Checkpoints(tmp_path, keep=2)
    save(ckpts, 1), save(ckpts, 2)

    async def full(self, x, directory):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(MetaHandler, "_save_fn", full)
    ckpts.save(3, TREE, {})  # the state item is written, the meta fails in the background
    with pytest.raises(checkpoint.SaveFailed, match=r"checkpoints?.*/3 failed .*No space left on device") as failed:
        ckpts.wait()
    assert failed.value.step == 3
    assert ckpts.steps() == [1, 2]  # 1 still counted: the failed save retired nothing
    monkeypatch.undo()
    assert [r.step for r in save(ckpts, 4)] == [4]
    assert names(tmp_path) == ["2", "4"]  # no partial files of 3; 1 retired by retention, not orphaned
    assert_restores(ckpts, 2), assert_restores(ckpts, 4)
    ckpts.close()


def test_a_save_slower_than_the_interval_is_waited_for_one_at_a_time(tmp_path, monkeypatch):
    original = MetaHandler._save_fn

    async def slow(self, x, directory):
        await asyncio.sleep(0.5)
        await original(self, x, directory)

    monkeypatch.setattr(MetaHandler, "_save_fn", slow)
    ckpts = checkpoint.Checkpoints(tmp_path, keep=3)
    ckpts.save(1, TREE, {})
    assert "1" not in names(tmp_path)  # still being written
    ckpts.save(2, TREE, {})  # due before 1 is done: it waits for 1 to commit first
    assert "1" in names(tmp_path) and not any("tmp" in n and n.startswith("1") for n in names(tmp_path))
    assert [r.step for r in ckpts.wait()] == [1, 2]
    assert_restores(ckpts, 1), assert_restores(ckpts, 2)
    ckpts.close()


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs (room for two checkpoints while the newer one commits): skipped where mounting is not allowed."""
    mount = tmp_path / "fs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def remount(mount, mode):
    subprocess.run(["mount", "-o", f"remount,{mode}", str(mount)], check=True)


def test_a_full_then_read_only_filesystem_fails_saves_and_keeps_the_last_one(small_fs):
    ckpts = checkpoint.Checkpoints(small_fs / "checkpoints", keep=1)
    save(ckpts, 1), save(ckpts, 2)  # 2 replaces 1: about 3 of 8 MiB used
    filler = small_fs / "filler"
    filler.write_bytes(bytes(3 << 20))  # 2 MiB left: too little for a checkpoint
    ckpts.save(3, TREE, {})
    with pytest.raises(checkpoint.SaveFailed, match="No space left on device"):
        ckpts.wait()
    assert ckpts.steps() == [2]
    filler.unlink()
    remount(small_fs, "ro")
    try:
        with pytest.raises(checkpoint.SaveFailed, match="Read-only file system"):
            save(ckpts, 4)
    finally:
        remount(small_fs, "rw")
    assert ckpts.steps() == [2]
    assert_restores(ckpts, 2)
    assert [r.step for r in save(ckpts, 5)] == [5]
    assert names(small_fs / "checkpoints") == ["5"]
    assert_restores(ckpts, 5)
    ckpts.close()


@pytest.mark.parametrize("value", [0, -2])
def test_max_failed_saves_must_be_a_whole_number_from_one(value):
    config = tiny_config(data=8)
    config.checkpoint.max_failed_saves = value
    with pytest.raises(UserError, match=rf"^checkpoint.max_failed_saves={value}: use a whole number >= 1"):
        resolve(config, 8)
    config.checkpoint.max_failed_saves = 2
    assert resolve(config, 8).checkpoint.max_failed_saves == 2
