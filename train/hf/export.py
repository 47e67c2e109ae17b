"""`python -m train.export_hf --workdir=DIR [--step=N] [--dtype=float32|bfloat16] [--merge_lora] --out=HFDIR`: a
run's checkpoint (a LoRA run's merged into its base) as a directory transformers' from_pretrained loads, through its
family's adapter (models/hf.py: Llama as LlamaForCausalLM, GPT with GPT-2's options as GPT2LMHeadModel): config,
generation_config, model.safetensors or shards with an index, and the run's tokenizer with its bos/eos ids if any."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import jax
import ml_dtypes
import numpy as np
from absl import app, flags, logging

import models
from checkpoint import safetensors_io
from mesh import use_cpu_devices
from mesh.errors import UserError, check_writable
from models import lora
from train import cli, exit_codes, hf_model
from train import config as run_config
from train import placed as placed_lib
from train.data import tokenizer as tok_lib

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


def merged(cfg, params):
    """(the base's config, its params with every adapter merged into its weight)."""
    projections = models.family_of(cfg).forward.lora_projections(cfg)
    return dataclasses.replace(cfg, lora_rank=0), lora.merge(params, cfg, projections)


def _shards(tensors: dict[str, np.ndarray], max_bytes: float) -> list[dict[str, np.ndarray]]:
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        if shards[-1] and size + tensors[name].nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += tensors[name].nbytes
    return shards


def used_vocabulary(cfg, params):
    """`params` with a padded table's rows past model.vocab_size (GPT-2's 50,257 of 50,304) cut off: every dimension
    whose logical axis is `vocab`."""
    _, axes = models.abstract_params(cfg)

    def cut(arr, spec):
        return arr[tuple(slice(0, cfg.vocab_size) if name == "vocab" else slice(None) for name in spec)]
    return jax.tree.map(cut, params, axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def write(out: pathlib.Path, cfg, params, dtype: str, codec=None, max_shard_bytes: float = 5e9) -> None:
    """Write HFDIR (through a temporary sibling, renamed at the end). `codec` is the run's
    train.tokenizer.Codec, or None for a byte-level run (no tokenizer, no bos/eos ids)."""
    adapter = models.family_of(cfg).hf
    params = used_vocabulary(cfg, params)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    tensors = {k: v.astype(np_dtype) for k, v in adapter.to_hf(params, cfg).items()}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        safetensors_io.write(tmp / "model.safetensors", tensors)
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map = {}
        for name, shard in zip(names, shards):
            safetensors_io.write(tmp / name, shard)
            weight_map.update({t: name for t in shard})
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    # Byte-level runs have no bos/eos token: None, not LlamaConfig's defaults (eos 2 would stop at byte 0x02).
    bos, eos = (None, None) if codec is None else (codec.bos_id, codec.eos_id)
    (tmp / "config.json").write_text(json.dumps(adapter.hf_config(cfg, dtype, bos, eos), indent=2) + "\n")
    generation = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if codec is not None:
        write_tokenizer(tmp, codec)
    if out.exists():
        out.rmdir()  # empty (checked before any work)
    tmp.rename(out)


def write_tokenizer(directory: pathlib.Path, codec) -> None:
    """tokenizer.json as trained, and a tokenizer_config.json so AutoTokenizer loads it as a fast tokenizer that
    adds nothing to the text (the run trained on documents as prepare encoded them)."""
    codec.tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": codec.token_text(codec.eos_id),
              "bos_token": codec.token_text(codec.bos_id), "add_bos_token": False, "add_eos_token": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


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


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)  # Orbax's info lines would bury the output
    use_cpu_devices(1)
    workdir, out = pathlib.Path(FLAGS.workdir).expanduser(), pathlib.Path(FLAGS.out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out={out} exists and is not empty; give a new directory")
    check_writable("--out", str(out), "directory", parents=True)
    if not FLAGS.max_shard_gb > 0:
        raise ExportError(f"--max_shard_gb={FLAGS.max_shard_gb}: must be > 0 (the most GB one safetensors file holds)")
    codec = tok_lib.load_run_codec(workdir)  # a damaged tokenizer.json stops before the restore
    _check_exportable(workdir, run_model(workdir)[1], FLAGS.merge_lora)
    cfg, params, step = restore_params(workdir, FLAGS.step)
    if FLAGS.merge_lora:
        cfg, params = merged(cfg, params)
    write(out, cfg, params, FLAGS.dtype, codec if codec.from_run else None, FLAGS.max_shard_gb * 1e9)
    print(f"wrote {out} (step {step}, {FLAGS.dtype}, {models.param_count(cfg):,} parameters)")
    return exit_codes.OK


if __name__ == "__main__":
    define_flags()
    cli.run(main)
