"""Requests padded to a few shapes, so the model compiles a handful of times whatever lengths the tasks bring:
lengths rounded up to a power of two (capped at the model's sequence length), every batch padded to one size."""
from __future__ import annotations

from typing import Iterator

import numpy as np

MIN_LENGTH = 16


def bucket(n: int, cap: int | None = None) -> int:
    """The padded length of n tokens: the next power of two, at least MIN_LENGTH, at most `cap` when n fits."""
    size = max(MIN_LENGTH, 1 << max(n - 1, 0).bit_length())
    return size if cap is None or n > cap else min(size, cap)


def longest_first(rows: list[list[int]], batch_size: int) -> Iterator[list[int]]:
    """Indices of `rows` in batches of `batch_size`, longest rows first, so a batch's rows have similar lengths
    and the longest batch (the biggest shape) runs first."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    for begin in range(0, len(order), batch_size):
        yield order[begin:begin + batch_size]


def right_padded(rows: list[list[int]], length: int, batch: int, pad: int) -> np.ndarray:
    """int32 [batch, length]: each row at the left, `pad` after it and in the rows added to fill the batch."""
    out_BxL = np.full((batch, length), pad, np.int32)
    for i, row in enumerate(rows):
        out_BxL[i, :len(row)] = row
    return out_BxL


def left_padded(rows: list[list[int]], length: int, batch: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """(int32 [batch, length] with each row at the right, int32 [batch] the column each row starts at); the rows
    added to fill the batch hold one `pad` token."""
    out_BxL = np.full((batch, length), pad, np.int32)
    start_B = np.full((batch,), length - 1, np.int32)
    for i, row in enumerate(rows):
        out_BxL[i, length - len(row):] = row
        start_B[i] = length - len(row)
    return out_BxL, start_B
