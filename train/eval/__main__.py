"""`python -m train.eval`: the command lives in train/eval/command.py, whose flags are defined only here."""
from train import cli
from train.eval import command

if __name__ == "__main__":
    command.define_flags()
    cli.run(command.main)
