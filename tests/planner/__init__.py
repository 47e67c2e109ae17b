"""The planner: search, memory and time models, the roofline, plan.auto, the audit against compiled programs."""
