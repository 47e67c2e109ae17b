"""`checkpoint.restore_from=hf:HFDIR`: a run starts from Hugging Face weights (parameters only, a fresh optimizer,
step 0) of any family with an adapter (models/hf.py), the one its config.json's `architectures` names. Everything
is checked before anything is written: the config.json must map to the run's resolved model, every tensor must be
there with its shape, and no tensor may be foreign. Each device's slice is read from memory-mapped safetensors
(checkpoint/safetensors_io.py), layer by layer, touching only the rows of the HF tensors that slice needs."""
from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import jax
import numpy as np

import models
from checkpoint import safetensors_io
from train.hf import model as hf_model
from train.hf.model import PREFIX  # noqa: F401  (what callers test a spec with)
from train.hf.model import directory as _directory
from train.hf.model import fail as _fail

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def _weight_files(spec: str, path: pathlib.Path) -> list[pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError):
            raise _fail(spec, f"{index} is not a safetensors index (no weight_map)") from None
        files = [path / n for n in names]
    else:
        files = [path / "model.safetensors"]
    for f in files:
        if not f.is_file():
            raise _fail(spec, f"{f} does not exist; HFDIR needs model.safetensors (or the shards its index names)")
    return files


def open_tensors(spec: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(config.json as a dict, every tensor memory-mapped by name)."""
    path = _directory(spec)
    hf = hf_model.read_config(spec)
    tensors: dict[str, np.ndarray] = {}
    for f in _weight_files(spec, path):
        try:
            _check_complete(spec, f)
            tensors.update(safetensors_io.open_tensors(f))
        except safetensors_io.SafetensorsError as e:
            raise _fail(spec, str(e)) from None
    return hf, tensors


def _check_complete(spec: str, f: pathlib.Path) -> None:
    """A file cut short (an interrupted download or copy) holds fewer bytes than its header's tensors."""
    start, header = safetensors_io.read_header(f)
    end = start + max((int(info["data_offsets"][1]) for info in header.values()
                       if isinstance(info, dict) and "data_offsets" in info), default=0)
    size = f.stat().st_size
    if size < end:
        raise _fail(spec, f"{f} is truncated ({size:,} bytes, its header needs {end:,}); download or copy it again")


def check(spec: str, placed: Any, workdir: pathlib.Path | None = None) -> dict[str, np.ndarray]:
    """One-line errors for a config or tensor that does not match the model of `placed` (a train.placed.Placed or
    a Trainer); then the tokenizer files are copied into `workdir` (the only write). Returns the tensors."""
    return check_model(spec, placed.model, workdir)


def check_model(spec: str, cfg: models.ModelConfig, workdir: pathlib.Path | None = None) -> dict[str, np.ndarray]:
    """`check` for a model config (an export merging a LoRA run's base has no Trainer)."""
    hf, tensors = open_tensors(spec)
    family = hf_model.family_of_hf(spec, hf)
    if family.name != cfg.family:
        raise _fail(spec, f"config.json is a {family.name} model but the run's model is {cfg.family}; set "
                          f"model.preset to one of {', '.join(family.presets)}")
    adapter = family.hf
    tensors = {adapter.rename(k): v for k, v in tensors.items()}
    tensors = {k: v for k, v in tensors.items() if not k.startswith(tuple(adapter.left_out))}
    theirs = hf_model.fields(spec, hf, family)
    differ = [f"model.{k}={getattr(cfg, k)!r} vs {v!r}" for k, v in theirs.items() if getattr(cfg, k) != v]
    if differ:
        raise _fail(spec, f"the run's model differs from config.json ({'; '.join(differ)}); set those model.* "
                          f"values or choose another preset")
    wanted, kind = adapter.hf_shapes(cfg), type(cfg).__name__.removesuffix("Config")  # "Llama", "GPT"
    for name, arr in tensors.items():
        if name not in wanted and not name.endswith(adapter.ignored):
            raise _fail(spec, f"tensor {name} is not a tensor of this {kind} model")
        if name in wanted and tuple(arr.shape) != wanted[name]:
            raise _fail(spec, f"tensor {name} has shape {list(arr.shape)}, the config needs {list(wanted[name])}")
    missing = [n for n in wanted if n not in tensors]
    if missing:
        raise _fail(spec, f"tensor {missing[0]} is missing ({len(missing)} missing in all)")
    if workdir is not None:
        source = _directory(spec)
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                (workdir / "tokenizer").mkdir(parents=True, exist_ok=True)
                shutil.copy2(source / name, workdir / "tokenizer" / name)
    return tensors


def left_out(spec: str) -> str:
    """What HFDIR holds that its family does not import (a multimodal checkpoint's vision tower), as a phrase for
    the run's log: '' when nothing; else e.g. '; the vision tower (439 tensors) left out'."""
    hf, tensors = open_tensors(spec)
    adapter = hf_model.family_of_hf(spec, hf).hf
    names = [adapter.rename(k) for k in tensors]
    counts = {what: sum(n.startswith(prefix) for n in names) for prefix, what in adapter.left_out.items()}
    parts = [f"{what} ({n} tensors)" for what, n in counts.items() if n]
    return f"; {' and '.join(parts)} left out" if parts else ""


def load_params(spec: str, placed: Any) -> Any:
    """The params of `placed` (a train.placed.Placed or a Trainer: its in-memory layer order and shardings), each
    device reading only its slices."""
    return read_params(spec, placed.model, placed.abstract_params, placed.layer_order)


def read_params(spec: str, cfg: models.ModelConfig, target: Any, order: np.ndarray | None = None) -> Any:
    """The leaves of `target` (ShapeDtypeStructs with shardings, named as params are) from HFDIR, the layer
    stack in `order` (None: logical order), each device reading only its slices."""
    tensors = check_model(spec, cfg)
    read, adapter = tensors.__getitem__, models.family_of(cfg).hf
    order = order if order is not None else np.arange(cfg.n_layers)

    def leaf(path, sds):
        keys = [k.key for k in path]

        def piece(index):
            if keys[0] == models.LAYERS:
                rows = [int(order[j]) for j in range(cfg.n_layers)[index[0]]]
                arr = np.stack([adapter.layer_from_hf(read, "/".join(keys[1:]), i, cfg, index[1:]) for i in rows])
            else:
                arr = adapter.top_from_hf(read, keys[0], cfg, index)
            return np.asarray(arr, dtype=sds.dtype)
        return jax.make_array_from_callback(sds.shape, sds.sharding, piece)

    return jax.tree_util.tree_map_with_path(leaf, target)
