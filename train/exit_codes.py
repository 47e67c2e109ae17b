"""Exit statuses of every `python -m train.*` command, which launchers and schedulers act on, in one place:
requeue on REQUEUE; every other non-zero status is a failure whose cause is the last line of stderr. The
lowest module of train/: every entry point, the loop and the runtime read it."""
from __future__ import annotations

from mesh.errors import UserError

OK = 0             # trained to train.steps (or the run had already reached it)
CRASH = 1          # an unexpected exception: see the traceback
USER_ERROR = 2     # a bad config, flag, file or directory (one line names it): fix it, do not retry; no
                   # checkpoint was moved or written
NON_FINITE = 65    # loss or gradients not finite at the named step (train.on_nonfinite=stop); not saved
NO_CHECKPOINT = 66  # checkpoints exist or were set aside, but none restores; nothing restarts from step 0
SAVE_FAILED = 74   # checkpoint.max_failed_saves saves failed in a row (disk full, directory unwritable), or the
                   # final or preemption save failed; the older checkpoints are intact
REQUEUE = 75       # EX_TEMPFAIL: preempted (SIGTERM or a first Ctrl-C) after saving the step reached; requeue
WATCHDOG = 124     # no step completed within train.step_timeout_s: every thread's stack is on stderr
# A second Ctrl-C kills the process with the default action (a shell reports status 130).


class ConfigError(UserError):
    """A training setting the user can fix; the message is one line naming the setting."""


class Stop(Exception):
    """Ends the run with `status`; the message is the last line printed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def status_of(error: BaseException) -> int | None:
    """The documented status of an expected failure; None for a crash."""
    # Imported only once a run has failed: train.cli imports this module, and a flag error need not load Orbax.
    from checkpoint import NoRestorableCheckpoint, SaveFailed
    if isinstance(error, Stop):
        return error.status
    if isinstance(error, UserError):
        return USER_ERROR
    if isinstance(error, NoRestorableCheckpoint):
        return NO_CHECKPOINT
    if isinstance(error, SaveFailed):
        return SAVE_FAILED
    return None
