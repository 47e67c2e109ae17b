"""The restart policy of `train.launch --max_restarts=N [--min_processes=M]`: which failed launches start again, after
how long, and on how many processes. After a lost process (one killed by a signal, as when its node goes) the launch
restarts on one process fewer, down to M, with `--config.plan.auto=True` so the planner lays the run out on the
devices left (the layout flags given for the devices that are gone are dropped; plan.fixed stays). The global batch
is a setting, kept as it is, and the batch of step s is a function of (seed, s) alone, so the restarted run neither
skips nor repeats an example."""
from __future__ import annotations

import dataclasses

from train import exit_codes
from train.plan.report import LAYOUT_KEYS

# Statuses a restart cannot help: done; a user error (fix it first); numbers that are not finite (a replay
# repeats them); no restorable checkpoint (a restart would begin again at step 0).
FINAL = (exit_codes.OK, exit_codes.USER_ERROR, exit_codes.NON_FINITE, exit_codes.NO_CHECKPOINT)
REPLAN = "--config.plan.auto=True"


def replanned(args: tuple[str, ...]) -> tuple[str, ...]:
    """`args` without the flags that set the layout (what plan.auto chooses), which described the devices lost."""
    keys = tuple(f"--config.{k}" for k in LAYOUT_KEYS if k != "plan.") + ("--config.plan.auto=",)
    return tuple(a for a in args if not a.startswith(keys))


@dataclasses.dataclass(frozen=True)
class Launch:
    """One start of the processes: how many, their training arguments, and how many restarts came before."""
    processes: int
    args: tuple[str, ...]
    restarts: int = 0


@dataclasses.dataclass(frozen=True)
class Policy:
    max_restarts: int
    min_processes: int
    backoff_s: float

    def next(self, launch: Launch, status: int, lost: bool, stopping: bool) -> Launch | None:
        """The launch to start after `launch` ended with `status`, or None to end with it. A launch the user
        stopped (SIGTERM or Ctrl-C to the launcher) is not restarted."""
        if stopping or status in FINAL or launch.restarts >= self.max_restarts:
            return None
        fewer = lost and launch.processes > self.min_processes
        args = (*replanned(launch.args), REPLAN) if fewer else launch.args
        return Launch(launch.processes - fewer, args, launch.restarts + 1)

    def delay_s(self, launch: Launch) -> float:
        """Exponential back-off: backoff_s before the first restart, doubled for each one after."""
        return self.backoff_s * 2 ** (launch.restarts - 1)

    @staticmethod
    def reason(status: int, lost: bool) -> str:
        return f"a process was lost (status {status})" if lost else f"the launch failed (status {status})"
