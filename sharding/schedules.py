"""Pipeline schedules as data: pure functions build a table of what each stage does in each time slot.

One executor runs any valid table, so a new schedule is a new per-stage order of actions, not new code.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from mesh.errors import UserError

# Action kinds, and the fields of one table cell (the last axis of `Schedule.table`).
IDLE, FORWARD, BACKWARD = 0, 1, 2
KIND, MICROBATCH, CHUNK = 0, 1, 2
NAMES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")

Action = tuple[int, int, int]  # (kind, virtual chunk c, microbatch i), as the per-stage orders list them


class ScheduleConfigError(UserError):
    """A pipeline setting the user can fix; the message is one line naming the setting."""


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """Who does what when, for `stages` (p) devices, `microbatches` (m) and `virtual_stages` (v).

    `table` is int32 [slots, p, 3]; `table[t, d]` is (kind, microbatch, chunk): kind IDLE/FORWARD/BACKWARD,
    and for an idle cell microbatch = chunk = -1. Chunk c on device d is model chunk k = c*p + d, so
    model chunk k lives on device k mod p (v=1: chunk 0 and k = d). A plain int array, rather than a
    record type, because the executor indexes it directly as one constant (`jnp.asarray(table)[t, d]`).
    The one-cell-per-(slot, stage) encoding cannot express a stage doing two things in one slot.
    Slot model: a forward and a backward cost the same, one slot (the executor steps all stages in
    lockstep, one slot per step); a message sent in slot t is usable from slot t+1.
    """
    name: str
    stages: int
    microbatches: int
    virtual_stages: int
    table: np.ndarray

    def __post_init__(self):
        table = np.array(self.table, dtype=np.int32)  # a private read-only copy keeps the schedule frozen
        table.setflags(write=False)
        object.__setattr__(self, "table", table)

    @property
    def num_slots(self) -> int:
        return self.table.shape[0]

    @property
    def num_chunks(self) -> int:
        """Model chunks K = v*p."""
        return self.virtual_stages * self.stages


def check_config(name: str, p: int, m: int, v: int = 1) -> None:
    """Raise ScheduleConfigError (one line, naming the config key) for a setting no table can satisfy."""
    if name not in NAMES:
        raise ScheduleConfigError(f"pipeline.schedule={name!r}: unknown schedule; use one of {', '.join(NAMES)}")
    if p < 1:
        raise ScheduleConfigError(f"mesh.pipeline={p}: need at least 1 pipeline stage")
    if m < 1:
        raise ScheduleConfigError(f"pipeline.microbatches={m}: need at least 1 microbatch")
    if name == "interleaved":
        if v < 2:
            raise ScheduleConfigError(
                f"pipeline.virtual_stages={v}: the interleaved schedule needs at least 2 chunks per stage; "
                f"use 2 or more, or pipeline.schedule='1f1b'")
        if m % p:
            raise ScheduleConfigError(
                f"pipeline.microbatches={m}: the interleaved schedule needs a multiple of the "
                f"{p} pipeline stages; use {-(-m // p) * p}")
        return
    if v != 1:
        raise ScheduleConfigError(
            f"pipeline.virtual_stages={v}: only pipeline.schedule='interleaved' uses virtual stages; set it to 1")
    if name == "1f1b" and m < p:
        raise ScheduleConfigError(
            f"pipeline.microbatches={m}: the 1f1b schedule needs at least as many microbatches as the "
            f"{p} pipeline stages; use {p} or more")


def from_orders(name: str, p: int, m: int, v: int, orders: Sequence[Sequence[Action]]) -> Schedule:
    """Time a per-stage order of actions as tightly as dependencies allow (list scheduling).

    Slot model: every action costs one slot, and a message sent in slot t (an activation to the next
    chunk, a gradient to the previous one) is usable from slot t+1. Each stage runs its next action in
    the first slot where its input has arrived, so idle cells are exactly what the order forces.
    """
    K = v * p
    done = {FORWARD: np.full((K, m), -1), BACKWARD: np.full((K, m), -1)}
    position = [0] * p
    cells: list[np.ndarray] = []
    remaining = sum(len(order) for order in orders)
    while remaining:
        slot = len(cells)
        row = np.tile(np.array([IDLE, -1, -1], np.int32), (p, 1))
        for d in range(p):
            if position[d] == len(orders[d]):
                continue
            kind, c, i = orders[d][position[d]]
            k = c * p + d
            if kind == FORWARD:
                needed = None if k == 0 else done[FORWARD][k - 1, i]
            else:  # the last chunk's backward starts from its own loss, the others from the next chunk's
                needed = done[FORWARD][k, i] if k == K - 1 else done[BACKWARD][k + 1, i]
            if needed is None or 0 <= needed < slot:
                done[kind][k, i] = slot
                row[d] = (kind, i, c)
                position[d] += 1
                remaining -= 1
        if (row[:, KIND] == IDLE).all():  # nothing new will ever arrive: the orders wait on each other
            raise ValueError(f"schedule {name} (p={p}, m={m}, v={v}): per-stage orders deadlock at slot {slot}")
        cells.append(row)
    schedule = Schedule(name, p, m, v, np.stack(cells))
    validate(schedule)
    return schedule


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): every microbatch's forward, then every backward (in microbatch order).

    All m microbatches' activations are alive on every stage at the turn; bubble (p-1)/(m+p-1), the
    paper's O((K-1)/(M+K-1)) with K stages and M microbatches.
    """
    check_config("gpipe", p, m)
    order = [(FORWARD, 0, i) for i in range(m)] + [(BACKWARD, 0, i) for i in range(m)]
    return from_orders("gpipe", p, m, 1, [order] * p)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B, as PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training").

    Stage d runs p-1-d warm-up forwards, then alternates one forward and one backward, then drains the
    remaining backwards. A backward starts as soon as possible, so stage d holds at most p-d
    microbatches' activations (p on stage 0) instead of m; the bubble is GPipe's, (p-1)/(m+p-1).
    """
    check_config("1f1b", p, m)
    forwards = [(FORWARD, 0, i) for i in range(m)]
    backwards = [(BACKWARD, 0, i) for i in range(m)]
    return from_orders("1f1b", p, m, 1, [_warmup_then_alternate(forwards, backwards, p - 1 - d) for d in range(p)])


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B of Megatron-LM (Narayanan et al., SC'21, section 2.2.2) over v chunks per stage.

    Each device holds v non-contiguous chunks (chunk c on device d is model chunk c*p + d). Forwards go
    in rounds of p microbatches through chunk 0, then the same p through chunk 1, ...; backwards visit
    the chunks in reverse; warm-up, 1F1B, cool-down as in 1F1B. A chunk is 1/v of a stage, so the
    pipeline fills v times faster: bubble (p-1)/(vm+p-1).
    Warm-up: Megatron-LM's code runs 2(p-1-d) + (v-1)p forwards on stage d. In this lockstep slot model
    (p-1-d) + (v-1)p already reaches the closed-form bubble (tested over a grid of p, m, v) and keeps
    vp-d chunk inputs alive instead of vp+p-1-2d: p stages' worth of activations on stage 0, as in
    1F1B, instead of (p-1)/v more. With real latencies the deeper warm-up may hide delays this does not.
    """
    check_config("interleaved", p, m, v)
    return from_orders("interleaved", p, m, v, _interleaved_orders(p, m, v))


def _interleaved_orders(p: int, m: int, v: int, megatron_warmup: bool = False) -> list[list[Action]]:
    def action(kind: int, n: int) -> Action:  # the n-th forward (or backward) on a device
        rounds, r = divmod(n, p * v)
        c = r // p if kind == FORWARD else v - 1 - r // p
        return kind, c, rounds * p + r % p

    forwards = [action(FORWARD, n) for n in range(v * m)]
    backwards = [action(BACKWARD, n) for n in range(v * m)]
    depth = 2 if megatron_warmup else 1
    return [_warmup_then_alternate(forwards, backwards, depth * (p - 1 - d) + (v - 1) * p) for d in range(p)]


def _warmup_then_alternate(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """`warmup` forwards, then one forward and one backward in turn, then the remaining backwards."""
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for pair in zip(forwards[warmup:], backwards):
        order += pair
    return order + backwards[len(forwards) - warmup:]


def build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule named by `pipeline.schedule` ('gpipe' | '1f1b' | 'interleaved')."""
    check_config(name, p, m, v)
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    return interleaved(p, m, v)


def action_slots(schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward): int [K, m] slot of each model chunk's action per microbatch, -1 if absent.

    Raises ValueError on an out-of-range cell or an action that appears twice.
    """
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    table, where = schedule.table, _where(schedule)
    if table.ndim != 3 or table.shape[1:] != (p, 3):
        raise ValueError(f"{where}: table has shape {table.shape}, expected [slots, {p}, 3]")
    slots = {FORWARD: np.full((v * p, m), -1), BACKWARD: np.full((v * p, m), -1)}
    for t, d in zip(*np.nonzero(table[:, :, KIND] != IDLE)):
        kind, i, c = (int(x) for x in table[t, d])
        if kind not in slots or not 0 <= i < m or not 0 <= c < v:
            raise ValueError(f"{where}: slot {t} stage {d} holds (kind={kind}, microbatch={i}, chunk={c}), "
                             f"expected kind 1|2, microbatch < {m}, chunk < {v}")
        k = c * p + d
        if slots[kind][k, i] >= 0:
            raise ValueError(f"{where}: {_KIND_NAME[kind]} of microbatch {i} chunk {k} runs twice "
                             f"(slots {slots[kind][k, i]} and {t}, stage {d})")
        slots[kind][k, i] = t
    return slots[FORWARD], slots[BACKWARD]


def validate(schedule: Schedule) -> None:
    """Raise ValueError unless every (chunk, microbatch) forward and backward runs exactly once, in order.

    Order: forward of model chunk k after forward of chunk k-1 (in an earlier slot); backward of chunk k
    after backward of chunk k+1; the last chunk's backward after its own forward; hence on every stage
    a microbatch's forward before its backward. Two actions in one cell cannot be encoded (see Schedule).
    """
    where = _where(schedule)
    forward, backward = action_slots(schedule)
    for kind, slots in ((FORWARD, forward), (BACKWARD, backward)):
        missing = np.argwhere(slots < 0)
        if len(missing):
            k, i = missing[0]
            raise ValueError(f"{where}: {_KIND_NAME[kind]} of microbatch {i} chunk {k} is missing "
                             f"({len(missing)} missing in all)")
    K = schedule.num_chunks
    for k in range(K):
        for i in range(schedule.microbatches):
            f, b = forward[k, i], backward[k, i]
            if b <= f:
                raise ValueError(f"{where}: backward of microbatch {i} chunk {k} (slot {b}) does not follow "
                                 f"its forward (slot {f}) on stage {k % schedule.stages}")
            if k > 0 and f <= forward[k - 1, i]:
                raise ValueError(f"{where}: forward of microbatch {i} chunk {k} (slot {f}) runs before "
                                 f"the forward of chunk {k - 1} it needs has arrived (slot {forward[k - 1, i]})")
            if k < K - 1 and b <= backward[k + 1, i]:
                raise ValueError(f"{where}: backward of microbatch {i} chunk {k} (slot {b}) runs before the "
                                 f"gradient from chunk {k + 1} has arrived (slot {backward[k + 1, i]})")


def bubble_fraction(schedule: Schedule) -> float:
    """Idle cells / all cells of the table."""
    return float(np.mean(schedule.table[:, :, KIND] == IDLE))


def closed_form_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The bubble of the schedule's paper, as a fraction of all cells (our tables achieve it exactly).

    Megatron-LM (SC'21, sections 2.2.1-2.2.2) gives bubble time / ideal time = (p-1)/m, (p-1)/(vm) interleaved;
    as idle / total that is r/(1+r): (p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(vm+p-1) interleaved.
    In slots: each stage works 2vm slots and waits 2(p-1) (filling and draining), of 2(vm+p-1).
    """
    check_config(name, p, m, v)
    return (p - 1) / (v * m + p - 1)


def max_in_flight(schedule: Schedule) -> np.ndarray:
    """int [p]: per stage, the most (chunk, microbatch) pairs whose forward is done and backward is not.

    That is how many stage inputs a stage keeps for its backwards (v=1: microbatches): 1F1B p-d on
    stage d, GPipe m everywhere, interleaved vp-d pairs, each 1/v of a stage's layers.
    """
    p = schedule.stages
    kind = schedule.table[:, :, KIND]
    alive = np.cumsum((kind == FORWARD).astype(int) - (kind == BACKWARD).astype(int), axis=0)
    return alive.max(axis=0) if len(alive) else np.zeros(p, int)


_KIND_NAME = {FORWARD: "forward", BACKWARD: "backward"}


def _where(schedule: Schedule) -> str:
    return (f"schedule {schedule.name} (p={schedule.stages}, m={schedule.microbatches}, "
            f"v={schedule.virtual_stages})")
