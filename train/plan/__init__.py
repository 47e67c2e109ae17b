"""What a layout costs. Before compiling: the analytic planner predicts memory and step time of every layout
of a model on a cluster and ranks them (`search`, `memory`, `timing`, `auto`, the `train.plan` command in
`command`). After compiling: `compile_report.json` (`compile_report`) and the audit of the step's collectives
against what the layout needs by construction (`audit`).

It lives under train/ because it needs the model's sizes (models), what each layout communicates
(sharding.expected) and the links' costs (mesh.cost).
"""
