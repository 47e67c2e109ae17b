"""Experiment configs (ml_collections files) and scripts: benchmarks, plots, schedule figures, cluster launch."""
