"""`python -m train.prepare`: tokenize a corpus into a DATADIR (the command is train/prepare/command.py)."""
from train import cli
from train.prepare import command

if __name__ == "__main__":
    cli.run(command.main)
