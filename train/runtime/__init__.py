"""The process and its devices: joining a multi-process run (`distributed`), XLA's GPU settings applied before
the backend starts (`xla_env`), what a device can do (`hardware`) and which library versions ran (`versions`)."""
