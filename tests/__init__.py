"""The test suite, one folder per area; helpers.py, forked.py, slurm_cluster.py and fixtures/ are shared."""
