"""`python -m train.launch`: start and watch training processes (the command is train/launch/command.py)."""
from train import cli
from train.launch import command

if __name__ == "__main__":
    cli.run(command.main)
