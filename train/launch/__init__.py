"""`python -m train.launch`: N training processes on this machine, restarted when they fail (`command`, under the
restart rules of `elastic`), or a cluster manifest for them (`jobset`)."""
