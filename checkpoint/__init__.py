"""Fault-tolerant checkpoints with Orbax, and a node-local tier beside them: async saves with integrity checksums,
restore into any mesh's shardings with fallback past damaged checkpoints, the compatibility check against a config.
Imports nothing of ours: the caller hands it trees of arrays and of target ShapeDtypeStructs."""
from checkpoint.errors import (
                               CheckpointError,
                               IncompatibleCheckpoint,
                               NoRestorableCheckpoint,
                               RestoreFromError,
                               SaveFailed,
)
from checkpoint.local import LocalCheckpoints
from checkpoint.manager import Checkpoints, SavePolicy, SaveRecord
from checkpoint.restore import Restored, open_source, restore_newest, restore_source, restore_tiers

__all__ = ["CheckpointError", "Checkpoints", "IncompatibleCheckpoint", "LocalCheckpoints", "NoRestorableCheckpoint",
           "RestoreFromError", "Restored", "SaveFailed", "SavePolicy", "SaveRecord", "open_source", "restore_newest",
           "restore_source", "restore_tiers"]
