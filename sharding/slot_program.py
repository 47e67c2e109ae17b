"""The executor's slot program, read from a schedule table (numpy only): per time slot and stage the switch branch,
microbatch, chunk and buffer entries (slot_program), how often each branch and each send pattern runs (what the
audit weighs compiled collectives by), and which stage pairs carry a message in each slot (send_patterns)."""
from __future__ import annotations

import re

import numpy as np

from sharding import pipeline_stages as stages
from sharding import schedule_buffers, schedules


def slot_program(schedule: schedules.Schedule, train: bool) -> dict[str, np.ndarray]:
    """int32 [slots, p] per field: the branch each device runs in each slot, its microbatch and chunk, and
    the buffer entries it reads and writes (entry `size` is a scratch entry for cells that use none).

    Writes: `act_write` (from the previous stage) and `grad_write` (from the next), and for a V-shaped table
    the other channels it uses (`act_write_prev`, `act_write_self`, `grad_write_next`, `grad_write_self`).
    Evaluation (train=False) runs the same table with every backward cell idle, cut after its last forward.
    """
    kind, mb, chunk = (schedule.table[:, :, f] for f in (schedules.KIND, schedules.MICROBATCH, schedules.CHUNK))
    k = schedule.chunk_map[np.arange(schedule.stages)[None, :], np.maximum(chunk, 0)]
    place = np.where(k == 0, 0, np.where(k == schedule.num_chunks - 1, 2, 1))
    branch = np.full(kind.shape, stages.IDLE)
    branch = np.where(kind == schedules.FORWARD, stages.FWD_FIRST + place, branch)
    if train:
        branch = np.where(kind == schedules.BACKWARD, stages.BWD_FIRST + place, branch)
        split = {schedules.INPUT_GRAD: (stages.IDLE, stages.INPUT_MID, stages.INPUT_LAST),
                 schedules.WEIGHT_GRAD: (stages.BWD_FIRST, stages.WEIGHT_MID, stages.WEIGHT_LAST)}
        for action, by_place in split.items():
            branch = np.where(kind == action, np.asarray(by_place)[place], branch)
    acts, grads = schedule_buffers.activation_buffers(schedule), schedule_buffers.gradient_buffers(schedule)
    scratch = lambda a, plan: np.where(a < 0, plan.size, a)  # noqa: E731
    program = dict(branch=branch, mb=np.maximum(mb, 0), chunk=np.maximum(chunk, 0))
    for name, plan in (("act", acts), ("grad", grads)):  # the own channel first (see BufferPlan.writes)
        program[f"{name}_read"] = scratch(plan.read, plan)
        for n, (channel, write) in enumerate(plan.writes.items()):
            program[f"{name}_write" if n == 0 else f"{name}_write_{channel}"] = scratch(write, plan)
    sizes = [acts.size + 1, grads.size + 1]
    if not train:  # no gradients travel: one scratch entry
        program = {k: a[: np.nonzero(kind == schedules.FORWARD)[0].max() + 1] for k, a in program.items()
                   if not k.startswith("grad_write_")}
        program["grad_read"], program["grad_write"], sizes[1] = 0 * program["grad_read"], 0 * program["grad_write"], 1
    program = {k: a.astype(np.int32) for k, a in program.items()}
    program["sizes"] = np.array(sizes)
    return program


def branch_slot_counts(schedule: schedules.Schedule, train: bool = True) -> np.ndarray:
    """int [p, NUM_BRANCHES]: in how many slots each stage runs each `lax.switch` branch of the executor.

    Read from the executor's own slot program, so an audit can weigh the collectives of each branch by
    how often a device really runs it, where the compiled loop only says the switch runs every slot.
    """
    branch = slot_program(schedule, train)["branch"]
    n = stages.num_branches(train and has_split_backward(schedule))
    return np.stack([np.bincount(column, minlength=n) for column in branch.T])


def send_patterns(program: dict[str, np.ndarray], stages_: int) -> dict[str, tuple[np.ndarray, list[tuple]]]:
    """Per channel (a write field of the slot program that receives from another stage): int32 [slots] the
    pattern each slot takes, and per pattern the (source, target) stage pairs that carry a real message.

    A device receives on a channel in slot t exactly when the field's entry is not the scratch one; its source
    is d-1 for the fields fed by the previous stage (act_write, grad_write_next) and d+1 for the others (modulo
    p: only interleaving's ring wraps). The table is the same on every device, so the index is too, and a
    lax.switch on it sends only its pattern's pairs: no collective, and no traffic, from cells with nothing
    to send. A channel that never carries a message (evaluation's gradients) is left out.
    """
    scratch = {"act": program["sizes"][0] - 1, "grad": program["sizes"][1] - 1}
    out = {}
    for key in [k for k in program if "_write" in k and not k.endswith("_self")]:
        step = -1 if key in ("act_write", "grad_write_next") else 1
        receives = program[key] != scratch[key.split("_")[0]]  # bool [slots, p]
        per_slot = [tuple(((int(d) + step) % stages_, int(d)) for d in np.nonzero(row)[0]) for row in receives]
        distinct = sorted(set(per_slot))  # sorted: the empty pattern (if any) first, the same numbering every build
        if distinct != [()]:
            out[key] = (np.array([distinct.index(k) for k in per_slot], np.int32), distinct)
    return out


def send_slot_counts(schedule: schedules.Schedule, train: bool = True) -> dict[str, np.ndarray]:
    """Per channel: int [patterns] in how many slots its send switch takes each branch (send_patterns); the
    same on every device, so an audit can weigh each permute by how often its pattern runs."""
    patterns = send_patterns(slot_program(schedule, train), schedule.stages)
    return {key: np.bincount(index, minlength=len(pairs)) for key, (index, pairs) in patterns.items()}


def send_channel(op_name: str) -> str | None:
    """The channel whose send switch an HLO instruction (by its JAX op_name) sits in, or None."""
    found = re.search(r"/send_(\w+)/", op_name)
    return found.group(1) if found else None


def has_split_backward(schedule: schedules.Schedule) -> bool:
    """Whether the table runs backwards as B and W cells (zero-bubble schedules), so the executor needs them."""
    return bool(np.isin(schedule.table[:, :, schedules.KIND], (schedules.INPUT_GRAD, schedules.WEIGHT_GRAD)).any())
