"""The model.* settings: `preset` and `family`, then every field of the registered families' config dataclasses
(models/*_config.py), each a typed placeholder that keeps the preset's value while unset. The families own the
fields, their help (models.config.described) and their checks."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar

from ml_collections import config_dict

import models
from train.config.settings import ConfigError, Section, nearest, setting

# Family fields resolve() fills in from the data (models/documents.py), never the user's settings.
DERIVED = ("document_eos_id", "masked_targets")

@dataclasses.dataclass(frozen=True)
class ModelSection(Section):
    """The model: a preset (which implies its family), then any field of that family, which overrides the
    preset's value (models/*_config.py check them)."""
    KEY: ClassVar[str] = "model"
    preset: str = setting("tiny", "a preset of a family (it implies model.family); the fields below override it",
                          allowed="a preset of a family's models/<family>_config.py")
    family: str = setting(None, "a family without a preset (models/<family>.py): that family's defaults", kind=str)


def _config_type(cls: type, field: dataclasses.Field) -> type:
    """The ConfigDict type of a family field: its annotation where that is a plain type (X | None: X), else its
    default's type, else str (rope_scaling, typed Any: a string on the command line)."""
    try:
        hint = typing.get_type_hints(cls).get(field.name)
    except (NameError, TypeError):
        hint = None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    for kind in (args[0] if len(args) == 1 else hint, type(field.default)):
        if kind in (int, float, str, bool):
            return kind
    return str


def _declared_fields(cls: type) -> list[dataclasses.Field]:
    """A family config's fields in the reference's order: the shared ones first (models.config.SharedFields, then
    its bases), the family's own last."""
    mro = [c for c in cls.__mro__ if dataclasses.is_dataclass(c)]
    order = mro[1:] + mro[:1]

    def rank(f: dataclasses.Field) -> int:
        return min(i for i, c in enumerate(order) if f.name in vars(c).get("__annotations__", {}))
    return sorted(dataclasses.fields(cls), key=rank)


def family_fields() -> dict[str, tuple[type, tuple[str, ...], str]]:
    """{field: (its config type, the families that have it, its help)} over every registered family, in the
    reference's order."""
    found: dict[str, tuple[type, tuple[str, ...], str]] = {}
    for name, family in models.FAMILIES.items():
        for f in _declared_fields(family.config_cls):
            if f.name not in DERIVED:
                kind, owners, help_ = found.get(f.name, (_config_type(family.config_cls, f), (), ""))
                found[f.name] = (kind, owners + (name,), help_ or f.metadata.get("help", ""))
    return found


def model_keys() -> dict[str, Any]:
    """The model.* section of the base config: preset, family, and every family field as a None placeholder."""
    keys = ModelSection.defaults()
    keys.update({name: config_dict.placeholder(kind) for name, (kind, _, _) in family_fields().items()})
    return keys


def check(values: Any) -> None:
    """The model section before anything is built: a preset that exists (with the nearest name when misspelled),
    and no override that makes the preset another kind of model (a mixture of experts left without experts)."""
    preset = values.get("preset")
    if preset and preset not in models.PRESETS:
        raise ConfigError(f"model.preset={preset!r}: unknown preset; {nearest(preset, models.PRESETS)}use one of "
                          f"{', '.join(models.PRESETS)}")
    if preset and values.get("n_experts") == 0 and models.from_dict({"preset": preset}).n_experts:
        raise ConfigError(f"model.n_experts=0: model.preset={preset!r} is a mixture of experts; choose a dense "
                          f"preset rather than removing its experts")
