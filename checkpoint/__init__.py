"""Fault-tolerant checkpoints with Orbax: async saves with integrity checksums, restore into any mesh's
shardings with fallback past damaged checkpoints, and the compatibility check against a config.
Imports nothing of ours: the caller hands it trees of arrays and of target ShapeDtypeStructs."""
from checkpoint.errors import (
                               CheckpointError,
                               IncompatibleCheckpoint,
                               NoRestorableCheckpoint,
                               RestoreFromError,
                               SaveFailed,
)
from checkpoint.manager import Checkpoints, SavePolicy, SaveRecord
from checkpoint.restore import Restored, open_source, restore_newest, restore_source

__all__ = ["CheckpointError", "Checkpoints", "IncompatibleCheckpoint", "NoRestorableCheckpoint", "RestoreFromError",
           "Restored", "SaveFailed", "SavePolicy", "SaveRecord", "open_source", "restore_newest", "restore_source"]
