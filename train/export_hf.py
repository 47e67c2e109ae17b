"""`python -m train.export_hf`: export a run's checkpoint as a Hugging Face directory (the command lives in
train/hf/export.py, which defines its flags only when run, so tests can import it beside other tools)."""
from train import cli
from train.hf import export as command

main = command.main

if __name__ == "__main__":
    command.define_flags()
    cli.run(main)
