"""`python -m train.sample --workdir=DIR [--step=N] (--prompt=TEXT | --prompt_tokens=1,2,3) --max_new_tokens=N
[--temperature=T --top_k=K --top_p=P --seed=S] [--json]`, or `--eval_batches=N` for the held-out loss and
perplexity. The model runs sharded on the run's mesh (`--config.mesh.*` overrides it); a pipelined run's
`pipeline` axis (and a context-parallel run's `context`) is folded into `data`, since decoding runs the whole layer
stack on every device."""
from __future__ import annotations

import math
import pathlib
import sys

import numpy as np
from absl import app, flags, logging

import checkpoint
from checkpoint import format as ckpt_format
from mesh import use_cpu_devices
from mesh.layout import AXES
from train import cli, exit_codes
from train import config as run_config
from train.config import ConfigError, base_config
from train.data import tokenizer as tok_lib
from train.generate import decode as generate
from train.generate import prompt as prompt_lib
from train.lora import base as lora_base
from train.trainer import Trainer

_CONFIG = cli.config_dict("config", base_config(), "Only --config.mesh.* overrides are read.")
_WORKDIR = flags.DEFINE_string("workdir", None, "The training run's directory.", required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text, encoded with the run's tokenizer (its DATADIR's "
                              "tokenizer.json, or bytes for a run on raw text).")
_PROMPT_TOKENS = flags.DEFINE_string("prompt_tokens", None, "Prompt as token ids, e.g. 1,2,3.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 is greedy and deterministic.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Keep the K most likely tokens (0: all).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Keep the smallest set of tokens with this much probability (1: all).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_JSON = flags.DEFINE_boolean("json", False, "Print one JSON object {prompt_tokens, tokens, text}.")
_EVAL_BATCHES = flags.DEFINE_integer("eval_batches", 0, "Print the loss and perplexity of N held-out batches.")
_NUM_CPU_DEVICES = flags.DEFINE_integer("num_cpu_devices", 8, "Virtual devices when the platform is CPU.")


def _mesh_overrides(config) -> None:
    """The run's mesh, with the --config.mesh.* flags given and `pipeline` and `context` folded into `data`
    (decoding runs the whole stack on every device, one new token at a time)."""
    for name in AXES:
        if any(arg.startswith(f"--config.mesh.{name}=") for arg in sys.argv):
            config.mesh[name] = _CONFIG.value.mesh[name]
    generate.fold_stack_axes(config.mesh)


def check_flags() -> None:
    """The sampling flags, before anything is loaded."""
    for flag, ok, rule in ((_TEMPERATURE, _TEMPERATURE.value >= 0, ">= 0 (0 is greedy)"),
                           (_TOP_K, _TOP_K.value >= 0, ">= 0 (0 keeps every token)"),
                           (_TOP_P, 0 < _TOP_P.value <= 1, "in (0, 1] (1 keeps every token)"),
                           (_MAX_NEW, _MAX_NEW.value >= 1, ">= 1"), (_EVAL_BATCHES, _EVAL_BATCHES.value >= 0, ">= 0"),
                           (_NUM_CPU_DEVICES, _NUM_CPU_DEVICES.value >= 1, ">= 1")):
        if not ok:
            raise ConfigError(f"--{flag.name}={flag.value}: must be {rule}")


def run(workdir: pathlib.Path) -> None:
    config = run_config.load_run_config(workdir)
    _mesh_overrides(config)
    trainer = Trainer.build(config)
    cfg = trainer.plan.model
    codec = tok_lib.load_run_codec(workdir)
    prompt = None if _EVAL_BATCHES.value else prompt_lib.prompt_tokens(cfg.vocab_size, codec, _PROMPT.value,
                                                                        _PROMPT_TOKENS.value)
    source, step, spec = run_config.run_checkpoints(workdir, _STEP.value)
    got = checkpoint.restore_source(source, step, {"params": ckpt_format.target(trainer)["params"]}, True, spec)
    params = ckpt_format.params_from_tree(trainer, got.tree["params"], lora_base.for_trainer(trainer))
    if _EVAL_BATCHES.value:
        losses = [float(trainer.eval_step(params, trainer.batch(i, "eval"))) for i in range(_EVAL_BATCHES.value)]
        loss = sum(losses) / len(losses)
        print(f"step {step}: held-out loss {loss:.4f} nats over {len(losses)} batches, perplexity {math.exp(loss):.3f}")
        return
    sampling = generate.Sampling(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value, _SEED.value)
    gen = generate.Generator(cfg, sampling, trainer.layout.constrain(), trainer.mesh)
    new, _ = gen(params, np.asarray([prompt]), _MAX_NEW.value)
    tokens = [int(t) for t in new[0]]
    print(prompt_lib.render(codec, prompt, tokens, _JSON.value))


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)  # Orbax's info lines would bury the output
    check_flags()
    use_cpu_devices(_NUM_CPU_DEVICES.value)
    run(pathlib.Path(_WORKDIR.value).expanduser())
    return exit_codes.OK


if __name__ == "__main__":
    cli.run(main)
