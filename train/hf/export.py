"""Hugging Face directories written from a run's params, through its family's adapter (models/hf.py: Llama as
LlamaForCausalLM, GPT with GPT-2's options as GPT2LMHeadModel): config, generation_config, model.safetensors or
shards with an index, and the run's tokenizer with its bos/eos ids if any. The command is train/export_hf/command.py."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile

import jax
import ml_dtypes
import numpy as np

import models
from checkpoint import safetensors_io
from models import lora


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


WRITTEN = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
           "model-*-of-*.safetensors", "tokenizer.json", "tokenizer_config.json")  # every file an export writes


def foreign_files(out: pathlib.Path) -> list[str]:
    """The entries of directory `out` an export does not write: what `--overwrite` must never remove."""
    return sorted(p.name for p in out.iterdir() if p.is_dir() or not any(p.match(w) for w in WRITTEN))


def write(out: pathlib.Path, cfg, params, dtype: str, codec=None, max_shard_bytes: float = 5e9) -> None:
    """Write HFDIR (through a temporary sibling of a name no user folder can have, renamed at the end; removed
    when writing fails). An existing `out` (empty, or an earlier export: checked before any work) is set aside
    only once the new one is whole, then removed. `codec` is the run's train.tokenizer.Codec, or None for a
    byte-level run (no tokenizer, no bos/eos ids)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    old = tmp.with_name(tmp.name + "-replaced")
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would make the exported folder private
        _write_files(tmp, cfg, params, dtype, codec, max_shard_bytes)
        if out.exists():
            assert not foreign_files(out), out  # the command refused such an --out before any work
            out.rename(old)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def _write_files(tmp: pathlib.Path, cfg, params, dtype: str, codec, max_shard_bytes: float) -> None:
    adapter = models.family_of(cfg).hf
    params = used_vocabulary(cfg, params)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    tensors = {k: v.astype(np_dtype) for k, v in adapter.to_hf(params, cfg).items()}
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


def write_tokenizer(directory: pathlib.Path, codec) -> None:
    """tokenizer.json as trained, and a tokenizer_config.json so AutoTokenizer loads it as a fast tokenizer that
    adds nothing to the text (the run trained on documents as prepare encoded them)."""
    codec.tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": codec.token_text(codec.eos_id),
              "bos_token": codec.token_text(codec.bos_id), "add_bos_token": False, "add_eos_token": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


