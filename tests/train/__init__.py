"""Runs: the loop and its actions, data and train.prepare, placed models, LoRA, eval, phases, processes, launchers."""
