"""Layouts against one device: rules to specs, memory, equivalence, compositions, context, pipelines, step text."""
