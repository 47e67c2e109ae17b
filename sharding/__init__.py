"""How a model is laid out on a mesh: logical-axis rules and specs, context and expert parallelism, pipeline
schedules and their executor, and the traffic a layout must communicate by construction."""
