"""Collective benchmark in the nccl-tests style, on whatever devices JAX sees, with the cost model beside it.

python -m mesh.bench --num_cpu_devices=8 --mesh=data:2,tensor:4 --min_bytes=1024 --max_bytes=1048576 \
    --json=FILE [--fit] [--plot=FILE.png] [--topology=NAME]
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from typing import Mapping, Sequence

import jax
import numpy as np
from absl import app, flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mesh import collectives as C
from mesh import cost, topology
from mesh.errors import UserError, check_writable
from mesh.layout import AXES, MeshConfigError, axis_sizes, make_mesh, use_cpu_devices

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "permute")
RECORD_KEYS = ("collective", "axis", "group_size", "bytes", "time_us", "algbw_gbps", "busbw_gbps", "predicted_us")

flags.DEFINE_integer("num_cpu_devices", 0, "virtual CPU devices to create (0: leave the platform alone)")
flags.DEFINE_string("mesh", "data:2,tensor:4", "mesh axis sizes, e.g. data:2,tensor:4 (others are 1)")
flags.DEFINE_integer("min_bytes", 1024, "smallest size S (bytes, nccl-tests convention)")
flags.DEFINE_integer("max_bytes", 1 << 20, "largest size S; sizes double from min_bytes")
flags.DEFINE_list("collectives", list(COLLECTIVES), "collectives to sweep")
flags.DEFINE_integer("iters", 20, "timed calls per row (the median is reported)")
flags.DEFINE_integer("warmup", 3, "untimed calls per row after compiling")
flags.DEFINE_string("json", None, "write one JSON record per row to this file")
flags.DEFINE_bool("fit", False, "fit alpha and beta per mesh axis and write them to --topology_out")
flags.DEFINE_string("topology_out", str(topology.local_file()), "where --fit writes the fitted topology")
flags.DEFINE_string("plot", None, "draw busbw against size into this PNG")
flags.DEFINE_string("topology", "local", "topology for the predicted column: a preset name or a .json file")
flags.DEFINE_integer("hosts", 0, "hosts of the --topology preset (0: its default)")


def parse_mesh(spec: str) -> dict[str, int]:
    """'data:2,tensor:4' -> {'data': 2, 'tensor': 4}."""
    sizes = {}
    for part in filter(None, spec.split(",")):
        name, _, size = part.partition(":")
        if name not in AXES or not size.isdigit():
            raise MeshConfigError(f"--mesh={spec}: write axis:size pairs with axes from {', '.join(AXES)}, "
                                  f"e.g. data:2,tensor:4")
        sizes[name] = int(size)
    return sizes


def byte_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    if not 4 <= min_bytes <= max_bytes:
        raise MeshConfigError(f"--min_bytes={min_bytes} --max_bytes={max_bytes}: need 4 <= min_bytes <= max_bytes")
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= 2
    return out


def _program(mesh, collective: str, axis: str, nbytes: int):
    """(jitted shard_map, input array, S actually moved): per-device float32 blocks sized so that S
    follows nccl-tests (the gathered output for all_gather, the full input otherwise)."""
    n = axis_sizes(mesh)[axis]
    elems = max(n, (nbytes // 4) // n * n)  # divisible by n so scatters and all-to-alls split evenly
    local = elems // n if collective == "all_gather" else elems
    fn = {"all_reduce": lambda x: C.all_reduce(x, axis), "all_gather": lambda x: C.all_gather(x, axis),
          "reduce_scatter": lambda x: C.reduce_scatter(x, axis), "all_to_all": lambda x: C.all_to_all(x, axis),
          "permute": lambda x: C.permute(x, axis)}[collective]
    spec = P(tuple(mesh.axis_names))
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    x = jax.device_put(np.ones(mesh.devices.size * local, np.float32), NamedSharding(mesh, spec))
    return f, x, elems * 4


def _median_seconds(f, x, iters: int, warmup: int, rounds: int = 5) -> float:
    """Median over `rounds` of (time of `iters` back-to-back calls) / iters, like nccl-tests' average
    over iterations: host dispatch overlaps the previous call instead of adding to every sample."""
    for _ in range(warmup):
        f(x).block_until_ready()
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            y = f(x)
        y.block_until_ready()
        per_call.append((time.perf_counter() - t0) / iters)
    return statistics.median(per_call)


def sweep(mesh, sizes: Sequence[int], collectives: Sequence[str] = COLLECTIVES, iters: int = 20,
          warmup: int = 3) -> list[dict]:
    """Time every collective on every mesh axis of size > 1 at every size; predicted_us left None."""
    unknown = [c for c in collectives if c not in COLLECTIVES]
    if unknown:
        raise MeshConfigError(f"--collectives={unknown[0]}: unknown; use some of {', '.join(COLLECTIVES)}")
    records = []
    for axis, n in axis_sizes(mesh).items():
        if n == 1:
            continue
        for collective in collectives:
            for nbytes in sizes:
                f, x, s = _program(mesh, collective, axis, nbytes)
                t = _median_seconds(f, x, iters, warmup)
                algbw = s / t / 1e9
                records.append({"collective": collective, "axis": axis, "group_size": int(n), "bytes": s,
                                "time_us": t * 1e6, "algbw_gbps": algbw,
                                "busbw_gbps": algbw * cost.bus_factor(collective, n), "predicted_us": None})
    return records


def predict(records: list[dict], sizes: Mapping[str, int], topo: topology.Topology) -> None:
    """Fill predicted_us from the cost model of `topo` for the mesh `sizes`."""
    for r in records:
        r["predicted_us"] = cost.predict_us(r["collective"], r["bytes"], [r["axis"]], sizes, topo)


def _fit_one(rows) -> tuple[float, float, float]:
    """(overhead us, alpha us/step, beta us/byte) minimising the squared relative error of
    t = overhead + alpha * steps + beta * bus_bytes, all three >= 0 (best over the 7 non-empty active sets)."""
    a = np.array([[1.0, cost.steps(r["collective"], r["group_size"]),
                   cost.bus_factor(r["collective"], r["group_size"]) * r["bytes"]] for r in rows], float)
    t = np.array([r["time_us"] for r in rows])
    w = a / t[:, None]  # relative error: divide each row by its measured time
    best, best_loss = np.zeros(3), float(len(t))
    for k in range(1, 4):
        for cols in itertools.combinations(range(3), k):
            sol = np.zeros(3)
            sol[list(cols)] = np.linalg.lstsq(w[:, cols], np.ones(len(t)), rcond=None)[0]
            loss = float(np.sum((w @ sol - 1) ** 2))
            if (sol >= 0).all() and loss < best_loss:
                best, best_loss = sol, loss
    return float(best[0]), float(best[1]), float(best[2])


def fit(records: list[dict], num_devices: int) -> tuple[topology.Topology, float]:
    """Per-axis overhead, alpha (us per step) and bandwidth (GB/s) into a one-host `local` topology;
    returns it with the median relative error |predicted - measured| / measured of the per-axis fits."""
    def level(name, rows):
        overhead, alpha, beta = _fit_one(rows)
        bw = 1.0 / (beta * 1e3) if beta > 0 else 1e6  # beta in us per byte
        return topology.Level(name, "switch", bandwidth_gbps=bw, latency_us=alpha, overhead_us=overhead)
    axes = sorted({r["axis"] for r in records})
    per_axis = {a: level(a, [r for r in records if r["axis"] == a]) for a in axes}
    pooled = level("local", records)
    shared = jax.devices()[0].platform == "cpu"  # virtual devices of this machine share its cores
    topo = topology.Topology("local", 1, num_devices, pooled, pooled, axes=per_axis, shared_host=shared)
    errors = []
    for r in records:
        lv = per_axis[r["axis"]]
        link = cost.Link(lv.latency_us, lv.bandwidth_gbps, overhead_us=lv.overhead_us)
        pred = cost.time_us(r["collective"], r["bytes"], r["group_size"], link)
        errors.append(abs(pred - r["time_us"]) / r["time_us"])
    return topo, statistics.median(errors)


def table(records: list[dict]) -> str:
    head = (f"#{'size':>11} {'count':>10} {'type':>6} {'collective':>15} {'axis':>8} {'n':>3} "
            f"{'time':>10} {'algbw':>8} {'busbw':>8} {'predicted':>10}\n"
            f"#{'(B)':>11} {'(elements)':>10} {'':>6} {'':>15} {'':>8} {'':>3} "
            f"{'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'(us)':>10}")
    lines = [head]
    for r in records:
        pred = "-" if r["predicted_us"] is None else f"{r['predicted_us']:.2f}"
        lines.append(f"{r['bytes']:>12} {r['bytes'] // 4:>10} {'float':>6} {r['collective']:>15} {r['axis']:>8} "
                     f"{r['group_size']:>3} {r['time_us']:>10.2f} {r['algbw_gbps']:>8.3f} {r['busbw_gbps']:>8.3f} "
                     f"{pred:>10}")
    avg = statistics.mean(r["busbw_gbps"] for r in records) if records else math.nan
    lines.append(f"# Avg bus bandwidth    : {avg:.3f} GB/s")
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    keys = sorted({(r["collective"], r["axis"]) for r in records})
    for c, a in keys:
        rows = [r for r in records if (r["collective"], r["axis"]) == (c, a)]
        line, = ax.plot([r["bytes"] for r in rows], [r["busbw_gbps"] for r in rows], marker="o", ms=3,
                        label=f"{c} / {a}")
        if all(r["predicted_us"] for r in rows):
            pred = [r["bytes"] * cost.bus_factor(c, r["group_size"]) / r["predicted_us"] / 1e3 for r in rows]
            ax.plot([r["bytes"] for r in rows], pred, ls="--", lw=1, color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("size S (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s); dashed: cost model")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fail(message: str) -> None:
    """mesh cannot use train.cli.run (it imports nothing above it): its own one line, exit 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        _fail(re.sub(r"^flag ", "", " ".join(str(e).split())))


def _check_flags(argv: list[str], F) -> None:
    """Every flag a sweep reads, checked before the sweep (its outputs included: a sweep takes minutes)."""
    if len(argv) > 1:
        raise UserError(f"unexpected arguments: {' '.join(argv[1:])}")
    for name, low in (("iters", 1), ("warmup", 0), ("hosts", 0), ("num_cpu_devices", 0)):
        if F[name].value < low:
            raise UserError(f"--{name}={F[name].value}: must be >= {low}")
    byte_sizes(F.min_bytes, F.max_bytes)
    unknown = [c for c in F.collectives if c not in COLLECTIVES]
    if unknown:
        raise MeshConfigError(f"--collectives={unknown[0]}: unknown; use some of {', '.join(COLLECTIVES)}")
    if F.plot and importlib.util.find_spec("matplotlib") is None:
        raise UserError(f"--plot={F.plot} needs matplotlib, which is not installed: pip install 'spmdtrain[plots]'")
    for flag, path, parents in (("--json", F.json, False), ("--plot", F.plot, False),
                                ("--topology_out", F.topology_out if F.fit else None, True)):
        if path:
            check_writable(flag, path, parents=parents)


def main(argv):
    F = flags.FLAGS
    try:
        _check_flags(argv, F)
        if F.num_cpu_devices:
            use_cpu_devices(F.num_cpu_devices)  # before anything touches a JAX backend
        sizes = parse_mesh(F.mesh)
        mesh = make_mesh(sizes)
        if not any(s > 1 for s in sizes.values()):
            raise MeshConfigError(f"--mesh={F.mesh}: no axis larger than 1, nothing to sweep")
        topo = topology.get_topology(F.topology, F.hosts or None) if not (F.fit and F.topology == "local") else None
    except UserError as e:
        _fail(str(e))
    full = axis_sizes(mesh)
    print(f"# devices: {mesh.devices.size} x {jax.devices()[0].platform}, mesh {F.mesh}, iters {F.iters}")
    records = sweep(mesh, byte_sizes(F.min_bytes, F.max_bytes), F.collectives, F.iters, F.warmup)
    if F.fit:
        fitted, err = fit(records, mesh.devices.size)
        topology.save_topology(fitted, F.topology_out, {
            "command": "python -m mesh.bench " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                       f"{mesh.devices.size} x {jax.devices()[0].platform}",
            "median_relative_error": round(err, 4), "rows": len(records)})
        for a, lv in fitted.axes.items():
            print(f"# fit {a:>8}: overhead {lv.overhead_us:8.2f} us  alpha {lv.latency_us:8.2f} us/step  "
                  f"bandwidth {lv.bandwidth_gbps:8.3f} GB/s")
        print(f"# fit median relative error: {err:.1%} over {len(records)} rows -> {F.topology_out}")
    topo = topo or topology.get_topology(F.topology_out, F.hosts or None)
    predict(records, full, topo)
    print(f"# predicted on topology {topo.name} ({topo.hosts} x {topo.devices_per_host})")
    print(table(records))
    if F.json:
        with open(F.json, "w") as fh:
            for r in records:
                fh.write(json.dumps({k: r[k] for k in RECORD_KEYS}) + "\n")
    if F.plot:
        plot(records, F.plot)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
