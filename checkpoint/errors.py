"""What can go wrong with checkpoints, as exception types the training entry point maps to exit statuses."""
from __future__ import annotations

from mesh.errors import UserError


class CheckpointError(RuntimeError):
    """Base of every checkpoint failure; the message is one line a user can act on."""


class IncompatibleCheckpoint(CheckpointError, UserError):
    """The checkpoint holds a different model or optimizer shape than the config asks for (a user error)."""


class RestoreFromError(CheckpointError, UserError):
    """`checkpoint.restore_from` names nothing restorable (a user error)."""


class NoRestorableCheckpoint(CheckpointError):
    """Checkpoints exist (or were set aside) but none restores; starting from step 0 would lose them."""


class SaveFailed(CheckpointError):
    """A save failed, usually in the background; its partial files are gone and the newest complete
    checkpoint is still intact. `step` is the step whose save failed."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step
