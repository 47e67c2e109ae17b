"""Pipeline schedules as data: pure functions build a table of what each stage does in each time slot.

One executor runs any valid table, so a new schedule is a new per-stage order of actions, not new code. A backward
is one cell (BACKWARD), or two (zero-bubble schedules, Qi et al. 2023): INPUT_GRAD (B, the gradient of the chunk's
input, sent upstream at once) and WEIGHT_GRAD (W, the gradient of its weights, which nothing waits for).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from mesh.errors import UserError
from mesh.numbers import ceil_div

# Action kinds, and the fields of one table cell (the last axis of `Schedule.table`).
IDLE, FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = 0, 1, 2, 3, 4
KIND, MICROBATCH, CHUNK = 0, 1, 2
NAMES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb_h1", "zb_v")
V_SHAPED: tuple[str, ...] = ("zb_v",)  # chunks placed down and back up the stages (see chunk_map)
# What a backward kind computes: the input gradient the previous chunk waits for, the weight gradient, or both.
GIVES_INPUT_GRAD = (BACKWARD, INPUT_GRAD)
GIVES_WEIGHT_GRAD = (BACKWARD, WEIGHT_GRAD)

Action = tuple[int, int, int]  # (kind, virtual chunk c, microbatch i), as the per-stage orders list them


class ScheduleConfigError(UserError):
    """A pipeline setting the user can fix; the message is one line naming the setting."""


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """Who does what when, for `stages` (p) devices, `microbatches` (m) and `virtual_stages` (v).

    `table` is int32 [slots, p, 3]; `table[t, d]` is (kind, microbatch, chunk): kind IDLE, FORWARD, BACKWARD,
    INPUT_GRAD or WEIGHT_GRAD, and for an idle cell microbatch = chunk = -1. Chunk c on device d is model
    chunk k = c*p + d, so model chunk k lives on device k mod p (v=1: chunk 0 and k = d); a V-shaped schedule
    (`v_shape`) runs odd chunks back up the stages instead (chunk_map). A plain int array,
    rather than a record type, because the executor indexes it directly as one constant
    (`jnp.asarray(table)[t, d]`).
    The one-cell-per-(slot, stage) encoding cannot express a stage doing two things in one slot.
    Slot model: a forward, a backward, a B and a W cost the same, one slot (the executor steps all stages in
    lockstep, one slot per step); a message sent in slot t is usable from slot t+1.
    """
    name: str
    stages: int
    microbatches: int
    virtual_stages: int
    table: np.ndarray
    v_shape: bool = False

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

    @property
    def chunk_map(self) -> np.ndarray:
        """int [p, v]: the model chunk k that chunk c of device d runs (chunk_map(...) of this placement)."""
        return chunk_map(self.stages, self.virtual_stages, self.v_shape)


def chunk_map(p: int, v: int, v_shape: bool = False) -> np.ndarray:
    """int [p, v]: model chunk k of chunk c on device d. Looped (Megatron-LM's interleaving): k = c*p + d, so the
    activation of chunk c on device p-1 wraps around to device 0. V-shaped (Qi et al. 2023, ZB-V): odd chunks
    run back up, k = c*p + p-1-d, so device d holds chunks d and 2p-1-d (v=2): the turn at the last device
    and the first device's pair (the first chunk's embedding and the last chunk's loss) stay on one device.
    """
    return _chunk_map(p, v, bool(v_shape))


@functools.lru_cache(maxsize=256)
def _chunk_map(p: int, v: int, v_shape: bool) -> np.ndarray:
    d, c = np.meshgrid(np.arange(p), np.arange(v), indexing="ij")
    placed = np.where(v_shape & (c % 2 == 1), c * p + p - 1 - d, c * p + d)
    placed.flags.writeable = False  # shared by every caller
    return placed


def check_config(name: str, p: int, m: int, v: int = 1) -> None:
    """Raise ScheduleConfigError (one line, naming the config key) for a setting no table can satisfy."""
    if name not in NAMES:
        raise ScheduleConfigError(f"pipeline.schedule={name!r}: unknown schedule; use one of {', '.join(NAMES)}")
    if p < 1:
        raise ScheduleConfigError(f"mesh.pipeline={p}: need at least 1 pipeline stage")
    if m < 1:
        raise ScheduleConfigError(f"pipeline.microbatches={m}: need at least 1 microbatch")
    if name == "zb_v" and v != 2:
        raise ScheduleConfigError(f"pipeline.virtual_stages={v}: the zb_v schedule runs two chunks per stage; set 2")
    if name == "zb_v" and m < p:
        raise ScheduleConfigError(f"pipeline.microbatches={m}: the zb_v schedule needs at least as many microbatches "
                                  f"as the {p} pipeline stages; use {p} or more")
    if name == "interleaved":
        if v < 2:
            raise ScheduleConfigError(
                f"pipeline.virtual_stages={v}: the interleaved schedule needs at least 2 chunks per stage; "
                f"use 2 or more, or pipeline.schedule='1f1b'")
        if m % p:
            raise ScheduleConfigError(
                f"pipeline.microbatches={m}: the interleaved schedule needs a multiple of the "
                f"{p} pipeline stages; use {ceil_div(m, p) * p}")
        return
    if v != 1 and name != "zb_v":
        raise ScheduleConfigError(
            f"pipeline.virtual_stages={v}: only pipeline.schedule='interleaved' or 'zb_v' use virtual stages; "
            f"set it to 1")
    if name in ("1f1b", "zb_h1") and m < p:
        raise ScheduleConfigError(
            f"pipeline.microbatches={m}: the {name} schedule needs at least as many microbatches as the "
            f"{p} pipeline stages; use {p} or more")


def from_orders(name: str, p: int, m: int, v: int, orders: Sequence[Sequence[Action]],
                v_shape: bool = False) -> Schedule:
    """Time a per-stage order of actions as tightly as dependencies allow (list scheduling).

    Slot model: every action costs one slot, and a message sent in slot t (an activation to the next
    chunk, a gradient to the previous one) is usable from slot t+1. Each stage runs its next action in
    the first slot where its input has arrived, so idle cells are exactly what the order forces.
    """
    done = {kind: np.full((v * p, m), -1) for kind in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)}
    ks = chunk_map(p, v, v_shape)
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
            needed = _needs(done, kind, ks[d, c], i)
            if needed is None or 0 <= needed < slot:
                done[kind][ks[d, c], i] = slot
                row[d] = (kind, i, c)
                position[d] += 1
                remaining -= 1
        if (row[:, KIND] == IDLE).all():  # nothing new will ever arrive: the orders wait on each other
            raise ValueError(f"schedule {name} (p={p}, m={m}, v={v}): per-stage orders deadlock at slot {slot}")
        cells.append(row)
    schedule = Schedule(name, p, m, v, np.stack(cells), v_shape)
    validate(schedule)
    return schedule


def _needs(done: dict[int, np.ndarray], kind: int, k: int, i: int) -> int | None:
    """The slot of the action that (kind, model chunk k, microbatch i) waits for; None: nothing."""
    K = done[FORWARD].shape[0]
    if kind == FORWARD:
        return None if k == 0 else done[FORWARD][k - 1, i]
    if kind == WEIGHT_GRAD:  # the weight gradient reuses the output gradient B consumed, on the same stage
        return done[INPUT_GRAD][k, i]
    if k == K - 1:  # the last chunk's backward starts from its own loss, the others from the next chunk's
        return done[FORWARD][k, i]
    return max(done[BACKWARD][k + 1, i], done[INPUT_GRAD][k + 1, i])


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


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1): 1F1B with each backward split
    into B (input gradient, sent upstream at once) and W (weight gradient, nothing waits for it).

    Stage d warms up as in 1F1B (p-1-d forwards), then runs F, B and, d microbatches behind, W; the d W's it
    holds back run at the end, in the slots where 1F1B's stage d waits for the last gradients to drain
    upstream. With F, B and W one slot each the bubble is (p-1)/(3m+p-1) (the paper's (p-1)(T_F+T_B-T_W)
    with equal costs, against 1F1B's (p-1)(T_F+T_B+T_W)), and every stage keeps at most p stage inputs
    alive, 1F1B's peak (on its stage 0).
    """
    check_config("zb_h1", p, m)
    orders = []
    for d in range(p):
        warmup = p - 1 - d
        order = [(FORWARD, 0, i) for i in range(warmup)]
        for j in range(m):
            order += [(FORWARD, 0, warmup + j)] if warmup + j < m else []
            order += [(INPUT_GRAD, 0, j)] + ([(WEIGHT_GRAD, 0, j - d)] if j >= d else [])
        orders.append(order + [(WEIGHT_GRAD, 0, j) for j in range(max(m - d, 0), m)])
    return from_orders("zb_h1", p, m, 1, orders)


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al. 2023, section 4): two chunks per stage in V order (device d holds model chunks d and
    2p-1-d, chunk_map), each backward split into B and W, timed greedily under 1F1B's memory.

    Each slot a stage runs, in this order of preference: a B whose gradient has arrived (chunk 0 first); else a
    forward, the second chunk first (it brings a microbatch to its loss), while fewer than 2p chunk inputs (p
    stages' worth, 1F1B's stage-0 peak) are alive; else its oldest deferred W; else it idles. (Of the four
    chunk preferences, this one gave the smallest bubble over p = 2..8, m = p..4p, and never deadlocks there.)
    With F, B and W one slot each (a chunk is half a stage) every stage works 6m slots; the V keeps the first and
    last chunk on device 0, so the pipeline fills and drains in p-1 slots: bubble (p-1)/(6m+p-1) (reached
    exactly for p <= 4; tested).
    """
    check_config("zb_v", p, m, 2)
    return from_orders("zb_v", p, m, 2, _greedy_orders(p, m, 2, cap=2 * p), v_shape=True)


def _greedy_orders(p: int, m: int, v: int, cap: int) -> list[list[Action]]:
    """Per-stage orders of split backwards on the V placement, simulated slot by slot (see zb_v)."""
    ks, K = chunk_map(p, v, True), v * p
    slot = {kind: np.full((K, m), -1) for kind in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)}

    def ready(kind: int, k: int, i: int, t: int) -> bool:
        needed = _needs(slot, kind, k, i)
        return needed is None or 0 <= needed < t

    orders: list[list[Action]] = [[] for _ in range(p)]
    deferred: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    t = 0
    while (slot[WEIGHT_GRAD] < 0).any():
        if t > 8 * v * m * p:
            raise ValueError(f"schedule zb_v (p={p}, m={m}): the greedy orders deadlock")
        for d in range(p):
            alive = sum(int(((slot[FORWARD][k] >= 0) & (slot[WEIGHT_GRAD][k] < 0)).sum()) for k in ks[d])
            nxt = {kind: [int((slot[kind][ks[d, c]] >= 0).sum()) for c in range(v)] for kind in (FORWARD, INPUT_GRAD)}
            candidates = [(INPUT_GRAD, c) for c in range(v)]
            candidates += [(FORWARD, c) for c in reversed(range(v))] if alive < cap else []
            for kind, c in candidates:
                i = nxt[kind][c]
                if i < m and ready(kind, ks[d, c], i, t):
                    slot[kind][ks[d, c], i] = t
                    orders[d].append((kind, c, i))
                    deferred[d] += [(c, i)] if kind == INPUT_GRAD else []
                    break
            else:
                if deferred[d]:
                    c, i = deferred[d].pop(0)
                    slot[WEIGHT_GRAD][ks[d, c], i] = t
                    orders[d].append((WEIGHT_GRAD, c, i))
        t += 1
    return orders


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
    """The schedule named by `pipeline.schedule` (one of NAMES)."""
    check_config(name, p, m, v)
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "zb_h1":
        return zb_h1(p, m)
    if name == "zb_v":
        return zb_v(p, m)
    return interleaved(p, m, v)


def kind_slots(schedule: Schedule) -> dict[int, np.ndarray]:
    """{kind: int [K, m]} slot of each model chunk's action of that kind per microbatch, -1 if absent.

    Raises ValueError on an out-of-range cell or an action that appears twice.
    """
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    table, where = schedule.table, _where(schedule)
    if table.ndim != 3 or table.shape[1:] != (p, 3):
        raise ValueError(f"{where}: table has shape {table.shape}, expected [slots, {p}, 3]")
    slots = {kind: np.full((v * p, m), -1) for kind in _KIND_NAME}
    ks = schedule.chunk_map
    for t, d in zip(*np.nonzero(table[:, :, KIND] != IDLE)):
        kind, i, c = (int(x) for x in table[t, d])
        if kind not in slots or not 0 <= i < m or not 0 <= c < v:
            raise ValueError(f"{where}: slot {t} stage {d} holds (kind={kind}, microbatch={i}, chunk={c}), "
                             f"expected kind 1-4, microbatch < {m}, chunk < {v}")
        k = ks[d, c]
        if slots[kind][k, i] >= 0:
            raise ValueError(f"{where}: {_KIND_NAME[kind]} of microbatch {i} chunk {k} runs twice "
                             f"(slots {slots[kind][k, i]} and {t}, stage {d})")
        slots[kind][k, i] = t
    return slots


def action_slots(schedule: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(forward, input_grad, weight_grad): int [K, m] slot of each model chunk's forward, of the cell that
    computes its input gradient (BACKWARD or B) and of the one that computes its weight gradient (BACKWARD
    or W), per microbatch; -1 if absent. Without split backwards the last two are the same array."""
    slots = kind_slots(schedule)
    combined = slots[BACKWARD]
    return (slots[FORWARD], np.where(combined >= 0, combined, slots[INPUT_GRAD]),
            np.where(combined >= 0, combined, slots[WEIGHT_GRAD]))


def validate(schedule: Schedule) -> None:
    """Raise ValueError unless every (chunk, microbatch) forward and backward runs exactly once, in order.

    A backward is one BACKWARD cell or a B and a W cell, never both. Order: forward of model chunk k after
    forward of chunk k-1 (in an earlier slot); input gradient of chunk k after that of chunk k+1; the last
    chunk's after its own forward; hence on every stage a microbatch's forward before its backward; and W
    after its B. Two actions in one cell cannot be encoded (see Schedule).
    """
    where = _where(schedule)
    slots = kind_slots(schedule)
    split = (slots[INPUT_GRAD] >= 0) | (slots[WEIGHT_GRAD] >= 0)
    both = np.argwhere(split & (slots[BACKWARD] >= 0))
    if len(both):
        k, i = both[0]
        raise ValueError(f"{where}: microbatch {i} chunk {k} has a whole backward and a split one")
    forward, grad_in, grad_w = action_slots(schedule)
    for kind, found in ((FORWARD, forward), (INPUT_GRAD, grad_in), (WEIGHT_GRAD, grad_w)):
        missing = np.argwhere(found < 0)
        if len(missing):
            k, i = missing[0]
            name = _KIND_NAME[BACKWARD if kind != FORWARD and not split[k, i] else kind]
            raise ValueError(f"{where}: {name} of microbatch {i} chunk {k} is missing ({len(missing)} missing in all)")
    for k, i in np.ndindex(*forward.shape):
        _check_order(schedule, forward, grad_in, grad_w, k, i)


def _check_order(schedule: Schedule, forward: np.ndarray, grad_in: np.ndarray, grad_w: np.ndarray,
                 k: int, i: int) -> None:
    where, K = _where(schedule), schedule.num_chunks
    f, b, w = forward[k, i], grad_in[k, i], grad_w[k, i]
    if b <= f:
        raise ValueError(f"{where}: backward of microbatch {i} chunk {k} (slot {b}) does not follow "
                         f"its forward (slot {f}) on stage {np.argwhere(schedule.chunk_map == k)[0][0]}")
    if w < b:
        raise ValueError(f"{where}: weight gradient of microbatch {i} chunk {k} (slot {w}) runs before "
                         f"its input gradient (slot {b})")
    if k > 0 and f <= forward[k - 1, i]:
        raise ValueError(f"{where}: forward of microbatch {i} chunk {k} (slot {f}) runs before "
                         f"the forward of chunk {k - 1} it needs has arrived (slot {forward[k - 1, i]})")
    if k < K - 1 and b <= grad_in[k + 1, i]:
        raise ValueError(f"{where}: backward of microbatch {i} chunk {k} (slot {b}) runs before the "
                         f"gradient from chunk {k + 1} has arrived (slot {grad_in[k + 1, i]})")


def bubble_fraction(schedule: Schedule) -> float:
    """Idle cells / all cells of the table."""
    return float(np.mean(schedule.table[:, :, KIND] == IDLE))


def closed_form_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The bubble of the schedule's paper, as a fraction of all cells (our tables achieve it exactly).

    Megatron-LM (SC'21, sections 2.2.1-2.2.2) gives bubble time / ideal time = (p-1)/m, (p-1)/(vm) interleaved;
    as idle / total that is r/(1+r): (p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(vm+p-1) interleaved.
    In slots: each stage works 2vm slots and waits 2(p-1) (filling and draining), of 2(vm+p-1).
    ZB-H1 (Qi et al. 2023) works 3m slots (F, B, W) and waits p-1: (p-1)/(3m+p-1). ZB-V works 6m (F, B, W of
    two half-stage chunks) and at best waits p-1 to fill and drain: (p-1)/(6m+p-1), a lower bound its greedy
    table reaches for p <= 4 (a slot or a few more per stage beyond).
    """
    check_config(name, p, m, v)
    if name == "zb_h1":
        return (p - 1) / (3 * m + p - 1)
    if name == "zb_v":
        return (p - 1) / (6 * m + p - 1)
    return (p - 1) / (v * m + p - 1)


def closed_form_in_flight(name: str, p: int, m: int, v: int = 1) -> list[int]:
    """Per stage, the most stage inputs kept at once (max_in_flight), in closed form: GPipe m; 1F1B p-d;
    interleaved vp-d (chunks of 1/v of a stage); ZB-H1 p on every stage (1F1B's stage-0 peak); ZB-V 2p chunk
    inputs of half a stage on every stage (its cap, which it reaches), the same bytes."""
    check_config(name, p, m, v)
    per_stage = {"gpipe": lambda d: m, "1f1b": lambda d: p - d, "interleaved": lambda d: min(v * p - d, v * m),
                 "zb_h1": lambda d: p, "zb_v": lambda d: min(2 * p, 2 * m)}[name]
    return [per_stage(d) for d in range(p)]


def max_in_flight(schedule: Schedule) -> np.ndarray:
    """int [p]: per stage, the most (chunk, microbatch) pairs whose forward is done and backward is not
    (with split backwards: whose W is not, since W reads the stage input too).

    That is how many stage inputs a stage keeps for its backwards (v=1: microbatches): 1F1B p-d on
    stage d, GPipe m everywhere, interleaved vp-d pairs, each 1/v of a stage's layers.
    """
    p = schedule.stages
    kind = schedule.table[:, :, KIND]
    alive = np.cumsum((kind == FORWARD).astype(int) - np.isin(kind, GIVES_WEIGHT_GRAD).astype(int), axis=0)
    return alive.max(axis=0) if len(alive) else np.zeros(p, int)


def format_table(schedule: Schedule) -> str:
    """The table as text, one row per stage: F3 forward of microbatch 3, X3 its whole backward, B3 / W3 its input /
    weight gradient, with the chunk after a dot when v > 1 (F3.1); -- idle."""
    letter = {FORWARD: "F", BACKWARD: "X", INPUT_GRAD: "B", WEIGHT_GRAD: "W"}
    chunked = schedule.virtual_stages > 1
    cells = [["--" if kind == IDLE else f"{letter[kind]}{i}" + (f".{c}" if chunked else "")
              for kind, i, c in schedule.table[:, d]] for d in range(schedule.stages)]
    width = max(len(cell) for row in cells for cell in row)
    return "\n".join(f"stage {d}: " + " ".join(cell.rjust(width) for cell in row) for d, row in enumerate(cells))


_KIND_NAME = {FORWARD: "forward", BACKWARD: "backward", INPUT_GRAD: "input gradient (B)",
              WEIGHT_GRAD: "weight gradient (W)"}


def _where(schedule: Schedule) -> str:
    return (f"schedule {schedule.name} (p={schedule.stages}, m={schedule.microbatches}, "
            f"v={schedule.virtual_stages})")
