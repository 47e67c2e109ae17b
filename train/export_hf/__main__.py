"""`python -m train.export_hf`: the command is train/export_hf/command.py, whose flags are defined only here."""
from train import cli
from train.export_hf import command

if __name__ == "__main__":
    command.define_flags()
    cli.run(command.main)
