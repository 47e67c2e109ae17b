"""Goodput under a failure process: training under `train.launch --max_restarts` while a killer SIGKILLs the
training process at exponentially distributed times (mean --mtbf_s); the launcher restarts it and it resumes
from its last checkpoint. Prints the measured goodput (productive step time over wall time), the steps lost
(recomputed) per failure and the restart time, beside checkpoint/cadence.py's prediction for the measured save
cost, step time, restart time and MTBF.

    python -m experiments.chaos_goodput [--mtbf_s=30 --minutes=5 --every_steps=40 --local_every_steps=0 --seed=0]
    python -m experiments.chaos_goodput --smoke        # 40 s, a couple of failures: proves the script runs

The run is the tiny model on 8 virtual devices (experiments/tiny.py, data=8), restarted by the launcher with no
back-off, logging (and so recording goodput.json) every step, so a killed attempt's lost steps are counted.
`--step_delay_s` pads every step (fault_injection.step_delay_s) to stand for a bigger model; the pad
counts as productive step time, as a real step's compute would. An attempt killed before its first step records
nothing, so the restart time is the mean over the attempts that trained.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

from checkpoint import cadence
from train import cli

STEPS = 10 ** 7  # never reached: the run ends when the time is up


def _launch(workdir: pathlib.Path, args) -> subprocess.Popen:
    train = ["--config=experiments/tiny.py", f"--workdir={workdir}", "--config.mesh.data=8",
             "--config.data.source=synthetic", f"--config.train.steps={STEPS}", "--config.optimizer.decay_steps=1000",
             "--config.train.eval_every=0", "--config.train.log_every=1", "--config.checkpoint.every_minutes=0",
             f"--config.checkpoint.every_steps={args.every_steps}", "--config.checkpoint.keep=2",
             f"--config.fault_injection.step_delay_s={args.step_delay_s}"]
    if args.local_every_steps:  # the local tier beside the persistent one, in node-local memory
        train += [f"--config.checkpoint.local_dir={workdir.parent / 'local'}",
                  f"--config.checkpoint.local_every_steps={args.local_every_steps}"]
    launcher = [sys.executable, "-m", "train.launch", "--num_processes=1", "--num_cpu_devices=8",
                "--max_restarts=100000", "--restart_backoff_s=0", "--grace_s=10", "--", *train]
    return subprocess.Popen(launcher, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _trainer_pids(workdir: pathlib.Path) -> list[int]:
    found = subprocess.run(["pgrep", "-f", f"python.* -m train .*--workdir={workdir} "], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def _kill_loop(workdir: pathlib.Path, launcher: subprocess.Popen, args) -> list[float]:
    """SIGKILL the training process at Poisson times until the time is up; returns the kill times."""
    rng, end, kills = random.Random(args.seed), time.monotonic() + 60 * args.minutes, []
    next_kill = time.monotonic() + rng.expovariate(1.0 / args.mtbf_s)
    while time.monotonic() < end and launcher.poll() is None:
        if time.monotonic() >= next_kill:
            pids = _trainer_pids(workdir)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            if pids:
                kills.append(time.time())  # wall clock, as goodput.json's attempt start times
            next_kill = time.monotonic() + rng.expovariate(1.0 / args.mtbf_s)
        time.sleep(0.05)
    return kills


def _restart_s(attempts: list[dict], kills: list[float]) -> float:
    """Mean seconds from a kill to the next attempt's first step (launcher, process start, imports, compile
    from the cache, restore), over the restarts that no second kill interrupted."""
    waits = []
    for a in attempts:
        began = datetime.datetime.fromisoformat(a["started"]).timestamp()
        ready = began + a["startup_s"] + a["compile_s"] + a["memory_check_s"] + a["restore_s"] + a["init_s"]
        before = [k for k in kills if k <= began]
        if before and not any(before[-1] < k < ready for k in kills):
            waits.append(ready - before[-1])
    return sum(waits) / len(waits) if waits else 0.0


def _measure(record: dict, kills: list[float], wall_s: float, args) -> dict:
    attempts = [a for a in record["attempts"] if a.get("last_step")]  # an attempt killed before a step: restart
    k = args.local_every_steps or args.every_steps  # saves of either tier: local ones at the local cadence
    saves = max(1, sum(a["last_step"] // k - (a["first_step"] - 1) // k for a in attempts))
    step_s = (sum(a["productive_s"] + a["recomputed_s"] for a in attempts)
              / max(1, sum(a["last_step"] - a["first_step"] + 1 for a in attempts)))
    restart_s = _restart_s(attempts, kills)
    save_s = sum(a["checkpoint_blocked_s"] for a in attempts) / saves
    productive = sum(a["productive_s"] for a in attempts)
    lost = sum(a["recomputed_steps"] for a in attempts)
    tau = (args.local_every_steps or args.every_steps) * step_s  # work between saves of either tier
    parts = {p: sum(a[p] for a in record["attempts"]) for p in ("productive_s", "recomputed_s", "startup_s",
                                                                 "compile_s", "restore_s", "checkpoint_blocked_s")}
    parts["unrecorded_s"] = wall_s - sum(a["wall_s"] for a in record["attempts"])  # gaps, attempts killed early
    return {"wall_s": wall_s, "failures": len(kills), "attempts": len(attempts), "step_s": step_s, "parts": parts,
            "save_blocked_s": save_s, "restart_s": restart_s, "interval_s": tau,
            "steps_lost_per_failure": lost / max(len(kills), 1), "measured_goodput": productive / wall_s,
            "predicted_goodput": cadence.expected_goodput(tau, save_s, args.mtbf_s, restart_s)}


def run(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="chaos_goodput_") as tmp:
        workdir = pathlib.Path(tmp) / "run"
        started = time.monotonic()
        launcher = _launch(workdir, args)
        kills = _kill_loop(workdir, launcher, args)
        launcher.send_signal(signal.SIGTERM)  # the user stops it: it saves and is not restarted
        launcher.wait(timeout=120)
        wall_s = time.monotonic() - started
        record = json.loads((workdir / "goodput.json").read_text())
        return _measure(record, kills, wall_s, args)


def table(rows: list[dict], args) -> str:
    lines = ["| MTBF s | minutes | every steps (local) | failures | step s | save blocked s | restart s "
             "| steps lost / failure | measured goodput | predicted (Daly) | difference |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {args.mtbf_s:g} | {args.minutes:g} | {args.every_steps} ({args.local_every_steps or '-'}) | "
                     f"{r['failures']} | "
                     f"{r['step_s']:.3f} | {r['save_blocked_s']:.3f} | {r['restart_s']:.1f} | "
                     f"{r['steps_lost_per_failure']:.1f} | {100 * r['measured_goodput']:.1f}% | "
                     f"{100 * r['predicted_goodput']:.1f}% | "
                     f"{100 * (r['measured_goodput'] - r['predicted_goodput']):+.1f} points |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mtbf_s", type=float, default=30.0, help="mean seconds between failures")
    p.add_argument("--minutes", type=float, default=5.0, help="wall time of the experiment")
    p.add_argument("--every_steps", type=int, default=40, help="steps between persistent checkpoints")
    p.add_argument("--step_delay_s", type=float, default=0.0, help="added to every step (a bigger model's cost)")
    p.add_argument("--local_every_steps", type=int, default=0, help="also save the local tier this often (0: off)")
    p.add_argument("--seed", type=int, default=0, help="seed of the failure times")
    p.add_argument("--json", default="", help="also write the figures to this file")
    p.add_argument("--smoke", action="store_true", help="40 s with failures every 12 s on average")
    args = p.parse_args(argv)
    if args.smoke:
        args.mtbf_s, args.minutes = 12.0, 40 / 60
    for name in ("mtbf_s", "minutes", "every_steps"):
        if getattr(args, name) <= 0:
            p.error(f"--{name}={getattr(args, name)}: must be > 0")
    row = run(args)
    print(table([row], args))
    print("wall time: " + ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in row["parts"].items())
          + f" of {row['wall_s']:.1f}s")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"args": vars(args), "rows": [row]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
