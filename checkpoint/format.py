"""The checkpoint format in one place: a live state <-> the saved tree, for the saver and resume alike.

The saved tree is {"params", "opt_state", "step", "rng"} (and whatever else the run's state holds: an RL run's
reference policy) as plain nested dicts (plain.py), every
stacked-layer array in logical layer order, so any pipeline layout restores it; meta carries each array's
checksum (integrity.py). This layout on disk is unchanged since commit 604b7c2
(tests/fixtures/checkpoint_604b7c2 proves it). Arrays the run names `frozen` (a LoRA run's base) are left out and
handed back to `from_tree` from their own source.
"""
from __future__ import annotations

from typing import Any, Protocol

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from checkpoint import integrity, plain


class _Layout(Protocol):
    abstract_state: dict[str, Any]


class Placement(Protocol):
    """What a model placed on a mesh supplies (train.placed.Placed and train.trainer.Trainer do): its mesh, its
    abstract params in their shardings, and the saved-tree paths a checkpoint leaves out (read from elsewhere)."""
    mesh: jax.sharding.Mesh
    abstract_params: Any
    frozen: frozenset[str]


class Trainer(Placement, Protocol):
    """What a run supplies (train.trainer.Trainer does): a Placement, the abstract state in its shardings, and
    the maps between its in-memory layer order and the logical order a checkpoint keeps."""
    layout: _Layout

    def to_logical(self, state: dict[str, Any]) -> dict[str, Any]: ...

    def from_logical(self, state: dict[str, Any]) -> dict[str, Any]: ...


def rng_of(seed: int, mesh: jax.sharding.Mesh) -> jax.Array:
    """The run's root RNG key data (replicated): with the step, it fixes every batch and random draw."""
    return jax.device_put(jax.random.key_data(jax.random.key(seed)), NamedSharding(mesh, P()))


def _held(trainer: Placement, tree: dict[str, Any]) -> dict[str, Any]:
    """The plain tree of `tree` without the run's frozen arrays."""
    frozen = getattr(trainer, "frozen", frozenset())
    return plain.nest({k: v for k, v in plain.flatten(tree).items() if k not in frozen})


def frozen_target(placed: Placement) -> dict[str, Any]:
    """{path: ShapeDtypeStruct} of the arrays a checkpoint leaves out, in this run's shardings."""
    flat = plain.flatten({"params": placed.abstract_params})
    return {k: v for k, v in flat.items() if k in placed.frozen}


def params_target(placed: Placement) -> dict[str, Any]:
    """{"params": ...} of the saved tree as ShapeDtypeStructs in these shardings: what a params-only restore fills."""
    return _held(placed, {"params": placed.abstract_params})


def target(trainer: Trainer) -> dict[str, Any]:
    """The saved tree as ShapeDtypeStructs in this run's shardings: what a restore fills."""
    rng = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    rng = jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=NamedSharding(trainer.mesh, P()))
    return _held(trainer, {**trainer.layout.abstract_state, "rng": rng})


def to_tree(trainer: Trainer, state: dict[str, Any], rng: jax.Array) -> dict[str, Any]:
    """A live state (in this layout's layer order) and the RNG -> the tree a checkpoint saves."""
    return _held(trainer, {**trainer.to_logical(state), "rng": rng})


def to_tree_with_checksums(trainer: Trainer, state: dict[str, Any], rng: jax.Array) -> tuple[dict[str, Any], Any]:
    """The saved tree and its checksums, dispatched to the devices (not waited for)."""
    tree = to_tree(trainer, state, rng)
    return tree, integrity.device_checksums(tree)


def from_tree(trainer: Trainer, tree: dict[str, Any], frozen: dict[str, Any] | None = None) -> dict[str, Any]:
    """A restored tree -> this run's state, in its in-memory layer order (the RNG is tree["rng"]); `frozen` holds
    the arrays of `frozen_target` (logical layer order) when the run has any."""
    flat = {**plain.flatten({k: tree[k] for k in trainer.layout.abstract_state}), **(frozen or {})}
    logical = plain.from_plain(plain.nest(flat), trainer.layout.abstract_state)
    return trainer.from_logical(logical)


def params_from_tree(placed: Placement, params_tree: dict[str, Any],
                     frozen: dict[str, Any] | None = None) -> dict[str, Any]:
    """The restored "params" subtree (and the frozen arrays, as in from_tree) -> these params in logical layer
    order, for a params-only (fine-tuning) start or a placed model."""
    flat = {**plain.flatten({"params": params_tree}), **(frozen or {})}
    return plain.from_plain(plain.nest(flat)["params"], placed.abstract_params)
