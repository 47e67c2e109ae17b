"""The `meta` item of a checkpoint: what wrote it (config, mesh, partition specs, versions) and the shape,
dtype and checksum of every array; and the check that a checkpoint fits the arrays a config expects."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from checkpoint import plain
from checkpoint.errors import IncompatibleCheckpoint

FORMAT = 1


def describe(tree: Any, checksums: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """{path: {shape, dtype, checksum}} for every array of `tree` (arrays or ShapeDtypeStructs)."""
    return {name: {"shape": list(np.shape(x)), "dtype": str(np.dtype(x.dtype)), "checksum": checksums.get(name)}
            for name, x in plain.flatten(tree).items()}


def build(tree: Any, checksums: Mapping[str, str], **info: Any) -> dict[str, Any]:
    """The JSON-ready meta of a checkpoint of `tree`; `info` holds config, mesh, specs, versions."""
    return {"format": FORMAT, **info, "arrays": describe(tree, checksums)}


def _fmt(entry: Mapping[str, Any] | None) -> str:
    return "absent" if entry is None else f"{entry['dtype']}{tuple(entry['shape'])}"


def check_compatible(meta: Mapping[str, Any], target: Any, where: str, prefix: str = "") -> None:
    """Raise IncompatibleCheckpoint unless the checkpoint holds every array of `target` (restricted to
    paths under `prefix`) with the same shape and dtype, and no other array under `prefix`."""
    saved = {k: v for k, v in meta["arrays"].items() if k.startswith(prefix)}
    wanted = {k: {"shape": list(x.shape), "dtype": str(np.dtype(x.dtype))}
              for k, x in plain.flatten(target).items() if k.startswith(prefix)}
    diffs = [f"{name}: checkpoint {_fmt(saved.get(name))}, config {_fmt(wanted.get(name))}"
             for name in sorted(set(saved) | set(wanted))
             if (saved.get(name) or {}).get("shape") != (wanted.get(name) or {}).get("shape")
             or (saved.get(name) or {}).get("dtype") != (wanted.get(name) or {}).get("dtype")]
    if diffs:
        more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
        raise IncompatibleCheckpoint(
            f"checkpoint {where} holds a different model or optimizer shape than the config ({diffs[0]}{more}); "
            f"set model.*/optimizer.* back to the values in its meta, or use a new --workdir")


def _dotted(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, Mapping):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_dotted(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """'key: old -> new' for every config value that differs between a checkpoint's meta and now."""
    a, b = _dotted(saved), _dotted(current)
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731  (JSON turns tuples into lists)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if norm(a.get(k)) != norm(b.get(k))]
