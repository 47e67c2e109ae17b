"""Agreement between the processes of a run on what to restore, so that every process takes the same branch
and meets the others in the same collectives (a single process agrees with itself)."""
from __future__ import annotations

import jax
import numpy as np


def everyone(ok: bool) -> bool:
    """True when every process says ok, even when only one of them failed to read its slices."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils
    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _gathered(steps: list[int], width: int) -> np.ndarray:
    """Every process's newest `width` steps, one row per process, padded with -1."""
    from jax.experimental import multihost_utils
    mine = np.full(width, -1, np.int64)
    newest = sorted(steps)[-width:]
    mine[:len(newest)] = newest
    return np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), width)


def restorable_steps(own: list[int], held_for_next: list[int], width: int = 8) -> list[int]:
    """The steps every process can restore (oldest first): process j from its own copy, or from the copy that
    process j-1 holds for it (`held_for_next`: the steps this process keeps for process (i+1) % n)."""
    if jax.process_count() == 1:
        return sorted(own)
    owns, helds = _gathered(own, width), _gathered(held_for_next, width)
    n = jax.process_count()
    every = {int(s) for s in owns.reshape(-1)} | {int(s) for s in helds.reshape(-1)}
    return sorted(s for s in every if s >= 0 and all(s in owns[j] or s in helds[(j - 1) % n] for j in range(n)))
