"""`python -m train.launch`: N training processes on this machine, restarted when they fail, or a cluster
manifest for them (`command`)."""
