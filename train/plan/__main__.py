"""`python -m train.plan`: rank the layouts of a model on a cluster (the command is train/plan/command.py)."""
from train import cli
from train.plan import command

if __name__ == "__main__":
    cli.run(command.main)
