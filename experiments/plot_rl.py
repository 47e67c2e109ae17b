"""Draw RL runs' reward curves from their metrics.jsonl: the mean reward of each step's completions, with a band
of one standard deviation, one line per run; prints each run's mean reward over its first and last 5 steps.

  python -m experiments.plot_rl --workdir=runs/rl_tiny --workdir=runs/rl_tiny_split --label=colocated \
      --label=split --note="python -m train.rl --config=experiments/rl_tiny.py, 2-core VM, 2026-12-05" \
      --out=experiments/rl_tiny_reward.png
"""
from __future__ import annotations

import json
import pathlib
import sys
from typing import Sequence

import numpy as np

from mesh.errors import UserError, check_writable
from train import cli
from train.runtime import extras

try:  # the `plots` extra: without it main() says which pip install to run
    from matplotlib.figure import Figure  # no pyplot: no global backend state, renders with Agg
except ImportError:
    Figure = None


def rewards(workdir: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, reward_mean, reward_std) of a run's metrics.jsonl, or a one-line error naming the run."""
    path = pathlib.Path(workdir).expanduser() / "metrics.jsonl"
    if not path.is_file():
        cli.fail(f"--workdir={workdir}: no metrics.jsonl there; give an RL run's directory")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = sorted((r for r in rows if "reward_mean" in r), key=lambda r: r["step"])
    if not rows:
        cli.fail(f"--workdir={workdir}: its metrics.jsonl logs no reward_mean; give a python -m train.rl run")
    return tuple(np.array([r[k] for r in rows], float) for k in ("step", "reward_mean", "reward_std"))


def render(runs: list[tuple[str, tuple]], note: str, out: str) -> None:
    fig = Figure(figsize=(7, 3.6), dpi=120)
    ax = fig.add_subplot()
    for i, (label, (steps, mean, std)) in enumerate(runs):  # dashes keep runs that coincide visible
        ax.plot(steps, mean, label=label, linewidth=1.6, linestyle=("-", "--", ":", "-.")[i % 4])
        ax.fill_between(steps, mean - std, mean + std, alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("reward (mean of the step's completions)")
    ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    if note:
        ax.set_title(note, fontsize=8)
    fig.tight_layout()
    fig.savefig(out)


def main(argv: Sequence[str] | None = None) -> str:
    if Figure is None:
        print(f"error: {extras.message('matplotlib', 'python -m experiments.plot_rl')}", file=sys.stderr)
        sys.exit(2)
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", action="append", required=True, help="an RL run's directory (repeatable)")
    parser.add_argument("--label", action="append", default=[], help="each run's legend entry, in order")
    parser.add_argument("--note", default="", help="the title: the command, machine and date")
    parser.add_argument("--out", default="rl_reward.png", help="PNG file to write")
    args = parser.parse_args(argv)
    labels = args.label or args.workdir
    if len(labels) != len(args.workdir):
        cli.fail(f"--label given {len(labels)} times for {len(args.workdir)} --workdir; give one per run or none")
    try:
        check_writable("--out", args.out)
    except UserError as error:
        cli.fail(str(error))
    runs = [(label, rewards(w)) for label, w in zip(labels, args.workdir)]
    render(runs, args.note, args.out)
    for label, (steps, mean, _) in runs:
        print(f"{label}: {len(steps)} steps, mean reward of the first 5 {mean[:5].mean():.3f}, of the last 5 "
              f"{mean[-5:].mean():.3f}")
    print(f"wrote {args.out}")
    return args.out


if __name__ == "__main__":
    main()
