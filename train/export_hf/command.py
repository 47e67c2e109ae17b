"""`python -m train.export_hf --workdir=DIR [--step=N] [--dtype=float32|bfloat16] [--merge_lora] [--overwrite]
--out=HFDIR`: a
run's checkpoint (a LoRA run's merged into its base) as a directory transformers' from_pretrained loads, through its
family's adapter (models/hf.py: Llama as LlamaForCausalLM, GPT with GPT-2's options as GPT2LMHeadModel): config,
generation_config, model.safetensors or shards with an index, and the run's tokenizer with its bos/eos ids if any."""
from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
from absl import app, flags, logging

import models
from mesh import use_cpu_devices
from mesh.errors import UserError, check_writable
from models import lora
from train import exit_codes
from train import placed as placed_lib
from train.config import experiment as run_config
from train.data import tokenizer as tok_lib
from train.hf import model as hf_model
from train.hf.export import foreign_files, merged, write

FLAGS = flags.FLAGS


class ExportError(UserError):
    """A run or output directory that cannot be exported as asked; one line naming the flag."""


def define_flags() -> None:
    """The command's flags, defined only when it runs as a command: importing `write` from a process that has
    its own --out or --workdir (train.prepare, tests) must not collide with them."""
    flags.DEFINE_string("workdir", None, "The training run's directory.", required=True)
    flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the newest).")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Dtype of the written tensors.")
    flags.DEFINE_string("out", None, "Directory to write; must not exist or be empty.", required=True)
    flags.DEFINE_float("max_shard_gb", 5.0, "Split model.safetensors into shards of at most this size.")
    flags.DEFINE_bool("overwrite", False, "Replace --out when it holds an earlier export (and nothing else).")
    flags.DEFINE_bool("merge_lora", False, "A LoRA run (model.lora_rank > 0): write each adapted weight as "
                      "W + (alpha/rank)·A·B, the base read from the run's checkpoint.restore_from.")


def run_model(workdir: pathlib.Path):
    """(the run's config, its model config)."""
    config = run_config.load_run_config(workdir)
    values = hf_model.model_values(config.model.to_dict(), config.checkpoint.restore_from)
    data_meta = workdir / "data_meta.json"  # a DATADIR run's vocabulary comes from its meta.json (train.config)
    if values.get("vocab_size") is None and data_meta.is_file():
        values["vocab_size"] = int(json.loads(data_meta.read_text())["vocab_size"])
    return config, models.from_dict(values)


def restore_params(workdir: pathlib.Path, step: int | None):
    """(model config, params as numpy in logical layer order, step) from a run's checkpoint, placed on one device
    (train.placed); a LoRA run's params are its base (read from checkpoint.restore_from) with its adapters."""
    config, cfg = run_model(workdir)
    placed = placed_lib.restore(placed_lib.on_one_device(cfg, config.checkpoint.restore_from, config.train.seed),
                                workdir, step)
    return cfg, jax.tree.map(np.asarray, jax.device_get(placed.params)), placed.step


def _check_exportable(workdir: pathlib.Path, cfg, merge_lora: bool) -> None:
    if lora.enabled(cfg) and not merge_lora:
        raise ExportError(f"--workdir={workdir} trains LoRA adapters (model.lora_rank={cfg.lora_rank}) and its "
                          f"checkpoints hold only them; add --merge_lora to write W + (alpha/rank)·A·B")
    if merge_lora and not lora.enabled(cfg):
        raise ExportError(f"--merge_lora: --workdir={workdir} has no adapters (model.lora_rank=0); drop the flag")
    adapter = models.family_of(cfg).hf
    if adapter is None:
        raise ExportError(f"--workdir={workdir} trains a {cfg.family} model, a family without a Hugging Face adapter "
                          f"(models/hf.py); only families with one export")
    why = adapter.unsupported(cfg)
    if why:
        raise ExportError(f"--workdir={workdir}: {why}")


def _check_out(out: pathlib.Path, overwrite: bool) -> None:
    """An --out that exists must be empty, or with --overwrite an earlier export: never a folder of the user's."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not out.is_dir():
        raise ExportError(f"--out={out} exists and is not a directory; give a new directory")
    if not overwrite:
        raise ExportError(f"--out={out} exists and is not empty; give a new directory, or pass --overwrite to "
                          f"replace an earlier export")
    foreign = foreign_files(out)
    if foreign:
        raise ExportError(f"--out={out} holds files an export does not write ({', '.join(foreign[:3])}), so "
                          f"--overwrite does not replace it; give a new directory")


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)  # Orbax's info lines would bury the output
    use_cpu_devices(1)
    workdir, out = pathlib.Path(FLAGS.workdir).expanduser(), pathlib.Path(FLAGS.out).expanduser()
    _check_out(out, FLAGS.overwrite)
    check_writable("--out", str(out), "directory", parents=True)
    if not FLAGS.max_shard_gb > 0:
        raise ExportError(f"--max_shard_gb={FLAGS.max_shard_gb}: must be > 0 (the most GB one safetensors file holds)")
    codec = tok_lib.load_run_codec(workdir)  # a damaged tokenizer.json stops before the restore
    _check_exportable(workdir, run_model(workdir)[1], FLAGS.merge_lora)
    cfg, params, step = restore_params(workdir, FLAGS.step)
    if FLAGS.merge_lora:
        cfg, params = merged(cfg, params)
    try:
        write(out, cfg, params, FLAGS.dtype, codec if codec.from_run else None, FLAGS.max_shard_gb * 1e9)
    except OSError as e:  # e.g. a full disk: nothing is left behind (write removes its temporary folder)
        raise ExportError(f"--out={out}: writing failed ({e.strerror}); free space there or choose another "
                          f"--out") from None
    print(f"wrote {out} (step {step}, {FLAGS.dtype}, {models.param_count(cfg):,} parameters)")
    return exit_codes.OK
