"""Which window each row of a batch reads, as pure functions of (seed, step): epochs without replacement
through a keyed Feistel permutation of the window indices (stateless: nothing is stored), and the rows of a
mixture split among its sources by cumulative weight, so each source's sample count is known in closed form."""
from __future__ import annotations

import numpy as np

ROUNDS = 4
MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
WEIGHT_ONE = 1 << 32  # mixture weights as integers over 2^32: exact arithmetic for any step


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """A 64-bit avalanche of x ^ key (splitmix64's finalizer): the Feistel round function."""
    with np.errstate(over="ignore"):
        z = (x ^ key) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def permute(index: np.ndarray, n: int, seed: int, epoch: int, stream: int = 0) -> np.ndarray:
    """The image of `index` (values in [0, n)) under a permutation of [0, n) fixed by (seed, epoch, stream):
    a balanced Feistel network on the smallest even bit width covering n, cycle-walking values that land
    outside [0, n) (at most 4x the domain, so few walks)."""
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    low = np.uint64((1 << half) - 1)
    keys = np.random.SeedSequence([seed, epoch, stream]).generate_state(ROUNDS, dtype=np.uint64)
    x = np.asarray(index, dtype=np.uint64).copy()
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():
        left, right = x[todo] >> np.uint64(half), x[todo] & low
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & low)
        x[todo] = (left << np.uint64(half)) | right
        todo = x >= np.uint64(n)
    return x.astype(np.int64)


def epoch_windows(sample: np.ndarray, windows: int, seed: int, stream: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(epoch, window index) of each global sample number of a source with `windows` windows per epoch."""
    epoch, pos = np.divmod(np.asarray(sample, dtype=np.int64), windows)
    out = np.empty_like(pos)
    for e in np.unique(epoch):
        at = epoch == e
        out[at] = permute(pos[at], windows, seed, int(e), stream)
    return epoch, out


def integer_weights(weights: list[float]) -> list[int]:
    """Cumulative weights as integers over WEIGHT_ONE, the last exactly WEIGHT_ONE."""
    total = sum(weights)
    cumulative, acc = [], 0.0
    for w in weights[:-1]:
        acc += w
        cumulative.append(round(acc / total * WEIGHT_ONE))
    return cumulative + [WEIGHT_ONE]


def drawn_before(step: int, batch: int, cumulative: list[int]) -> list[int]:
    """Samples each source gave to steps 0..step-1: differences of floor(step * batch * W_j) over the
    cumulative weights W_j, so every count is a closed form of the step."""
    upto = [step * batch * c // WEIGHT_ONE for c in cumulative]
    return [b - a for a, b in zip([0] + upto[:-1], upto)]


def rows_of_step(step: int, batch: int, cumulative: list[int]) -> list[int]:
    """Rows of the batch of `step` that each source fills (in source order)."""
    return [b - a for a, b in zip(drawn_before(step, batch, cumulative), drawn_before(step + 1, batch, cumulative))]
