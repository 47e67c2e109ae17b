"""Draw pipeline schedule tables as the classic diagram: time across, stages down, cells by microbatch.

  python -m experiments.plot_schedule --schedule=1f1b --stages=4 --microbatches=8 --out=1f1b.png
  python -m experiments.plot_schedule --all --stages=4 --microbatches=8 --virtual_stages=2 --out=all.png
  python -m experiments.plot_schedule --schedule=zb_v --stages=4 --microbatches=8 --text
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

import numpy as np

from mesh.errors import UserError, check_writable
from sharding import schedules as S
from train import cli
from train.runtime import extras

try:  # the `plots` extra: without it main() says which pip install to run
    from matplotlib import colormaps
    from matplotlib.figure import Figure  # no pyplot: no global backend state, renders with Agg
    from matplotlib.patches import Patch, Rectangle
except ImportError:
    colormaps = Figure = Patch = Rectangle = None


def microbatch_colors(m: int) -> np.ndarray:
    """[m, 3] RGB, distinct neighbours: qualitative maps while they last, then a sampled spectrum."""
    if m <= 10:
        return np.array(colormaps["tab10"].colors)[:m]
    if m <= 20:  # tab20 alternates dark/light pairs; take the dark ones first so neighbours differ
        colors = np.array(colormaps["tab20"].colors)
        return np.concatenate([colors[0::2], colors[1::2]])[:m]
    return colormaps["turbo"](np.linspace(0.05, 0.95, m))[:, :3]


# Per action kind: hatch and label prefix (forward cells are light, every backward kind dark).
STYLE = {S.FORWARD: (None, ""), S.BACKWARD: ("///", ""), S.INPUT_GRAD: ("\\\\", "B"), S.WEIGHT_GRAD: ("..", "W")}
FORMS = {"gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)", "interleaved": "(p-1)/(vm+p-1)",
         "zb_h1": "(p-1)/(3m+p-1)", "zb_v": "bound (p-1)/(6m+p-1)"}


def draw(ax, schedule: S.Schedule, duration: float | None = None) -> None:
    """One schedule on one Axes: forward cells light, backward cells dark and hatched (a split backward's B
    and W labelled), idle white.

    Time is in units of one stage's whole forward of a microbatch, so an interleaved cell (one chunk,
    1/v of a stage's layers) is 1/v wide, as in Megatron-LM's figure, and schedules compare by length.
    """
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    colors, width = microbatch_colors(m), 1 / v
    for t, d in zip(*np.nonzero(schedule.table[:, :, S.KIND] != S.IDLE)):
        kind, i, c = schedule.table[t, d]
        forward = kind == S.FORWARD
        hatch, prefix = STYLE[int(kind)]
        face = 1 - 0.5 * (1 - colors[i]) if forward else 0.8 * colors[i]  # forward: halfway to white
        ax.add_patch(Rectangle((t * width, d), width, 1, facecolor=face, edgecolor="0.35", linewidth=0.4,
                               hatch=hatch))
        text_color = "black" if forward else "white"
        label = f"{prefix}{i}" if v == 1 else f"{prefix}{i}\n" + r"$_{c" + str(c) + "}$"
        ax.text((t + 0.5) * width, d + 0.5, label, ha="center", va="center", fontsize=7, color=text_color,
                linespacing=0.8, fontweight="bold" if not forward else "normal")
    ax.set_xlim(0, duration or schedule.num_slots * width)
    ax.set_ylim(p, 0)  # stage 0 on top
    ax.set_yticks(np.arange(p) + 0.5, [f"stage {d}" for d in range(p)], fontsize=8)
    ax.set_xticks(np.arange(0, ax.get_xlim()[1] + 1, 5 if ax.get_xlim()[1] > 30 else 2))
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlabel("time (1 = one stage's forward of a microbatch" + (f"; a cell is 1/{v})" if v > 1 else ")"),
                  fontsize=8)
    for d in range(p + 1):  # row lines also frame the idle cells
        ax.axhline(d, color="0.8", linewidth=0.4, zorder=0)
    bubble = S.bubble_fraction(schedule)
    closed = S.closed_form_bubble(schedule.name, p, m, v)
    form = FORMS[schedule.name]
    ax.set_title(f"{schedule.name}   p={p}  m={m}" + (f"  v={v}" if v > 1 else "")
                 + f"   bubble {bubble:.1%}  (closed form {form} = {closed:.1%})", fontsize=9, loc="left")


def render(schedules: Sequence[S.Schedule], out: str) -> None:
    """Stack the schedules on one shared time axis, so their lengths compare at a glance."""
    duration = max(s.num_slots / s.virtual_stages for s in schedules)
    inch_per_unit = 0.18 * max(2, max(s.virtual_stages for s in schedules))  # room for a label in a 1/v cell
    heights = [s.stages * 0.38 + 0.9 for s in schedules]
    fig = Figure(figsize=(max(6.0, inch_per_unit * duration + 1.6), sum(heights) + 0.5), layout="constrained")
    axes = fig.subplots(len(schedules), 1, squeeze=False, height_ratios=heights)[:, 0]
    for ax, schedule in zip(axes, schedules):
        draw(ax, schedule, duration)
    legend = [Patch(facecolor="0.85", edgecolor="0.35", label="forward (light)"),
              Patch(facecolor="0.4", edgecolor="0.35", hatch="///", label="backward (dark, hatched)"),
              Patch(facecolor="0.4", edgecolor="0.35", hatch="\\\\", label="B: input gradient"),
              Patch(facecolor="0.4", edgecolor="0.35", hatch="..", label="W: weight gradient"),
              Patch(facecolor="white", edgecolor="0.35", label="idle")]
    chunked = any(s.virtual_stages > 1 for s in schedules)
    note = "cells: microbatch" + (", chunk c (interleaved: model chunk c*p + stage; zb_v: stage, then back up)"
                                  if chunked else "")
    fig.legend(handles=legend, loc="outside lower center", ncols=5, fontsize=8, frameon=False, title=note,
               title_fontsize=8)
    fig.savefig(out, dpi=130)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", help=" | ".join(S.NAMES))
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages p (mesh.pipeline)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches m (pipeline.microbatches)")
    parser.add_argument("--virtual_stages", type=int, default=None,
                        help="chunks per stage v for interleaved (default 2); zb_v has 2, the others 1")
    parser.add_argument("--all", action="store_true", help="draw every schedule stacked")
    parser.add_argument("--out", default="schedule.png", help="PNG file to write")
    parser.add_argument("--text", action="store_true", help="also print each table, one row per stage")
    args = parser.parse_args(argv)
    def virtual_stages(name: str) -> int:  # --all applies --virtual_stages to the interleaved panel only
        if name == "interleaved":
            return args.virtual_stages or 2
        if name == "zb_v":
            return 2
        return 1 if args.all else args.virtual_stages or 1

    try:
        names = S.NAMES if args.all else (args.schedule,)
        args.schedules = [S.build(n, args.stages, args.microbatches, virtual_stages(n)) for n in names]
    except S.ScheduleConfigError as error:
        cli.fail(str(error))
    return args


def main(argv: Sequence[str] | None = None) -> str:
    if Figure is None:
        print(f"error: {extras.message('matplotlib', 'python -m experiments.plot_schedule')}", file=sys.stderr)
        sys.exit(2)
    args = parse_args(argv)
    try:
        check_writable("--out", args.out)  # before drawing, not after
    except UserError as error:
        cli.fail(str(error))
    render(args.schedules, args.out)
    for schedule in args.schedules:
        p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
        print(f"{schedule.name:12s} p={p} m={m} v={v} slots={schedule.num_slots} "
              f"bubble={S.bubble_fraction(schedule):.4f} "
              f"closed_form={S.closed_form_bubble(schedule.name, p, m, v):.4f} "
              f"max_in_flight={S.max_in_flight(schedule).tolist()} "
              f"closed_form_in_flight={S.closed_form_in_flight(schedule.name, p, m, v)}")
        if args.text:
            print(S.format_table(schedule))
    print(f"wrote {args.out}")
    return args.out


if __name__ == "__main__":
    main()
