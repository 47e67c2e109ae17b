"""Pytrees <-> plain nested dicts keyed by path names, so a checkpoint reads back with a plain Orbax client
(optax's NamedTuple states become {"0": {"mu": {...}}}) and every array has a stable name ('params/embed')."""
from __future__ import annotations

from typing import Any, Callable

import jax


def key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> dict[str, Any]:
    """{'a/b/c': leaf} in the tree's own leaf order; empty nodes (optax's EmptyState) vanish."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return {"/".join(key_name(k) for k in path): leaf for path, leaf in leaves}


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{'a/b': x} -> {'a': {'b': x}}."""
    out: dict[str, Any] = {}
    for name, leaf in flat.items():
        *parents, last = name.split("/")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = leaf
    return out


def to_plain(tree: Any) -> dict[str, Any]:
    return nest(flatten(tree))


def from_plain(plain: dict[str, Any], like: Any) -> Any:
    """The leaves of `plain` put back into the structure of `like` (matched by path name)."""
    flat = flatten(plain)
    names = list(flatten(like))
    _, treedef = jax.tree_util.tree_flatten(like)
    return jax.tree_util.tree_unflatten(treedef, [flat[name] for name in names])
