"""What starts and defines a run. Each command (`python -m train.X`) is a package with a `__main__.py`: launch,
prepare, sample, export_hf, eval, serve, plan (the planner too) and config (the reference); the run's core is the
trainer, step, placed and state modules; configuration, data, Hugging Face (hf), LoRA, the loop and the process
runtime are subpackages."""
