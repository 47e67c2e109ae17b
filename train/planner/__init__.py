"""The analytic planner: predicts memory and step time of every layout of a model on a cluster, and ranks them.

It lives under train/ because it needs the model's sizes (models), what each layout communicates
(sharding.expected) and the links' costs (mesh.cost); it compiles nothing, so it runs in seconds anywhere.
"""
