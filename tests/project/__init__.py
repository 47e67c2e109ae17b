"""The project's shape: imports flow downward, functions and modules stay small, dependencies are declared."""
