"""The command lines: every bad input one line and exit status 2, the config's errors, the errors' classes."""
