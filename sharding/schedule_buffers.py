"""Buffer plans for a schedule: where each stage keeps the messages it receives until its backward.

Messages have known lifetimes in a table, so entries are assigned ahead of time and an executor needs
only a fixed-size buffer per stage, indexed from two small per-slot lookup tables.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from sharding.schedules import (
    BACKWARD,
    CHUNK,
    FORWARD,
    INPUT_GRAD,
    KIND,
    MICROBATCH,
    WEIGHT_GRAD,
    Schedule,
    action_slots,
)


@dataclasses.dataclass(frozen=True, eq=False)
class BufferPlan:
    """One kind of message (activations or gradients) on every stage; arrays indexed [stage d, chunk c, mb i].

    arrive:  slot from which the message for (d, c, i) is usable; it was sent in slot arrive-1 and is
             stored at the end of that slot. -1 where no message exists.
    release: last slot that reads it (the backward of (c, i) on d, or its W when the backward is split);
             its entry is free from release+1.
    entry:   index in stage d's buffer, in [0, size); -1 where no message exists.
    size:    entries per stage: the most messages any stage holds at once (one shape for all stages,
             as SPMD needs); 0 when nothing is ever sent (p=1, v=1).
    writes:  {channel: [slots, p]} entry that stores the message received on that channel at the end of
             slot t, -1 if none. Channels: NEXT (from device d-1, the executor's send to the next stage),
             PREV (from d+1) and SELF (a V-shaped schedule's turn, where chunk k-1 runs on the same device);
             the kind's own direction first (activations NEXT, gradients PREV), the others only if used.
    read:    [slots, p] entry the action in slot t reads, -1 if it reads none.
    In a slot the executor reads `read[t, d]`, acts, sends, then stores what arrived at `writes[..][t, d]`,
    so an entry released in slot t can take the message that arrives at the end of slot t.
    """
    arrive: np.ndarray
    release: np.ndarray
    entry: np.ndarray
    size: int
    writes: dict[str, np.ndarray]
    read: np.ndarray


NEXT, PREV, SELF = "next", "prev", "self"


def activation_buffers(schedule: Schedule) -> BufferPlan:
    """Inputs of model chunks 1..K-1, received from the previous chunk's device (d-1 mod p; V-shaped: d-1, d+1
    on the way back, or d itself at the turn).

    Kept from arrival until the chunk's backward (its W when split), which recomputes its forward from them
    (jax.vjp). Model chunk 0's input is the step's own microbatch, read from the batch, so it takes no entry.
    Its forward and its backward cells (B and W) all read the entry.
    """
    forward, _, weight_grad = action_slots(schedule)
    K = schedule.num_chunks
    arrive = np.full((K, schedule.microbatches), -1)
    arrive[1:] = forward[:-1] + 1
    release = np.where(arrive >= 0, weight_grad, -1)
    return _plan(schedule, arrive, release, readers=(FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD),
                 source=lambda k: k - 1, own=NEXT)


def gradient_buffers(schedule: Schedule) -> BufferPlan:
    """Output gradients of model chunks 0..K-2, received from the next chunk's device (d+1 mod p; V-shaped:
    d+1, d-1 on the way back, or d itself at the turn).

    Kept from arrival until the chunk's backward consumes them (B and W both do, so until W). The last
    chunk's output gradient comes from its own loss inside its backward, so it takes no entry.
    """
    _, input_grad, weight_grad = action_slots(schedule)
    K = schedule.num_chunks
    arrive = np.full((K, schedule.microbatches), -1)
    arrive[:-1] = input_grad[1:] + 1
    release = np.where(arrive >= 0, weight_grad, -1)
    return _plan(schedule, arrive, release, readers=(BACKWARD, INPUT_GRAD, WEIGHT_GRAD), source=lambda k: k + 1,
                 own=PREV)


def _channel(schedule: Schedule, src: int, dst: int, own: str) -> str:
    """The channel a message from device `src` to `dst` travels on: a looped placement sends each kind one
    way round the ring; a V-shaped one (no ring) sends to a neighbour on either side, or keeps it."""
    if not schedule.v_shape:
        return own
    if src == dst:
        return SELF
    return NEXT if dst == src + 1 else PREV


def _plan(schedule: Schedule, arrive_k: np.ndarray, release_k: np.ndarray, readers: tuple[int, ...],
          source: Callable[[int], int], own: str) -> BufferPlan:
    """Assign entries per stage from lifetimes indexed by model chunk k ([K, m]; chunk c of device d is
    schedule.chunk_map[d, c])."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    T = schedule.num_slots
    def to_stage(a: np.ndarray) -> np.ndarray:  # [K, m] -> [d, c, i]
        return a[schedule.chunk_map]

    arrive, release = to_stage(arrive_k), to_stage(release_k)
    entry = np.full((p, v, m), -1)
    device_of = {int(k): d for (d, c), k in np.ndenumerate(schedule.chunk_map)}
    writes = {own: np.full((T, p), -1)}
    size = 0
    for d in range(p):
        # Interval-graph colouring: taking messages by arrival and giving each the lowest free entry
        # uses exactly as many entries as messages alive at once, the least any assignment can.
        free_from: list[int] = []  # per entry, the first slot it can hold a new message
        for c, i in sorted(zip(*np.nonzero(arrive[d] >= 0)), key=lambda ci: arrive[d][ci]):
            a, r = arrive[d, c, i], release[d, c, i]
            assert a <= r, f"message for stage {d} chunk {c} microbatch {i} arrives after its last reader"
            e = next((e for e, f in enumerate(free_from) if f <= a), len(free_from))
            if e == len(free_from):
                free_from.append(0)
            free_from[e] = r + 1
            entry[d, c, i] = e
            channel = _channel(schedule, device_of[source(int(schedule.chunk_map[d, c]))], d, own)
            write = writes.setdefault(channel, np.full((T, p), -1))
            assert write[a - 1, d] < 0, "two messages of one kind reach a stage on one channel in one slot"
            write[a - 1, d] = e
        size = max(size, len(free_from))
    read = np.full((T, p), -1)
    kind, mb, chunk = (schedule.table[:, :, f] for f in (KIND, MICROBATCH, CHUNK))
    reads = np.isin(kind, readers)
    t, d = np.nonzero(reads)
    read[t, d] = entry[d, chunk[t, d], mb[t, d]]
    return BufferPlan(arrive, release, entry, size, writes, read)
