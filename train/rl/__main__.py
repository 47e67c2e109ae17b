"""`python -m train.rl --config=experiments/rl_tiny.py --workdir=DIR [--config.rl.*=...]`: GRPO on the prompts of
rl.prompts, with the training command's flags, start-up and loop (train/__main__.py): `--workdir=DIR` alone continues
the run there, SIGTERM saves and exits 75, and `python -m train.launch --module=train.rl` runs it on several
processes."""
from __future__ import annotations

from absl import flags

from train import __main__ as command
from train import cli
from train.exit_codes import ConfigError
from train.rl.trainer import RLTrainer


def main(argv: list[str]) -> int:
    if flags.FLAGS.audit:
        raise ConfigError("--audit: the communication audit reads a training step; an RL run's step is its own")
    return command.main(argv, build=RLTrainer.build)


if __name__ == "__main__":
    cli.run(main)
