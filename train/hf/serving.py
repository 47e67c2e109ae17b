"""A Hugging Face directory as a model to serve (`python -m train.serve --hf=DIR`): the config that places it (its
family's first preset, with config.json's fields over it at resolve) and its tokenizer as a codec."""
from __future__ import annotations

import json
import pathlib

import ml_collections

from train.data import tokenizer as tok_lib
from train.hf import model as hf_model


def config_for(config: ml_collections.ConfigDict, path: pathlib.Path, mesh: dict | None) -> ml_collections.ConfigDict:
    """`config` (a base config) set to serve `path`: restore_from=hf:PATH, the family's first preset (config.json's
    fields replace its shapes, train/hf/model.py), and the context config.json says the model takes, not the
    preset's."""
    spec = hf_model.PREFIX + str(path)
    config.checkpoint.restore_from = spec
    hf = hf_model.read_config(spec)
    family = hf_model.family_of_hf(spec, hf)
    config.model.preset = next(iter(family.presets))
    config.model.seq_len = hf_model.context_length(hf) or config.model.seq_len
    config.data.source = "synthetic"
    config.plan.auto = False
    config.mesh.update(mesh or {})
    return config


def codec(path: pathlib.Path) -> tok_lib.Codec:
    """The directory's tokenizer.json with config.json's eos and bos ids; bytes when it has none."""
    if not (path / tok_lib.FILE).is_file():
        return tok_lib.Codec(tok_lib.bytes_tokenizer(), 256, None, from_run=False)
    tok = tok_lib.load_file(str(path / tok_lib.FILE), "--hf")
    hf = json.loads((path / "config.json").read_text())
    eos, bos = hf.get("eos_token_id"), hf.get("bos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if eos is None:
        eos = tok.token_to_id(tok_lib.declared_eos(tok) or tok_lib.EOS_TEXT) or 0
    return tok_lib.Codec(tok, int(eos), None if bos is None else int(bos))
