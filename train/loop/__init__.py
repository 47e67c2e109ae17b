"""The training loop: the run from validation to exit (`runner`) and across phases (`phases`), the scheduler
and the actions it runs each step (`scheduler`, `builtin`, `actions` for users' own), metrics and loggers,
goodput, the watchdog, preemption, saving and resuming, and the exit statuses a run ends with (`exit_codes`)."""
