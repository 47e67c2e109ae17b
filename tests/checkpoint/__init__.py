"""Checkpoints: the format, the local tier, storage failures, and fault tolerance end to end."""
