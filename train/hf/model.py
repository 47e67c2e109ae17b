"""The model of a run started from `checkpoint.restore_from=hf:DIR`: the family its config.json's `architectures`
names (through each family's adapter, models/hf.py) and the shapes and options config.json decides; the preset
names the family and what config.json does not carry. Read by train/config/experiment.py's model resolution before
anything is built, so it sits below it (train/hf/ reads the directory's tensors with it)."""
from __future__ import annotations

import json
import pathlib
from typing import Any

import models
from checkpoint.errors import RestoreFromError
from models.config import family_of_preset

PREFIX = "hf:"


def fail(spec: str, why: str) -> RestoreFromError:
    return RestoreFromError(f"checkpoint.restore_from={spec!r}: {why}")


def directory(spec: str) -> pathlib.Path:
    path = pathlib.Path(spec[len(PREFIX):]).expanduser()
    if not (path / "config.json").is_file():
        raise fail(spec, f"{path / 'config.json'} does not exist; give a directory written by save_pretrained "
                         f"or python -m train.export_hf")
    return path


def read_config(spec: str) -> dict[str, Any]:
    """config.json of HFDIR as a dict."""
    path = directory(spec) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except ValueError:
        raise fail(spec, f"{path} is not JSON") from None
    if not isinstance(hf, dict):
        raise fail(spec, f"{path} is not a JSON object")
    return hf


def context_length(hf: dict[str, Any]) -> int | None:
    """The positions config.json says the model takes (max_position_embeddings, or GPT-2's n_positions): the
    context a server of `--hf=DIR` decodes within. None when it says none."""
    text = hf.get("text_config")  # a multimodal model's text tower (Gemma3ForConditionalGeneration)
    hf = text if isinstance(text, dict) else hf
    value = hf.get("max_position_embeddings") or hf.get("n_positions")
    return int(value) if isinstance(value, int) and value > 0 else None


def supported() -> str:
    return ", ".join(f"{a} ({name})" for name, fam in models.FAMILIES.items() if fam.hf
                     for a in fam.hf.architectures)


def family_named(hf: dict[str, Any]) -> models.Family | None:
    """The family whose adapter reads one of config.json's `architectures`, or None."""
    found = hf.get("architectures") or []
    for family in models.FAMILIES.values():
        if family.hf is not None and isinstance(found, list) and set(found) & set(family.hf.architectures):
            return family
    return None


def family_of_hf(spec: str, hf: dict[str, Any]) -> models.Family:
    """`family_named`, or a one-line error naming what config.json has and what is supported."""
    family = family_named(hf)
    if family is None:
        raise fail(spec, f"config.json has architectures {hf.get('architectures')!r}, which no model family reads; "
                         f"supported: {supported()}")
    return family


def fields(spec: str, hf: dict[str, Any], family: models.Family) -> dict[str, Any]:
    """The family's model fields from config.json, as a one-line error when the adapter refuses it."""
    try:
        return family.hf.fields_from_hf(hf)
    except (KeyError, TypeError, ValueError, models.ModelConfigError) as e:
        raise fail(spec, f"config.json: {e}") from None


def _normalized(family: models.Family, key: str, value: Any) -> Any:
    """`value` as the family's config holds it (a rope_scaling string parsed, ...)."""
    try:
        return getattr(family.config_cls(**{key: value}), key)
    except (TypeError, ValueError, models.ModelConfigError):
        return value


def _architecture(family: models.Family, preset: str) -> str:
    """The config.json architecture the family's adapter writes for `preset` (Qwen3ForCausalLM for a qwen3)."""
    return family.hf.hf_config(models.from_dict({"preset": preset}), "float32", None, None)["architectures"][0]


def _check_architecture(spec: str, hf: dict[str, Any], family: models.Family, preset: str) -> None:
    """A preset of the directory's family but of another architecture (qwen3-tiny over a Llama) is an error: the
    directory's config.json would silently turn the run into its own architecture."""
    found = hf.get("architectures") or []
    wanted = _architecture(family, preset)
    if wanted not in found:
        same = [p for p in family.presets if _architecture(family, p) in found]
        raise fail(spec, f"config.json has architectures {found!r} but model.preset={preset!r} is a {wanted}; set "
                         f"model.preset to one of {', '.join(same) or 'that architecture'}")


def model_values(values: dict[str, Any], spec: str) -> dict[str, Any]:
    """The model section `values` ({field: value or None}, the preset and family among them) with what HFDIR's
    config.json decides filled in, for `spec` = checkpoint.restore_from; unchanged for any other spec. A value
    the user gave that config.json contradicts is a one-line error naming it and both values."""
    spec = str(spec or "")
    if not spec.startswith(PREFIX) or not (pathlib.Path(spec[len(PREFIX):]).expanduser() / "config.json").is_file():
        return values  # a missing directory is named where a fresh start checks it (a resumed run may not need it)
    hf = read_config(spec)
    family = family_named(hf)
    if family is None:  # named, after the weight files' own checks, where a fresh start checks the directory
        return values
    preset, named = values.get("preset") or None, values.get("family") or None
    theirs = named or (family_of_preset(preset) if preset else family.name)
    if theirs != family.name:
        setting = f"model.family={named!r}" if named else f"model.preset={preset!r}"
        presets = ", ".join(family.presets)
        raise fail(spec, f"config.json has architectures {hf.get('architectures')!r} (the {family.name} family) "
                         f"but {setting} is a {theirs} model; set model.preset to one of {presets}")
    if preset:
        _check_architecture(spec, hf, family, preset)
    hf_fields = fields(spec, hf, family)
    differ = [f"model.{k}={values[k]!r} vs {v!r}" for k, v in hf_fields.items()
              if values.get(k) is not None and _normalized(family, k, values[k]) != _normalized(family, k, v)]
    if differ:
        raise fail(spec, f"the run's model differs from config.json ({'; '.join(differ)}); the model's shapes "
                         f"come from config.json: drop those model.* overrides")
    return {**values, **hf_fields, **({} if preset or named else {"family": family.name})}
