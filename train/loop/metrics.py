"""Where a run's numbers go: `metrics.jsonl` (one JSON object per record, always: resume cuts it back),
the loggers of `train.loggers` (TensorBoard event files, Weights & Biases) and a live progress line.
Only process 0 writes; the others keep quiet."""
from __future__ import annotations

import json
import math
import netrc
import os
import pathlib
import sys
import uuid
from typing import Any

import jax

from train.exit_codes import ConfigError
from train.runtime import extras


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


LOGGERS = ("tensorboard", "wandb")


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported late. tensorboardX imports torch whenever torch is installed
    (1.2 s and about 300 MB at every start, measured here with the hf extra), only to accept torch tensors;
    scalars never need it, so torch is hidden during the import unless something already imported it
    (tensorboardX falls back to numpy on the ImportError)."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # makes `import torch` raise ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TensorBoard:
    def __init__(self, workdir: pathlib.Path, purge_step: int | None):
        self._tb = _summary_writer_class()(str(workdir / "tensorboard"), purge_step=purge_step)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._tb.close()


WANDB_MODES = ("online", "offline", "disabled", "dryrun", "run")


def check_wandb() -> None:
    """train.loggers=wandb can start: the package, a WANDB_MODE W&B knows, and (online) an API key in
    WANDB_API_KEY or ~/.netrc (what `wandb login` writes); else one line before any work."""
    extras.check("wandb", "train.loggers=wandb")
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode and mode not in WANDB_MODES:
        raise ConfigError(f"WANDB_MODE={os.environ['WANDB_MODE']}: use online, offline or disabled "
                          f"(train.loggers=wandb)")
    if mode not in ("", "online", "run") or os.environ.get("WANDB_API_KEY"):
        return
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        known = netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        known = False
    if not known:
        raise ConfigError(f"train.loggers=wandb: no W&B API key (WANDB_API_KEY, or ~/.netrc for {host}); run "
                          f"`wandb login`, or set WANDB_MODE=offline to keep the run on disk")


class WandB:
    """Weights & Biases: the same scalars, the resolved config, and the compile report as the summary.
    WANDB_MODE=offline keeps it on disk (under $WANDB_DIR, else the workdir). The run's id is kept in
    `DIR/wandb_run_id`, so every phase, resume and requeue of the run continues the same W&B run."""

    ID_FILE = "wandb_run_id"

    def __init__(self, workdir: pathlib.Path, config: dict[str, Any], summary: dict[str, Any]):
        wandb = extras.load("wandb", "train.loggers=wandb")  # late: only runs that ask for it pay for it
        run_id = self.run_id(workdir)
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "spmdtrain"), name=workdir.name,
                               dir=os.environ.get("WANDB_DIR", str(workdir)), config=config, id=run_id,
                               resume="allow")
        self._run.summary.update(json.loads(json.dumps(summary, default=str)))

    @classmethod
    def run_id(cls, workdir: pathlib.Path) -> str:
        """The id the run in `workdir` logs to; a new one (written down before the run starts) the first time."""
        path = workdir / cls.ID_FILE
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        run_id = uuid.uuid4().hex[:16]  # W&B ids: letters and digits
        path.write_text(run_id + "\n")
        return run_id

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class MetricsLog:
    def __init__(self, workdir: pathlib.Path, total_steps: int, purge_step: int | None = None,
                 loggers: tuple[str, ...] = ("tensorboard",), run_config: dict[str, Any] | None = None,
                 summary: dict[str, Any] | None = None):
        """`purge_step`: a resumed run's first step; TensorBoard drops events of that step and later
        that the interrupted run had written. `run_config` and `summary` go to W&B."""
        self.enabled = jax.process_index() == 0
        self.total_steps = total_steps
        self.live = sys.stdout.isatty()
        self._jsonl = None
        self._loggers: list[Any] = []
        if self.enabled:
            self._jsonl = open(workdir / "metrics.jsonl", "a", buffering=1)
            if "tensorboard" in loggers:
                self._loggers.append(TensorBoard(workdir, purge_step))
            if "wandb" in loggers:
                self._loggers.append(WandB(workdir, run_config or {}, summary or {}))

    def write(self, record: dict[str, Any]) -> None:
        """One record: `step` plus scalars. Written at once, so a crash loses nothing logged."""
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        for logger in self._loggers:
            logger.scalars(record["step"], scalars)

    def progress(self, step: int, loss: float, tokens_per_s: float, mfu: float, seconds_left: float) -> None:
        if not self.enabled:
            return
        line = (f"step {step}/{self.total_steps} | loss {loss:.4f} | {tokens_per_s / 1e3:,.1f}k tok/s | "
                f"MFU {100 * mfu:.1f}% | ETA {_fmt_duration(seconds_left)}")
        if self.live:
            print("\r" + line.ljust(100), end="" if step < self.total_steps else "\n", flush=True)
        else:
            print(line, flush=True)

    def evaluated(self, step: int, loss: float) -> None:
        """The eval loss of `step`, on the line below that step's training line."""
        if self.enabled:
            after_live_line = self.live and step < self.total_steps  # that line has no newline yet
            print(("\n" if after_live_line else "") + f"step {step}/{self.total_steps} | eval loss {loss:.4f}",
                  flush=True)

    def message(self, text: str) -> None:
        if self.enabled:
            print(("\n" if self.live else "") + text, flush=True)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        for logger in self._loggers:
            logger.close()
        self._loggers = []
