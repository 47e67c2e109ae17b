"""HLO collective records on compiled programs with known collectives: op, bytes, axes and loop counts."""
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mesh.hlo import axes_of_groups, collectives, replica_groups
from mesh.layout import make_mesh

ALL = ("data", "pipeline", "fsdp", "tensor")
SIZES = {"data": 2, "fsdp": 2, "tensor": 2}


def _compile(fn, mesh, *shapes, out_specs=None):
    out_specs = P(ALL) if out_specs is None else out_specs
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(ALL),) * len(shapes), out_specs=out_specs, check_vma=False)
    return jax.jit(sm).lower(*[jnp.zeros(s, jnp.float32) for s in shapes]).compile().as_text()


def _only(records, op):
    found = [r for r in records if r["op"] == op]
    assert len(found) == 1, records
    return found[0]


def test_psum_over_data_all_gather_over_fsdp_reduce_scatter_and_all_to_all():
    mesh = make_mesh(SIZES)

    def f(x):  # x: the per-device block [8, 4] f32 = 128 bytes
        y = jax.lax.psum(x, "data")
        g = jax.lax.all_gather(y, "fsdp", tiled=True)                    # [16, 4]
        r = jax.lax.psum_scatter(g * 2, "tensor", scatter_dimension=0, tiled=True)  # [8, 4]
        return jax.lax.all_to_all(r, ("fsdp", "tensor"), 0, 1, tiled=True)

    recs = collectives(_compile(f, mesh, (64, 4)), mesh)
    ar, ag, rs, a2a = (_only(recs, op) for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"))
    assert (ar["axes"], ar["bytes"], ar["shape"], ar["dtype"], ar["count"], ar["scalar"]) == \
        (["data"], 128, [8, 4], "f32", 1, False)
    assert (ag["axes"], ag["bytes"], ag["group_size"]) == (["fsdp"], 256, 2)      # the gathered output
    assert (rs["axes"], rs["bytes"], rs["shape"]) == (["tensor"], 256, [8, 4])   # the full input
    assert (a2a["axes"], a2a["bytes"], a2a["group_size"]) == (["fsdp", "tensor"], 128, 4)


def test_loop_trip_counts_multiply_through_nested_loops():
    mesh = make_mesh(SIZES)

    def f(x):
        def inner(i, c):
            return jax.lax.ppermute(c, "tensor", [(0, 1), (1, 0)])

        def body(c, _):
            c = jax.lax.psum(c, "data") * 0.5
            return jax.lax.fori_loop(0, 3, inner, c), None
        c, _ = jax.lax.scan(body, x, None, length=5)
        return c, jax.lax.psum(jnp.sum(c), ("data", "fsdp", "tensor"))

    recs = collectives(_compile(f, mesh, (64, 4), out_specs=(P(ALL), P())), mesh)
    perm = _only(recs, "collective_permute")
    assert (perm["count"], perm["axes"], perm["bytes"], perm["exact"]) == (15, ["tensor"], 128, True)
    loop_ar = [r for r in recs if r["op"] == "all_reduce" and not r["scalar"]]
    assert [(r["count"], r["axes"]) for r in loop_ar] == [(5, ["data"])]
    loss = [r for r in recs if r["scalar"]]
    assert [(r["count"], r["axes"], r["bytes"]) for r in loss] == [(1, ["data", "fsdp", "tensor"], 4)]


def _grad_step_hlo(mesh):
    """A jitted (not shard_mapped) two-layer step: XLA picks the collectives and their group syntax."""
    def loss(w, x):
        return jnp.mean((jax.nn.relu(x @ w["a"]) @ w["b"]) ** 2)

    def step(w, x):
        l, g = jax.value_and_grad(loss)(w, x)
        return l, jax.tree.map(lambda p, d: p - 0.1 * d, w, g)
    ws = {"a": NamedSharding(mesh, P("fsdp", "tensor")), "b": NamedSharding(mesh, P("tensor", "fsdp"))}
    w = {"a": jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=ws["a"]),
         "b": jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=ws["b"])}
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P(("data", "fsdp"))))
    return jax.jit(step, out_shardings=(NamedSharding(mesh, P()), ws)).lower(w, x).compile().as_text()


def test_replica_groups_are_mesh_positions_not_device_ids():
    """Compiling on a mesh over permuted devices gives the same groups: ids index mesh.devices.flat."""
    natural = make_mesh(SIZES)
    devices = [jax.devices()[i] for i in (7, 3, 5, 1, 6, 2, 4, 0)]
    permuted = make_mesh(SIZES, devices=devices)
    a, b = _grad_step_hlo(natural), _grad_step_hlo(permuted)
    strip = lambda recs: [{k: r[k] for k in ("op", "axes", "bytes", "count")} for r in recs]  # noqa: E731
    assert strip(collectives(a, natural)) == strip(collectives(b, permuted))
    assert a.count("replica_groups=") == b.count("replica_groups=") > 0


@pytest.mark.parametrize("sizes", [SIZES, {"data": 2, "fsdp": 4}])
def test_auto_sharded_step_axes(sizes):
    """XLA's own mesh forms (`mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {...}`) decode to user axes."""
    mesh = make_mesh(sizes)
    recs = collectives(_grad_step_hlo(mesh), mesh)
    assert recs and all(set(r["axes"]) <= set(sizes) for r in recs)
    # the weights are sharded over fsdp only along their rows, so the forward gathers run over fsdp
    assert {tuple(r["axes"]) for r in recs if r["op"] == "all_gather"} == {("fsdp",)}
    # the weights are replicated over data, so their gradients must be summed over data
    assert any(r["op"] in ("all_reduce", "reduce_scatter") and r["axes"] == ["data"] and not r["scalar"]
               for r in recs)
    # the mean loss over a batch sharded on (data, fsdp) is reduced over those axes only
    assert set().union(*[r["axes"] for r in recs if r["scalar"]]) <= {"data", "fsdp"}
    assert all(r["count"] == 1 and r["exact"] for r in recs)


@pytest.mark.parametrize("text, groups", [
    ("replica_groups={{0,2},{1,3}}, x", [[0, 2], [1, 3]]),
    ("replica_groups={}, x", [[0, 1, 2, 3, 4, 5, 6, 7]]),
    ("replica_groups=[4,2]<=[8], x", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("replica_groups=[2,4]<=[4,2]T(1,0), x", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("replica_groups=[4,2]<=[2,2,2]T(0,2,1), x", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("replica_groups=[4,2]<=[2,2,2]T(2,1,0), x", [[0, 4], [2, 6], [1, 5], [3, 7]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_1'}, x", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}, x", [list(range(8))]),
    ("replica_groups=mesh[a=2,b=4] {b:(1)2}, x", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("replica_groups=mesh[a=2,b=4] {b:(2)2}, x", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("replica_groups=mesh[a=2,b=4], device_ids=(7,6,5,4,3,2,1,0) {a}, x", [[7, 3], [6, 2], [5, 1], [4, 0]]),
    # XLA's own axes over a transposed iota of devices (seen for a data:2 x fsdp:4 FSDP step)
    ("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, x",
     [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, x",
     [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([4,2]) {'axis_1'}, x",
     [[0, 2, 4, 6], [1, 3, 5, 7]]),
])
def test_replica_group_syntaxes(text, groups):
    got = replica_groups(text, 8)
    assert sorted(map(sorted, got)) == sorted(map(sorted, groups))


def test_axes_of_groups_on_2x2x2():
    mesh = make_mesh(SIZES)  # position = 4 data + 2 fsdp + tensor
    assert axes_of_groups([[0, 4], [1, 5]], mesh) == ["data"]
    assert axes_of_groups([[0, 1, 2, 3]], mesh) == ["fsdp", "tensor"]
    assert axes_of_groups([[0, 5]], mesh) == ["data", "tensor"]
    assert axes_of_groups([[3], [4]], mesh) == []


GPU_STYLE = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%async_rs (p: f32[8,4]) -> f32[4,4] {
  %p = f32[8,4]{1,0} parameter(0)
  ROOT %rs = f32[4,4]{1,0} reduce-scatter(%p), channel_id=3, replica_groups=[4,2]<=[8], dimensions={0}, to_apply=%add
}

%body (t: (s32[], bf16[8,4])) -> (s32[], bf16[8,4]) {
  %t = (s32[], bf16[8,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = bf16[8,4]{1,0} get-tuple-element(%t), index=1
  %cp-start = (bf16[8,4]{1,0}, bf16[8,4]{1,0}, u32[], u32[]) collective-permute-start(%x), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}
  %cp-done = bf16[8,4]{1,0} collective-permute-done(%cp-start)
  ROOT %r = (s32[], bf16[8,4]{1,0}) tuple(%i, %cp-done)
}

%cond (t: (s32[], bf16[8,4])) -> pred[] {
  %t = (s32[], bf16[8,4]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[8,4], y: bf16[8,4]) -> f32[16,4] {
  %x = f32[8,4]{1,0} parameter(0)
  %y = bf16[8,4]{1,0} parameter(1)
  %ar-start = (f32[8,4]{1,0}, f32[]) all-reduce-start(%x, %x), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
  %ar-done = (f32[8,4]{1,0}, f32[]) all-reduce-done(%ar-start)
  %ag-start = (f32[8,4]{1,0}, f32[16,4]{1,0}) all-gather-start(%x), channel_id=2, replica_groups={{0,2},{1,3},{4,6},{5,7}}, dimensions={0}
  %ag-done = f32[16,4]{1,0} all-gather-done(%ag-start)
  %rs-start = ((f32[8,4]{1,0}), f32[4,4]{1,0}) async-start(%x), calls=%async_rs
  %rs-done = f32[4,4]{1,0} async-done(%rs-start), calls=%async_rs
  %t0 = (s32[], bf16[8,4]{1,0}) tuple(%c0, %y)
  %w = (s32[], bf16[8,4]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  ROOT %out = f32[16,4]{1,0} copy(%ag-done)
}
"""


def test_async_start_done_pairs_count_once():
    mesh = make_mesh(SIZES)
    recs = {r["name"]: r for r in collectives(GPU_STYLE, mesh)}
    assert set(recs) == {"ar-start", "ag-start", "rs", "cp-start"}
    assert (recs["ar-start"]["bytes"], recs["ar-start"]["axes"]) == (132, ["data"])
    assert (recs["ag-start"]["bytes"], recs["ag-start"]["axes"]) == (256, ["fsdp"])
    assert (recs["rs"]["bytes"], recs["rs"]["axes"], recs["rs"]["count"]) == (128, ["tensor"], 1)
    cp = recs["cp-start"]
    assert (cp["bytes"], cp["dtype"], cp["axes"], cp["count"], cp["group_size"]) == \
        (64, "bf16", ["fsdp", "tensor"], 6, 4)


def test_unknown_syntax_is_a_one_line_error():
    with pytest.raises(ValueError, match="replica_groups: unrecognised syntax"):
        replica_groups("replica_groups=<<weird>>", 8)
    with pytest.raises(ValueError, match="no ENTRY computation"):
        collectives("garbage", make_mesh(SIZES))


def _switch_in_scan_hlo(mesh):
    """A scan of 5 trips over a 3-way switch: branch 2 reduces over data, and branch 1 holds a 2-way
    switch whose branch 0 permutes over tensor. Branch 0 is idle."""
    def f(x, idx):
        inner = [lambda c: jax.lax.ppermute(c, "tensor", [(0, 1), (1, 0)]), lambda c: c + 1.0]
        branches = [lambda c, i: c * 0.0,
                    lambda c, i: jax.lax.switch(i[1], inner, c),
                    lambda c, i: jax.lax.psum(jnp.sin(c), "data")]

        def body(c, i):
            return jax.lax.switch(i[0], branches, c, i), None
        c, _ = jax.lax.scan(body, x, idx)
        return c
    sm = jax.shard_map(f, mesh=mesh, in_specs=(P(ALL), P()), out_specs=P(ALL), check_vma=False)
    return jax.jit(sm).lower(jnp.zeros((64, 4)), jnp.zeros((5, 2), jnp.int32)).compile().as_text()


def test_collectives_in_switch_branches_name_their_branch():
    mesh = make_mesh(SIZES)
    text = _switch_in_scan_hlo(mesh)
    three_way = re.findall(r"%?([\w.\-]+) = .* conditional\(.*branch_computations=\{[^,}]*,[^,}]*,[^,}]*\}", text)
    assert len(three_way) == 1, text
    recs = collectives(text, mesh)
    ar, perm = _only(recs, "all_reduce"), _only(recs, "collective_permute")
    # count stays the upper bound (every trip of the scan), so the records are not exact
    assert (ar["axes"], ar["count"], ar["exact"], ar["trips_known"]) == (["data"], 5, False, True)
    assert ar["branch"] == [{"conditional": three_way[0], "index": 2, "branches": 3, "count": 5,
                             "op_name": ar["branch"][0]["op_name"]}]
    assert ar["branch"][0]["op_name"].endswith("/cond")  # JAX's name for the switch (the audit finds scopes in it)
    assert (perm["axes"], perm["count"], perm["exact"]) == (["tensor"], 5, False)
    assert [b["index"] for b in perm["branch"]] == [1, 0] and perm["branch"][0]["conditional"] == three_way[0]
    assert perm["branch"][1]["branches"] == 2 and perm["branch"][1]["count"] == 5


def test_branch_index_contradicted_by_jax_names_is_unknown():
    """Branch numbers are positions in branch_computations, checked against JAX's name stack
    (`cond/branch_i_fun`): reversing the list in the text makes them disagree, so the index is None."""
    mesh = make_mesh(SIZES)
    text = _switch_in_scan_hlo(mesh)
    reversed_text = re.sub(r"branch_computations=\{([^}]*)\}",
                           lambda m: "branch_computations={" + ", ".join(m.group(1).split(", ")[::-1]) + "}", text)
    ar = _only(collectives(reversed_text, mesh), "all_reduce")
    assert ar["branch"][0]["index"] is None


PRED_STYLE = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%on_true (x: f32[8,4]) -> f32[8,4] {
  %x = f32[8,4]{1,0} parameter(0)
  ROOT %ar = f32[8,4]{1,0} all-reduce(%x), replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
}

%on_false (x: f32[8,4]) -> f32[8,4] {
  ROOT %x = f32[8,4]{1,0} parameter(0)
}

ENTRY %main (p: pred[], x: f32[8,4]) -> f32[8,4] {
  %p = pred[] parameter(0)
  %x = f32[8,4]{1,0} parameter(1)
  ROOT %c = f32[8,4]{1,0} conditional(%p, %x, %x), true_computation=%on_true, false_computation=%on_false
}
"""


def test_predicate_conditional_true_branch_is_index_one():
    """lax.cond's index 0 is the false branch, so a predicate conditional's true branch is index 1."""
    ar = _only(collectives(PRED_STYLE, make_mesh(SIZES)), "all_reduce")
    assert ar["branch"] == [{"conditional": "c", "index": 1, "branches": 2, "count": 1, "op_name": ""}]
    assert not ar["exact"]
