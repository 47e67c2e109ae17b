"""`checkpoint.restore_from=hf:HFDIR`: a run starts from Hugging Face Llama weights (parameters only, a fresh
optimizer, step 0). Everything is checked before anything is written: the config.json must map to the run's
resolved model, every tensor must be there with its shape, and no tensor may be foreign. Each device's slice
is read from memory-mapped safetensors (checkpoint/safetensors_io.py), layer by layer, touching only the rows
of the HF tensors that slice needs."""
from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import jax
import numpy as np

import models
from checkpoint import safetensors_io
from checkpoint.errors import RestoreFromError
from models import llama_hf

PREFIX = "hf:"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
IGNORED = ("rotary_emb.inv_freq",)  # buffers some older exports carry; recomputed here


def _fail(spec: str, why: str) -> RestoreFromError:
    return RestoreFromError(f"checkpoint.restore_from={spec!r}: {why}")


def _directory(spec: str) -> pathlib.Path:
    path = pathlib.Path(spec[len(PREFIX):]).expanduser()
    if not (path / "config.json").is_file():
        raise _fail(spec, f"{path / 'config.json'} does not exist; give a directory written by save_pretrained "
                          f"or python -m train.export_hf")
    return path


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
    try:
        hf = json.loads((path / "config.json").read_text())
    except ValueError:
        raise _fail(spec, f"{path / 'config.json'} is not JSON") from None
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


def check_model(spec: str, cfg: Any, workdir: pathlib.Path | None = None) -> dict[str, np.ndarray]:
    """`check` for a model config (an export merging a LoRA run's base has no Trainer)."""
    if not isinstance(cfg, models.LlamaConfig):
        raise _fail(spec, f"Hugging Face import needs a Llama model; set model.preset to a llama preset "
                          f"(model.family is {cfg.family!r})")
    hf, tensors = open_tensors(spec)
    try:
        theirs = llama_hf.fields_from_hf(hf)
    except (KeyError, models.ModelConfigError) as e:
        raise _fail(spec, f"config.json: {e}") from None
    differ = [f"model.{k}={getattr(cfg, k)!r} vs {v!r}" for k, v in theirs.items() if getattr(cfg, k) != v]
    if differ:
        raise _fail(spec, f"the run's model differs from config.json ({'; '.join(differ)}); set those model.* "
                          f"values or choose another preset")
    wanted = llama_hf.hf_shapes(cfg)
    for name, arr in tensors.items():
        if name not in wanted and not name.endswith(IGNORED):
            raise _fail(spec, f"tensor {name} is not a tensor of this Llama model")
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


def load_params(spec: str, placed: Any) -> Any:
    """The params of `placed` (a train.placed.Placed or a Trainer: its in-memory layer order and shardings), each
    device reading only its slices."""
    return read_params(spec, placed.model, placed.abstract_params, placed.layer_order)


def read_params(spec: str, cfg: Any, target: Any, order: np.ndarray | None = None) -> Any:
    """The leaves of `target` (ShapeDtypeStructs with shardings, named as params are) from HFDIR, the layer
    stack in `order` (None: logical order), each device reading only its slices."""
    tensors = check_model(spec, cfg)
    read = tensors.__getitem__
    order = order if order is not None else np.arange(cfg.n_layers)

    def leaf(path, sds):
        keys = [k.key for k in path]

        def piece(index):
            if keys[0] == models.LAYERS:
                rows = [int(order[j]) for j in range(cfg.n_layers)[index[0]]]
                arr = np.stack([llama_hf.layer_from_hf(read, keys[1], i, cfg, index[1:]) for i in rows])
            else:
                arr = llama_hf.top_from_hf(read, keys[0], index)
            return np.asarray(arr, dtype=sds.dtype)
        return jax.make_array_from_callback(sds.shape, sds.sharding, piece)

    return jax.tree_util.tree_map_with_path(leaf, target)
