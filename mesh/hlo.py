"""Collectives of an optimized HLO module: op, bytes (nccl-tests S), mesh axes spanned, executions per step
and the conditional branches they sit in.

Reads `jax.jit(f).lower(...).compile().as_text()`. Replica groups hold logical device ids, i.e.
positions in `mesh.devices.flat` (checked in tests/mesh/test_hlo.py by compiling on a permuted mesh).
Audit part (what XLA emitted); train/plan/audit.py maps the parts of `--audit`.
"""
from __future__ import annotations

import math
import re
from typing import Sequence

import numpy as np

from mesh.layout import axis_sizes

OPS = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
       "all-to-all": "all_to_all", "collective-permute": "collective_permute"}
# Async pairs: the -start carries the attributes and is counted; the -done is skipped.
STARTS = {f"{k}-start": v for k, v in OPS.items()}
DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}

_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([<=\d,]*)\]")  # f32[8,4], f32[<=8,4] (dynamic bound)
_CALLEE = re.compile(r"\b(?:to_apply|calls|body|condition)=%?([\w.\-]+)")  # conditionals: _branch_list
_CALLEE_LIST = re.compile(r"\bcalled_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def _split_shape(rest: str) -> tuple[str, str]:
    """'(f32[2]{0}, s32[]) all-reduce(...), ...' -> ('(f32[2]{0}, s32[])', 'all-reduce(...), ...')."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1:].lstrip()
    shape, _, tail = rest.partition(" ")
    return shape, tail


def _arrays(shape: str) -> list[tuple[str, list[int]]]:
    """All (dtype, dims) leaves of an HLO shape string, layouts ignored."""
    shape = re.sub(r"\{[^{}]*\}", "", shape)  # drop layouts like {1,0} and {1,0:T(8,128)}
    return [(dt, [int(d.lstrip("<=")) for d in dims.split(",") if d]) for dt, dims in _ARRAY.findall(shape)
            if dt in DTYPE_BYTES or dt.startswith("f8")]


def _nbytes(leaves) -> int:
    return int(sum(DTYPE_BYTES.get(dt, 1) * math.prod(dims) for dt, dims in leaves))


def _balanced(text: str, start: int) -> str:
    """The brace-balanced text starting at text[start] == '{'."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] == "{"
        depth -= text[i] == "}"
        if depth == 0:
            return text[start: i + 1]
    raise ValueError(f"unbalanced braces in HLO attribute: {text[start:start + 80]!r}")


def replica_groups(attrs: str, num_devices: int) -> list[list[int]] | None:
    """Decode `replica_groups=` in any of its syntaxes to lists of logical device ids.

    Explicit `{{0,2},{1,3}}` (and `{}`: all devices in one group); iota `[G,S]<=[dims]` and
    `[G,S]<=[dims]T(perm)` (arange over dims, transposed, reshaped to G groups of S); the mesh form
    `mesh['a'=2,'b'=4] {'b'}` with optional `device_ids=(...)` and sub-axes `'a':(pre)size`.
    Returns None when the instruction has no replica_groups.
    """
    at = attrs.find("replica_groups=")
    if at < 0:
        return None
    body = attrs[at + len("replica_groups="):]
    if body.startswith("{"):
        inner = _balanced(body, 0)[1:-1].strip()
        groups = [[int(v) for v in g.split(",") if v.strip()] for g in re.findall(r"\{([^{}]*)\}", inner)]
        return [g for g in groups if g] or [list(range(num_devices))]
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", body)
    if m:
        gs = [int(v) for v in m.group(1).split(",")]
        dims = [int(v) for v in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        return ids.reshape(gs[0], -1).tolist()
    if body.startswith("mesh["):
        depth, end = 0, 4
        for end in range(4, len(body)):
            depth += body[end] == "["
            depth -= body[end] == "]"
            if depth == 0:
                break
        brace = body.index("{", end)
        return _mesh_groups(body[5:end], body[end + 1:brace], _balanced(body, brace)[1:-1])
    raise ValueError(f"replica_groups: unrecognised syntax {body[:60]!r}")


def _device_ids(text: str, n: int) -> np.ndarray:
    """A mesh's device_ids: an explicit list of n ids, or an iota `[dims]T(perm)` (also `[..]<=[dims]T(perm)`):
    arange(n) reshaped to dims and transposed. An explicit list has n entries, one of them 0, so it can
    never read as iota dims multiplying to n."""
    m = re.fullmatch(r"\s*(?:\[[\d,]+\]<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", text)
    if m:
        dims = [int(v) for v in m.group(1).split(",")]
        if math.prod(dims) == n and (m.group(2) or len(dims) != n):
            ids = np.arange(n).reshape(dims)
            return (ids.transpose([int(v) for v in m.group(2).split(",")]) if m.group(2) else ids).reshape(-1)
    ids = np.array([int(v) for v in re.findall(r"\d+", text)])
    if sorted(ids.tolist()) != list(range(n)):
        raise ValueError(f"replica_groups: cannot read device_ids=({text}) as a permutation of {n} devices")
    return ids


def _mesh_groups(axes_text: str, between: str, group_text: str) -> list[list[int]]:
    """Groups of the mesh form: devices that agree on every coordinate outside the grouped (sub-)axes."""
    names, sizes = [], []
    for name, size in re.findall(r"'?([\w.\-]+)'?\s*=\s*(\d+)", axes_text.split("device_ids")[0]):
        names.append(name)
        sizes.append(int(size))
    ids_text = re.search(r"device_ids=\((.*)\)", axes_text + between)
    ids = _device_ids(ids_text.group(1), math.prod(sizes)) if ids_text else np.arange(math.prod(sizes))
    coords = np.stack(np.unravel_index(np.arange(math.prod(sizes)), sizes), -1)  # position -> coordinates
    key = coords.copy()
    size_of = 1
    for part in filter(None, (p.strip() for p in group_text.split(","))):
        ref = re.fullmatch(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", part)
        if ref is None or ref.group(1) not in names:
            raise ValueError(f"replica_groups: cannot read mesh axis {part!r} of mesh[{axes_text}]")
        a = names.index(ref.group(1))
        pre, sub = (int(ref.group(2)), int(ref.group(3))) if ref.group(2) else (1, sizes[a])
        digit = (coords[:, a] // pre) % sub
        key[:, a] -= digit * pre  # forget the grouped digit: members differ only there
        size_of *= sub
    groups: dict[tuple, list[int]] = {}
    for pos, k in enumerate(map(tuple, key)):
        groups.setdefault(k, []).append(int(ids[pos]))
    out = list(groups.values())
    assert all(len(g) == size_of for g in out), (axes_text, group_text)
    return out


def _pairs(attrs: str) -> list[tuple[int, int]]:
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    return [] if not m else [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)", m.group(1) + "}")]


def axes_of_groups(groups: Sequence[Sequence[int]], mesh) -> list[str]:
    """Mesh axes (in mesh order) whose coordinates vary inside at least one group."""
    shape = mesh.devices.shape
    varying = np.zeros(len(shape), bool)
    for g in groups:
        if len(g) > 1:
            c = np.stack(np.unravel_index(np.asarray(g), shape), -1)
            varying |= np.ptp(c, axis=0) > 0
    return [a for a, v in zip(mesh.axis_names, varying) if v]


def _parse(hlo_text: str):
    """{computation: [(name, shape, opcode, attrs)]}, the entry's name."""
    comps: dict[str, list] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if current is None:
            m = _COMP_HEAD.match(line)
            if m and not line.startswith("HloModule"):
                current = m.group(2)
                comps[current] = []
                entry = current if m.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            shape, tail = _split_shape(m.group(2))
            op = re.match(r"([\w\-]+)\(", tail)
            if op:
                comps[current].append((m.group(1), shape, op.group(1), tail[op.end():]))
    if entry is None:
        raise ValueError("hlo_text: no ENTRY computation found; pass compiled.as_text()")
    return comps, entry


def _branch_list(attrs: str) -> list[str]:
    """A conditional's branch computations in index order. The predicate form lists `false` first,
    since lax.cond's index 0 is its false branch."""
    m = re.search(r"\bbranch_computations=\{([^}]*)\}", attrs)
    if m:
        return [c.strip().lstrip("%") for c in m.group(1).split(",") if c.strip()]
    pred = [re.search(rf"\b{k}_computation=%?([\w.\-]+)", attrs) for k in ("false", "true")]
    return [b.group(1) for b in pred if b]


def _calls(comps):
    """Every call edge: (caller, instruction name, opcode, attrs, callee, branch index or None)."""
    for comp, instrs in comps.items():
        for name, _, opcode, attrs in instrs:
            if opcode in ("async-done", "async-update"):
                continue  # they name the same async computation as their -start
            if opcode == "conditional":
                for i, callee in enumerate(_branch_list(attrs)):
                    yield comp, name, opcode, attrs, callee, i
                continue
            for callee in _CALLEE.findall(attrs) + [c.strip().lstrip("%") for grp in _CALLEE_LIST.findall(attrs)
                                                     for c in grp.split(",") if c.strip()]:
                if callee in comps:
                    yield comp, name, opcode, attrs, callee, None


def _executions(comps, entry) -> tuple[dict[str, int], dict[str, bool]]:
    """Executions per step of every computation reachable from the entry, through while bodies
    (x known_trip_count), calls, fusions, async computations and conditional branches (each counted
    as if taken on every execution of its conditional: an upper bound), and whether every enclosing
    loop has a known trip count."""
    edges: dict[str, list[tuple[str, int, bool]]] = {c: [] for c in comps}
    for comp, _, opcode, attrs, callee, _ in _calls(comps):
        mult, known = 1, True
        if opcode == "while":
            trip = _TRIP.search(attrs)
            mult, known = (int(trip.group(1)), True) if trip else (1, False)
            if re.search(rf"\bcondition=%?{re.escape(callee)}\b", attrs):
                mult += 1
        edges[comp].append((callee, mult, known))
    count: dict[str, int] = {c: 0 for c in comps}
    trips_known: dict[str, bool] = {c: True for c in comps}
    count[entry] = 1
    for comp in _topological(edges, entry):
        for callee, mult, ok in edges[comp]:
            count[callee] += count[comp] * mult
            trips_known[callee] = trips_known[callee] and trips_known[comp] and ok
    return count, trips_known


def _op_name(attrs: str) -> str:
    m = re.search(r'\bop_name="([^"]*)"', attrs)
    return m.group(1) if m else ""


def _jax_branch_tags(cond_attrs: str, branch_instrs) -> set[int]:
    """The lax.switch indices JAX's name stack gives a branch's instructions: JAX lowers branch i of a
    `cond` named N under N/branch_i_fun, and XLA keeps that metadata through its passes."""
    prefix = _op_name(cond_attrs)
    if not prefix:
        return set()
    tag = re.compile(re.escape(prefix) + r"/branch_(\d+)_fun(?:/|$)")
    return {int(m.group(1)) for *_, attrs in branch_instrs for m in [tag.match(_op_name(attrs))] if m}


def _branch_paths(comps, entry, count) -> dict[str, list[dict] | None]:
    """Per computation, the conditional branches it runs in, outermost first ([] for none).

    A branch's index is its position in the conditional's branch list, which is the index XLA's
    conditional selects by, and for a lax.switch the switch index as long as no pass rewrote the
    index operand; JAX's name stack (branch_i_fun) confirms it, and where the two disagree the index
    is None. A computation reached along several different paths gets None: its branch cannot be told.
    """
    callers: dict[str, list[tuple[str, dict | None]]] = {c: [] for c in comps}
    for comp, name, opcode, attrs, callee, index in _calls(comps):
        if callee not in comps or not count[comp]:
            continue
        step = None
        if opcode == "conditional":
            tags = _jax_branch_tags(attrs, comps[callee])
            step = {"conditional": name, "index": index if not tags or tags == {index} else None,
                    "branches": len(_branch_list(attrs)), "count": count[comp], "op_name": _op_name(attrs)}
        callers[callee].append((comp, step))
    memo: dict[str, set] = {entry: {()}}

    def paths(comp) -> set:
        if comp not in memo:
            memo[comp] = {p + ((tuple(step.items()),) if step else ()) for caller, step in callers[comp]
                          for p in paths(caller)}
        return memo[comp]
    out: dict[str, list[dict] | None] = {}
    for comp in comps:
        found = paths(comp) if count[comp] else set()
        out[comp] = [dict(s) for s in next(iter(found))] if len(found) == 1 else ([] if not found else None)
    return out


def _topological(edges, root) -> list[str]:
    order, seen = [], set()

    def visit(c):
        if c in seen:
            return
        seen.add(c)
        for callee, _, _ in edges[c]:
            visit(callee)
        order.append(c)
    visit(root)
    return order[::-1]


def collectives(hlo_text: str, mesh) -> list[dict]:
    """One record per collective instruction of the module (async -start/-done pairs once):

    op: all_reduce | all_gather | reduce_scatter | all_to_all | collective_permute; shape, dtype: of the
    first array (tuple-shaped combined collectives list every leaf in `shapes`); bytes: one execution,
    the nccl-tests S (full buffer for all-reduce, all-to-all and permute, gathered output for
    all-gather, full input for reduce-scatter; tuples summed); axes: mesh axes its groups span, in mesh
    order ([] when every group is one device); group_size; count: executions per step (product of the
    known_trip_count of every enclosing while, through nested calls), an upper bound under a
    conditional, whose branches are each counted as taken on every execution; trips_known: False when
    an enclosing loop has no known trip count; branch: the conditional branches it sits in, outermost
    first, each {conditional: instruction name, index: branch index (the lax.switch index; None if
    XLA's numbering contradicts JAX's), branches: how many the conditional has, count: executions of
    the conditional per step, op_name: JAX's name for the conditional}, [] outside any conditional, None
    when reached along several paths;
    exact: trips_known and branch == [] (count is then exact); scalar: an all-reduce of single elements
    (loss, norms); name: the HLO instruction name; op_name: JAX's name for it (its name stack, '' if XLA
    dropped it); senders: how many devices send (a permute's pairs, which may leave devices out; for the
    other collectives every device).
    """
    comps, entry = _parse(hlo_text)
    count, trips_known = _executions(comps, entry)
    branch = _branch_paths(comps, entry, count)
    n = mesh.devices.size
    out = []
    for comp, instrs in comps.items():
        if count[comp] == 0:
            continue
        for name, shape, opcode, attrs in instrs:
            op = OPS.get(opcode) or STARTS.get(opcode)
            if op is None:
                continue
            leaves = _arrays(shape)
            if opcode.endswith("-start"):
                leaves = _start_payload(op, shape, leaves)
            groups, size = _groups(op, attrs, mesh, n)
            nbytes = _nbytes(leaves) * (size if op == "reduce_scatter" else 1)
            axes = axes_of_groups(groups, mesh)
            out.append({"op": op, "shape": leaves[0][1] if leaves else [], "dtype": leaves[0][0] if leaves else "",
                        "shapes": [[dt, dims] for dt, dims in leaves], "bytes": int(nbytes), "axes": axes,
                        "group_size": int(size) if axes else 1, "count": count[comp],
                        "trips_known": trips_known[comp], "branch": branch[comp],
                        "exact": trips_known[comp] and branch[comp] == [],
                        "scalar": op == "all_reduce" and all(math.prod(d) == 1 for _, d in leaves),
                        "name": name, "op_name": _op_name(attrs),
                        "senders": len(groups) if op == "collective_permute" else n})
    return out


def _groups(op: str, attrs: str, mesh, n: int) -> tuple[list[list[int]], int]:
    """A collective's device groups and how many devices one spans: a permute's are its (source, target)
    pairs, whose size is that of the mesh axes they cross; the others' are their replica groups."""
    if op == "collective_permute":
        groups = [list(p) for p in _pairs(attrs) if p[0] != p[1]]
        return groups, math.prod(axis_sizes(mesh)[a] for a in axes_of_groups(groups, mesh))
    groups = replica_groups(attrs, n) or [list(range(n))]
    return groups, max(len(g) for g in groups)


def _start_payload(op, shape, leaves):
    """The data leaves of an async -start's tuple shape.

    all-reduce-start: the result itself. all-gather-start: (operands, results), keep the results.
    collective-permute-start: (operand, result, context u32s...), keep the result.
    """
    if op == "all_gather":
        return leaves[len(leaves) // 2:]
    if op == "collective_permute":
        return leaves[1:2]
    return leaves

