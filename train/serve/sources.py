"""Where a served model's config comes from besides a training run: a Hugging Face directory, read as its family's
first preset with config.json's fields over it (shared by the server's command and a draft model)."""
from __future__ import annotations

import pathlib

from train.config import base_config


def hf_serving_config(path: pathlib.Path, mesh: dict | None):
    """The config that serves a Hugging Face directory: its family's first preset with config.json's fields over
    it (train/hf_model.py, at resolve), and the context config.json says the model takes, not the preset's."""
    from train import hf_model
    spec = hf_model.PREFIX + str(path)
    config = base_config()
    config.checkpoint.restore_from = spec
    hf = hf_model.read_config(spec)
    family = hf_model.family_of_hf(spec, hf)
    config.model.preset = next(iter(family.presets))
    config.model.seq_len = hf_model.context_length(hf) or config.model.seq_len
    config.data.source = "synthetic"
    config.plan.auto = False
    config.mesh.update(mesh or {})
    return config
