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


def common_steps(steps: list[int], width: int = 8) -> list[int]:
    """The steps (of the newest `width` each process holds) that every process holds, oldest first."""
    if jax.process_count() == 1:
        return sorted(steps)
    from jax.experimental import multihost_utils
    mine = np.full(width, -1, np.int64)
    newest = sorted(steps)[-width:]
    mine[:len(newest)] = newest
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), width)
    shared = set(every[0].tolist()).intersection(*(set(row.tolist()) for row in every[1:]))
    return sorted(s for s in shared if s >= 0)
