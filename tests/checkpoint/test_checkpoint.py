"""Checkpoint pieces in one process: plain trees, checksums across layouts, the compatibility check,
save and restore onto another mesh, fallback past a damaged checkpoint, params-only restore, the
cross-process flag agreement, the in-step skip of non-finite updates, goodput and the metrics cut."""
import json
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import checkpoint
from checkpoint import format as ckpt_format
from checkpoint import integrity, plain
from checkpoint import meta as meta_lib
from tests.helpers import tiny_config
from train.loop import faults, preemption, resume
from train.loop.goodput import Goodput
from train.trainer import Trainer


@pytest.fixture(scope="module")
def trained():
    """A data=8 trainer and its state after two steps (non-zero Adam moments)."""
    trainer = Trainer.build(tiny_config(data=8))
    state = trainer.init_state()
    for index in range(2):
        state, _ = trainer.train_step(state, trainer.batch(index))
    return trainer, state, ckpt_format.rng_of(0, trainer.mesh)


def numpy_tree(tree):
    return jax.tree.map(np.asarray, tree)


def test_plain_tree_round_trips_optax_state(trained):
    trainer, state, _ = trained
    tree = plain.to_plain(state)
    assert set(tree) == {"params", "opt_state", "step"} and isinstance(tree["opt_state"], dict)
    back = plain.from_plain(tree, trainer.layout.abstract_state)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        assert a is b


def test_checksums_ignore_layout_and_catch_flips_and_swaps():
    mesh8, mesh222 = jax.make_mesh((8,), ("d",)), jax.make_mesh((2, 2, 2), ("a", "b", "c"))
    x = np.random.default_rng(0).normal(size=(16, 8, 4)).astype(np.float32)
    tree = {"x": jax.device_put(x, NamedSharding(mesh8, P("d"))), "n": np.int32(7)}
    other = {"x": jax.device_put(x, NamedSharding(mesh222, P("b", ("a", "c")))), "n": np.int32(7)}
    sums = integrity.checksums(tree)
    assert sums == integrity.checksums(other)
    flipped = x.copy()
    flipped.reshape(-1).view(np.uint32)[123] ^= 1 << 7
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    for bad in (flipped, swapped):
        assert integrity.mismatches({"x": bad, "n": np.int32(7)}, sums) == ["x"]


def test_compatibility_check_names_the_first_difference(trained):
    trainer, state, rng = trained
    tree = ckpt_format.to_tree(trainer, state, rng)
    meta = meta_lib.build(tree, {})
    meta_lib.check_compatible(meta, ckpt_format.target(trainer), "ckpt")
    target = ckpt_format.target(trainer)
    target["params"]["embed"] = jax.ShapeDtypeStruct((256, 64), np.float32)
    with pytest.raises(checkpoint.IncompatibleCheckpoint, match=r"params/embed: checkpoint float32\(256, 128\), "
                                                                r"config float32\(256, 64\)"):
        meta_lib.check_compatible(meta, target, "ckpt")
    meta_lib.check_compatible(meta, {"params": ckpt_format.target(trainer)["params"]}, "ckpt", prefix="params/")
    changes = meta_lib.config_changes({"train": {"steps": 8, "seed": 0}}, {"train": {"steps": 12, "seed": 0}})
    assert changes == ["train.steps: 8 -> 12"]


def test_save_restore_onto_another_mesh_then_fall_back_past_damage(tmp_path, trained):
    trainer, state, rng = trained
    ckpts = checkpoint.Checkpoints(tmp_path / "checkpoints")
    ckpts.save(1, ckpt_format.to_tree(trainer, state, rng), {"note": "one"})
    state2, _ = trainer.train_step(jax.tree.map(lambda x: x.copy(), state), trainer.batch(2))
    ckpts.save(2, ckpt_format.to_tree(trainer, state2, rng), {"note": "two"})
    [r.step for r in ckpts.wait()]
    assert ckpts.steps() == [1, 2]
    # A plain Orbax client reads the state item with no project code: nested dicts of arrays.
    raw = ocp.StandardCheckpointer().restore(tmp_path / "checkpoints" / "2" / "state")
    assert set(raw) == {"params", "opt_state", "step", "rng"} and int(raw["step"]) == 3
    # Restore straight into a 2x2x2 layout: same values, target shardings.
    other = Trainer.build(tiny_config(data=2, fsdp=2, tensor=2))
    restored = checkpoint.restore_newest(ckpts, ckpt_format.target(other))
    assert restored.step == 2 and restored.meta["note"] == "two"
    expected = numpy_tree(ckpt_format.to_tree(trainer, state2, rng))
    for name, value in plain.flatten(restored.tree).items():
        np.testing.assert_array_equal(np.asarray(value), plain.flatten(expected)[name])
    spec = plain.flatten(restored.tree)["params/layers/w_in"].sharding.spec
    assert spec == P(None, "fsdp", "tensor")
    # Flip bytes inside the newest checkpoint's largest data file: it decodes, but its checksums fail.
    files = [p for p in (tmp_path / "checkpoints" / "2").rglob("*") if p.is_file()]
    largest = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    for offset in (len(data) // 3, len(data) // 2):
        data[offset] ^= 0xFF
    largest.write_bytes(bytes(data))
    warnings = []
    restored = checkpoint.restore_newest(ckpts, ckpt_format.target(trainer), warn=warnings.append)
    assert restored.step == 1 and ckpts.steps() == [1]
    assert "checkpoints/2 is damaged" in warnings[0]
    aside = list((tmp_path / "checkpoints.set_aside").iterdir())
    assert [p.name.split(".")[0] for p in aside] == ["2"] and (aside[0] / "SET_ASIDE_REASON.txt").exists()
    # Nothing restores any more, but set-aside checkpoints exist: never silently start from step 0.
    (tmp_path / "checkpoints" / "1" / "meta" / "metadata").write_text("{not json")
    with pytest.raises(checkpoint.NoRestorableCheckpoint, match="refusing to start again from step 0"):
        checkpoint.restore_newest(ckpts, ckpt_format.target(trainer), warn=warnings.append)


def test_restore_params_only_starts_a_fresh_optimizer(tmp_path, trained):
    trainer, state, rng = trained
    source = checkpoint.Checkpoints(tmp_path / "src" / "checkpoints")
    source.save(2, ckpt_format.to_tree(trainer, state, rng), {})
    source.wait()
    config = tiny_config(data=8)
    config.checkpoint.update(restore_from=f"{tmp_path / 'src'}:2", restore_params_only=True)
    trainer = Trainer.build(config)  # the restore settings are the plan's: a trainer of this config restores
    begin = resume.start(trainer, checkpoint.Checkpoints(tmp_path / "run" / "checkpoints"), print)
    assert begin.step == 0 and not begin.resumed and "params of" in begin.origin
    for a, b in zip(jax.tree.leaves(begin.state["params"]), jax.tree.leaves(state["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    fresh = trainer.tx.init(state["params"])
    for a, b in zip(jax.tree.leaves(begin.state["opt_state"]), jax.tree.leaves(fresh)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_restore_from_parses_only_a_trailing_step():
    assert checkpoint.restore.parse_restore_from("/runs/a:b") == (pathlib.Path("/runs/a:b/checkpoints"), None)
    assert checkpoint.restore.parse_restore_from("/runs/a:120") == (pathlib.Path("/runs/a/checkpoints"), 120)
    with pytest.raises(checkpoint.RestoreFromError, match="does not exist"):
        checkpoint.open_source("/nonexistent/run:3")


def test_agreement_is_the_or_over_devices_and_processes():
    agree = preemption.Agreement(collective=True)  # the multi-process path, on this process's 8 devices
    assert agree.read(agree.post((False, True))) == (False, True)
    assert agree.read(agree.post((True, False))) == (True, False)
    assert preemption.Agreement().read(preemption.Agreement().post((True, False))) == (True, False)


def test_skip_policy_leaves_the_state_untouched_inside_the_step():
    config = tiny_config(data=8)
    config.train.on_nonfinite = "skip"
    config.fault_injection.nan_at_step = 2
    trainer = Trainer.build(config)
    train_step = faults.with_nan_injection(trainer)  # the NaN is injected outside the compiled step
    state, _ = train_step(trainer.init_state(), trainer.batch(0))
    before = numpy_tree(state)
    state, metrics = train_step(state, trainer.batch(1))
    assert float(metrics["skipped"]) == 1.0 and not np.isfinite(float(metrics["loss"]))
    for a, b in zip(jax.tree.leaves(numpy_tree(state["params"])), jax.tree.leaves(before["params"])):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(numpy_tree(state["opt_state"])), jax.tree.leaves(before["opt_state"])):
        np.testing.assert_array_equal(a, b)
    assert int(state["step"]) == 2
    state, metrics = train_step(state, trainer.batch(2))
    assert float(metrics["skipped"]) == 0.0 and np.isfinite(float(metrics["loss"]))


def test_goodput_counts_recomputed_steps_across_attempts(tmp_path):
    first = Goodput(tmp_path)
    for step in range(1, 6):
        first.step(step, 1.0)
    first.flush(137)
    second = Goodput(tmp_path)  # resumed from step 3: steps 4 and 5 are done again
    second.add("restore_s", 0.5)
    for step in range(4, 8):
        second.step(step, 1.0)
    second.flush(0)
    saved = json.loads((tmp_path / "goodput.json").read_text())
    assert [a["exit_status"] for a in saved["attempts"]] == [137, 0]
    assert saved["attempts"][1]["recomputed_steps"] == 2
    assert saved["totals"]["productive_s"] == 7.0 and saved["totals"]["recomputed_s"] == 2.0


def test_metrics_are_cut_back_to_the_restored_step(tmp_path):
    lines = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.9}, {"step": 2, "eval_loss": 1.1},
             {"step": 3, "loss": 0.8}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 4, "lo')
    resume.cut_metrics(tmp_path, 2)
    kept = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == lines[:3]


def test_pinned_host_copy_is_off_on_cpu_and_round_trips_exactly_when_forced(tmp_path, trained):
    from checkpoint import manager
    trainer, state, rng = trained
    tree = ckpt_format.to_tree(trainer, state, rng)
    assert not manager.pinned_host_copy_applies(tree)  # CPU: today's path, Orbax's own copy
    forced = checkpoint.Checkpoints(tmp_path / "checkpoints", pinned_host_copy=True)  # the GPU path, on CPU
    forced.save(1, tree, {})
    forced.wait()
    restored = checkpoint.restore_newest(forced, ckpt_format.target(trainer))  # checksums verified on restore
    expected = plain.flatten(numpy_tree(tree))
    for name, value in plain.flatten(restored.tree).items():
        np.testing.assert_array_equal(np.asarray(value), expected[name])
