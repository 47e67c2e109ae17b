"""`python -m train.serve`: the command lives in train/serve/command.py, whose flags are defined only here."""
from train import cli
from train.serve import command

if __name__ == "__main__":
    command.define_flags()
    cli.run(command.main)
