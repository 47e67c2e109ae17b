"""`python -m train.plan`: rank the layouts of a model on a cluster (the command lives in train/planner/command.py)."""
from train import cli
from train.planner import command as command

main = command.main

if __name__ == "__main__":
    cli.run(main)
