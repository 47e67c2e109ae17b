"""`python -m train.sample`: sample from a run's checkpoint (the command lives in train/generate/sample.py)."""
from train import cli
from train.generate import sample as command

main = command.main

if __name__ == "__main__":
    command.define_flags()
    cli.run(main)
