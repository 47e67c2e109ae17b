"""`python -m train.sample`: the command is train/sample/command.py, whose flags are defined only here."""
from train import cli
from train.sample import command

if __name__ == "__main__":
    command.define_flags()
    cli.run(command.main)
