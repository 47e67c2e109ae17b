"""`python -m train.prepare`: tokenize a corpus into a DATADIR (the command lives in train/data/prepare.py)."""
from train import cli
from train.data import prepare as command

main = command.main

if __name__ == "__main__":
    cli.run(main)
