"""Reference collectives built from ppermute equal the XLA collectives on 8 virtual devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mesh import collectives as C
from mesh.layout import make_mesh

ALL = ("data", "pipeline", "fsdp", "tensor")
MESHES = {"2x2x2": {"data": 2, "fsdp": 2, "tensor": 2}, "2x4": {"data": 2, "tensor": 4},
          "8": {"fsdp": 8}, "4x2": {"data": 4, "fsdp": 2}}


def _run(mesh, fn, x):
    """Apply fn to each device's block of x (blocks stacked on a leading dim over all mesh axes)."""
    f = jax.shard_map(lambda b: fn(b[0])[None], mesh=mesh, in_specs=P(ALL), out_specs=P(ALL), check_vma=True)
    return np.asarray(jax.jit(f)(x))


def _blocks(shape, seed=0, dtype=np.float32):
    # integer-valued floats: sums are exact in any order, so comparisons can be exact
    return np.random.default_rng(seed).integers(-8, 9, size=(8,) + shape).astype(dtype)


CASES = [("2x2x2", "data"), ("2x2x2", "fsdp"), ("2x2x2", "tensor"), ("2x2x2", ("fsdp", "tensor")),
         ("2x2x2", ("data", "fsdp", "tensor")), ("2x4", "tensor"), ("2x4", "data"), ("8", "fsdp"),
         ("4x2", "data"), ("4x2", ("data", "fsdp"))]


@pytest.mark.parametrize("mesh_name, axis", CASES)
def test_ring_all_reduce_equals_psum(mesh_name, axis):
    mesh = make_mesh(MESHES[mesh_name])
    x = _blocks((3, 5))  # 15 elements: not a multiple of the group size, exercises the padding
    got = _run(mesh, lambda b: C.ring_all_reduce(b, axis), x)
    want = _run(mesh, lambda b: jax.lax.psum(b, axis), x)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mesh_name, axis", CASES)
def test_halving_doubling_equals_psum(mesh_name, axis):
    mesh = make_mesh(MESHES[mesh_name])
    x = _blocks((4, 4), seed=1)
    got = _run(mesh, lambda b: C.halving_doubling_all_reduce(b, axis), x)
    want = _run(mesh, lambda b: jax.lax.psum(b, axis), x)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mesh_name, inner, outer", [
    ("2x2x2", "tensor", "data"), ("2x2x2", ("fsdp", "tensor"), "data"), ("2x4", "tensor", "data"),
    ("4x2", "fsdp", "data")])
def test_hierarchical_equals_psum(mesh_name, inner, outer):
    mesh = make_mesh(MESHES[mesh_name])
    x = _blocks((2, 7), seed=2)
    inner_t = inner if isinstance(inner, tuple) else (inner,)
    got = _run(mesh, lambda b: C.hierarchical_all_reduce(b, inner, outer), x)
    want = _run(mesh, lambda b: jax.lax.psum(b, (outer,) + inner_t), x)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mesh_name, axis", CASES[:6])
def test_ring_reduce_scatter_and_all_gather(mesh_name, axis):
    mesh = make_mesh(MESHES[mesh_name])
    n = C.group_size(mesh, axis)
    x = _blocks((n * 2, 3), seed=3)
    got = _run(mesh, lambda b: C.ring_reduce_scatter(b, axis).reshape(2, 3), x)
    want = _run(mesh, lambda b: jax.lax.psum_scatter(b, axis, scatter_dimension=0, tiled=True), x)
    np.testing.assert_array_equal(got, want)
    y = _blocks((2, 3), seed=4)
    got = _run(mesh, lambda b: C.ring_all_gather(b, axis).reshape(n * 2, 3), y)
    want = _run(mesh, lambda b: jax.lax.all_gather(b, axis, tiled=True), y)
    np.testing.assert_array_equal(got, want)


def test_wrappers_match_lax_and_numpy():
    mesh = make_mesh(MESHES["2x4"])
    x = _blocks((8, 2), seed=5)  # block of device (d, t) is x[4 d + t]
    got = _run(mesh, lambda b: C.all_reduce(b, "tensor"), x)
    np.testing.assert_array_equal(got[0], x[:4].sum(0))
    got = _run(mesh, lambda b: C.all_reduce(b, "data", op="max"), x)
    np.testing.assert_array_equal(got[1], np.maximum(x[1], x[5]))
    got = _run(mesh, lambda b: C.all_gather(b, "tensor", dim=1), x)
    np.testing.assert_array_equal(got[6], np.concatenate(list(x[4:8]), axis=1))
    got = _run(mesh, lambda b: C.reduce_scatter(b, "tensor"), x)
    np.testing.assert_array_equal(got[2], x[:4].sum(0)[4:6])
    got = _run(mesh, lambda b: C.all_to_all(b, "tensor", 0, 1), x)
    np.testing.assert_array_equal(got[1], np.concatenate([x[j][2:4] for j in range(4)], axis=1))
    got = _run(mesh, lambda b: C.permute(b, "tensor", shift=1), x)
    np.testing.assert_array_equal(got[1], x[0])
    np.testing.assert_array_equal(got[4], x[7])


def test_non_power_of_two_groups():
    mesh = make_mesh({"data": 2, "fsdp": 3}, num_devices=6)
    x = _blocks((5,), seed=6)[:6]
    for axis in ("fsdp", ("data", "fsdp")):
        got = _run(mesh, lambda b, axis=axis: C.ring_all_reduce(b, axis), x)
        np.testing.assert_array_equal(got, _run(mesh, lambda b, axis=axis: jax.lax.psum(b, axis), x))
    got = _run(mesh, lambda b: C.hierarchical_all_reduce(b, "fsdp", "data"), x)
    np.testing.assert_array_equal(got, np.broadcast_to(x.sum(0), x.shape))
    with pytest.raises(ValueError, match="fsdp has size 3, not a power of two"):
        _run(mesh, lambda b: C.halving_doubling_all_reduce(b, "fsdp"), x)


def test_errors_name_the_setting():
    with pytest.raises(ValueError, match="op='avg'"):
        C.all_reduce(jnp.ones(2), "data", op="avg")
    with pytest.raises(ValueError, match="reference='tree'"):
        C.reference("tree")
    assert C.reference("ring_all_reduce") is C.ring_all_reduce
    assert C.group_size(make_mesh({"data": 2, "fsdp": 4}), ("data", "fsdp")) == 8
