"""The local tier in one process on small arrays: a bitwise round trip, the newest step across both tiers, a
damaged or foreign-layout local step set aside for the persistent one, retention, uncommitted and failed saves."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import checkpoint
from checkpoint import local as local_lib


def _tree(mesh, seed):
    """Sharded, replicated and bfloat16 arrays, as a train state has."""
    rng = np.random.default_rng(seed)
    return {"params": {"w": jax.device_put(rng.normal(size=(16, 4)).astype(np.float32), NamedSharding(mesh, P("d"))),
                       "b": jax.device_put(jnp.asarray(rng.normal(size=(6,)), jnp.bfloat16), NamedSharding(mesh, P()))},
            "step": jax.device_put(np.int32(seed), NamedSharding(mesh, P()))}


def _target(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))


@pytest.fixture
def tiers(tmp_path):
    mesh = jax.make_mesh((8,), ("d",))
    ckpts = checkpoint.Checkpoints(tmp_path / "run" / "checkpoints")
    local = checkpoint.LocalCheckpoints(tmp_path / "shm", tmp_path / "run")
    yield mesh, ckpts, local
    ckpts.close()


def test_local_step_round_trips_bitwise_and_wins_when_newer(tiers):
    mesh, ckpts, local = tiers
    ckpts.save(2, _tree(mesh, 2), {})
    ckpts.wait()
    for step in (3, 4, 5):
        local.save(step, _tree(mesh, step), {"config": {}})
    assert [r.step for r in local.wait()] == [3, 4, 5] and local.steps() == [4, 5]  # the newest 2 kept
    got = checkpoint.restore_tiers(ckpts, local, _target(_tree(mesh, 0)), warn=pytest.fail)
    assert (got.step, got.tier, got.where) == (5, "local", local.step_dir(5))
    _equal(got.tree, _tree(mesh, 5))
    assert got.tree["params"]["w"].sharding == _tree(mesh, 0)["params"]["w"].sharding
    ckpts.save(6, _tree(mesh, 6), {})  # a newer persistent step: the local ones are older and ignored
    ckpts.wait()
    got = checkpoint.restore_tiers(ckpts, local, _target(_tree(mesh, 0)), warn=pytest.fail)
    assert (got.step, got.tier) == (6, "persistent")


def test_damaged_local_steps_fall_back_to_the_persistent_tier(tiers):
    mesh, ckpts, local = tiers
    ckpts.save(2, _tree(mesh, 2), {})
    ckpts.wait()
    local.save(3, _tree(mesh, 3), {})
    local.save(4, _tree(mesh, 4), {})
    local.wait()
    data = local.step_dir(4) / local_lib.DATA
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 3] ^= 0x10
    data.write_bytes(bytes(blob))
    (local.step_dir(3) / local_lib.MANIFEST).write_text("{")
    (local.directory / f"7{local_lib.TMP}").mkdir()  # a save killed before its commit: never listed
    warnings = []
    got = checkpoint.restore_tiers(ckpts, local, _target(_tree(mesh, 0)), warn=warnings.append)
    assert (got.step, got.tier) == (2, "persistent")
    _equal(got.tree, _tree(mesh, 2))
    assert "checksum mismatch in params/" in warnings[0] and "does not read" in warnings[1], warnings
    assert local.steps() == [] and (local.directory / "4.damaged" / "REASON.txt").is_file()


def test_a_local_step_of_another_layout_is_skipped(tiers):
    mesh, ckpts, local = tiers
    local.save(3, _tree(mesh, 3), {})
    local.wait()
    other = jax.make_mesh((2, 4), ("d", "e"))
    warnings = []
    assert checkpoint.restore_tiers(ckpts, local, _target(_tree(other, 0)), warn=warnings.append) is None
    assert "holds no shard" in warnings[0], warnings


def test_a_failed_local_save_is_raised_by_the_next_wait_and_the_next_save_commits(tiers):
    mesh, _, local = tiers
    local.directory.parent.mkdir(parents=True)
    local.directory.write_text("a file where the folder goes: the write fails")
    local.save(3, _tree(mesh, 3), {})
    with pytest.raises(checkpoint.SaveFailed, match=r"local save of .*/own/3 failed \(.*\); check the space"):
        local.wait()
    local.directory.unlink()
    local.save(4, _tree(mesh, 4), {})
    assert [r.step for r in local.wait()] == [4] and local.steps() == [4]
