"""`python -m train.sample --workdir=DIR [--step=N] (--prompt=TEXT | --prompt_tokens=1,2,3) --max_new_tokens=N
[--temperature=T --top_k=K --top_p=P --seed=S] [--json]`, or `--eval_batches=N` for the held-out loss and
perplexity. The model runs sharded on the run's mesh (`--config.mesh.*` overrides it); a pipelined run's
`pipeline` axis (and a context-parallel run's `context`) is folded into `data`, since decoding runs the whole layer
stack on every device."""
from __future__ import annotations

import dataclasses
import math
import pathlib
import sys

import jax
from absl import app, flags, logging

from mesh import use_cpu_devices
from mesh.layout import AXES
from models import paged
from train import cli, exit_codes
from train import placed as placed_lib
from train import step as step_lib
from train.config.experiment import ConfigError, Plan, base_config, resolve
from train.data import loader as data_lib
from train.data import tokenizer as tok_lib
from train.sample import prompt as prompt_lib
from train.serve import engine as serve
from train.serve import speculative

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defined only when run as a command, so tests can import `sample` beside other tools' flags."""
    cli.config_dict("config", base_config(), "Only --config.mesh.* and --config.serve.* overrides are read.")
    flags.DEFINE_string("workdir", None, "The training run's directory.", required=True)
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
    flags.DEFINE_string("prompt", None, "Prompt text, encoded with the run's tokenizer (its DATADIR's "
                        "tokenizer.json, or bytes for a run on raw text).")
    flags.DEFINE_string("prompt_tokens", None, "Prompt as token ids, e.g. 1,2,3.")
    flags.DEFINE_integer("max_new_tokens", None, f"Tokens to generate (default: {DEFAULT_NEW}, or as many as the "
                         f"model's context leaves after the prompt).")
    flags.DEFINE_float("temperature", 0.0, "0 is greedy and deterministic.")
    flags.DEFINE_integer("top_k", 0, "Keep the K most likely tokens (0: all).")
    flags.DEFINE_float("top_p", 1.0, "Keep the smallest set of tokens with this much probability (1: all).")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.DEFINE_boolean("json", False, "Print one JSON object {prompt_tokens, tokens, text}.")
    flags.DEFINE_integer("eval_batches", 0, "Print the loss and perplexity of N held-out batches.")
    flags.DEFINE_integer("num_cpu_devices", 8, "Virtual devices when the platform is CPU.")


DEFAULT_NEW = 64  # --max_new_tokens unless given


@dataclasses.dataclass(frozen=True)
class Request:
    """What to do with the run's model: decode `max_new` tokens after the prompt (text or token ids), or, with
    `eval_batches` > 0, score that many held-out batches."""
    prompt: str | None = None
    prompt_tokens: str | None = None
    max_new: int | None = None  # None: DEFAULT_NEW, within the model's context
    sampling: serve.SamplingParams = serve.SamplingParams()  # its max_tokens is max_new's
    as_json: bool = False
    eval_batches: int = 0


def mesh_overrides() -> dict[str, int]:
    """The --config.mesh.* flags given on the command line (the run's own mesh otherwise)."""
    return {name: FLAGS.config.mesh[name] for name in AXES
            if any(arg.startswith(f"--config.mesh.{name}=") for arg in sys.argv)}


def serve_overrides() -> dict:
    """The --config.serve.* flags given on the command line (e.g. serve.speculative; the run's own otherwise)."""
    return {name: FLAGS.config.serve[name] for name in FLAGS.config.serve
            if any(arg.startswith(f"--config.serve.{name}=") for arg in sys.argv)}


def check_flags() -> None:
    """The sampling flags, before anything is loaded."""
    value = lambda name: FLAGS[name].value  # noqa: E731
    for name, ok, rule in (("temperature", value("temperature") >= 0, ">= 0 (0 is greedy)"),
                           ("top_k", value("top_k") >= 0, ">= 0 (0 keeps every token)"),
                           ("top_p", 0 < value("top_p") <= 1, "in (0, 1] (1 keeps every token)"),
                           ("max_new_tokens", (value("max_new_tokens") or 1) >= 1, ">= 1"),
                           ("eval_batches", value("eval_batches") >= 0, ">= 0"),
                           ("num_cpu_devices", value("num_cpu_devices") >= 1, ">= 1")):
        if not ok:
            raise ConfigError(f"--{name}={value(name)}: must be {rule}")


def sample(workdir: pathlib.Path, step: int | None, request: Request, mesh: dict | None = None,
           serve_settings: dict | None = None) -> str:
    """The text train.sample prints: the run's model placed on its decoding mesh (placed.decoding_config),
    restored from checkpoint `step` (default: the newest); nothing of training (optimizer, train step) is built.
    `serve_settings`: serve.* values over the run's (the engine's: speculative decoding, pages)."""
    config = placed_lib.decoding_config(workdir, mesh)
    config.serve.update(serve_settings or {})
    plan = resolve(config, jax.device_count())
    placed = placed_lib.of_plan(plan)
    codec = tok_lib.load_run_codec(workdir)
    if request.eval_batches:
        source = data_lib.load(plan.data, plan.model.vocab_size, plan.model.seq_len + 1, plan.data.files)
        placed = placed_lib.restore(placed, workdir, step)
        return held_out(plan, placed, source, request.eval_batches)
    prompt = prompt_lib.prompt_tokens(plan.model.vocab_size, codec, request.prompt, request.prompt_tokens)
    if len(prompt) > plan.model.seq_len:  # before the checkpoint is read
        raise ConfigError(f"--prompt: {len(prompt)} tokens, longer than the {plan.model.seq_len} the model was "
                          f"trained on (model.seq_len); shorten it")
    limit = paged.max_context(plan.model)
    max_new = min(DEFAULT_NEW, limit - len(prompt)) if request.max_new is None else request.max_new
    if max_new < 1 or len(prompt) + max_new > limit:  # the context the model was trained on, as the server's limit
        raise ConfigError(f"--max_new_tokens={max_new}: the prompt and new tokens ({len(prompt) + max_new}) exceed "
                          f"the {limit} positions the model takes (model.seq_len, within model.max_positions); "
                          f"lower it to {max(limit - len(prompt), 0)} or less, or shorten the prompt")
    speculative.check_settings(plan.serve, plan.model)
    placed = placed_lib.restore(placed, workdir, step)
    # One sequence: steps of one token (and its speculative tokens), and prompt chunks of at most its length (fewer
    # step shapes to compile).
    chunk = min(plan.serve.prefill_chunk, len(prompt))
    most = max(chunk, 1 + (plan.serve.num_speculative_tokens if plan.serve.speculative != "off" else 0))
    engine = serve.Engine.build(placed, dataclasses.replace(plan.serve, max_num_seqs=1, prefill_chunk=chunk,
                                                            max_batch_tokens=most))
    [out] = engine.generate([prompt], dataclasses.replace(request.sampling, max_tokens=max_new))
    return prompt_lib.render(codec, prompt, out.token_ids, request.as_json)


def held_out(plan: Plan, placed: placed_lib.Placed, source: data_lib.TokenSource, batches: int) -> str:
    """The mean loss (and perplexity) of the first `batches` held-out batches, by an eval step alone."""
    eval_step = step_lib.make_eval_step(placed.model, placed.layout, None, plan.grad_accum)
    length = plan.model.seq_len + 1
    losses = [float(eval_step(placed.params, data_lib.global_batch(source, placed.layout.batch, plan.train.seed, i,
                                                                   plan.global_batch, length, "eval")))
              for i in range(batches)]
    loss = sum(losses) / len(losses)
    return (f"step {placed.step}: held-out loss {loss:.4f} nats over {len(losses)} batches, "
            f"perplexity {math.exp(loss):.3f}")


def request_from_flags() -> Request:
    sampling = serve.SamplingParams(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p, FLAGS.seed)
    return Request(FLAGS.prompt, FLAGS.prompt_tokens, FLAGS.max_new_tokens, sampling, FLAGS.json, FLAGS.eval_batches)


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)  # Orbax's info lines would bury the output
    check_flags()
    use_cpu_devices(FLAGS.num_cpu_devices)
    workdir = pathlib.Path(FLAGS.workdir).expanduser()
    print(sample(workdir, FLAGS.step, request_from_flags(), mesh_overrides(), serve_overrides()))
    return exit_codes.OK
