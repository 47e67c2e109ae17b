"""What starts and defines a run: entry points, cli, config and Plan sections, trainer, step, state; data,
Hugging Face (hf), generation, the planner, the loop and the process runtime in their subpackages."""
