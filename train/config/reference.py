"""docs/configuration.md, written from the settings' declarations (train/config/sections.py,
train/config/model_settings.py): `python -m train.config` regenerates it; tests/train/test_configuration_doc.py
fails when it is stale."""
from __future__ import annotations

import pathlib
import sys

import models
from train.config import model_settings, sections
from train.config.settings import Section, Spec

PATH = pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
COMMAND = "python -m train.config"

_INTRO = f"""# Configuration reference

Every key of the experiment config, with its default. An experiment file (`experiments/*.py`) starts from
`train.config.experiment.base_config()` and `--config.KEY=VALUE` overrides any key on the command line. This file is
written from the declarations in [train/config/sections.py](../train/config/sections.py) and
[train/config/model_settings.py](../train/config/model_settings.py) by `{COMMAND}`; do not edit it by hand.
"""


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def _takes(spec: Spec) -> str:
    """The type column: the type, and the values or range it is checked against."""
    kind = spec.type.__name__
    if spec.choices:
        return f"{kind}: " + ", ".join(f"`{c}`" for c in spec.choices)
    if spec.allowed:
        return f"{kind}: {spec.allowed}"
    bounds = [f">= {spec.minimum:g}" if spec.minimum is not None else "",
              f"> {spec.above:g}" if spec.above is not None else "",
              f"<= {spec.maximum:g}" if spec.maximum is not None else "",
              f"< {spec.below:g}" if spec.below is not None else ""]
    return " ".join([kind, *filter(None, bounds)])


def section_table(section: type[Section]) -> list[str]:
    """One section's table: key, default, type and allowed values, help."""
    rows = [f"## `{section.KEY}`", "", " ".join((section.__doc__ or "").split()), "",
            "| key | default | type | what |", "|---|---|---|---|"]
    for name, spec in section.specs().items():
        default = "unset" if spec.default is None else f"`{spec.default!r}`"
        rows.append(f"| `{section.KEY}.{name}` | {_cell(default)} | {_cell(_takes(spec))} | {_cell(spec.help)} |")
    return rows + [""]


def model_table() -> list[str]:
    """model.*: preset and family, then every family field (unset: the preset's value, else the family's)."""
    rows = section_table(model_settings.ModelSection)[:-1]
    for name, (kind, owners, help_) in model_settings.family_fields().items():
        families = "" if len(owners) == len(models.FAMILIES) else f"({', '.join(owners)} only)"
        help_text = " ".join(filter(None, (help_, families)))
        rows.append(f"| `model.{name}` | unset | {kind.__name__} | {_cell(help_text)} |")
    note = ("A family field left unset keeps the preset's value (the family's default where the preset does not "
            "set it); a field the family does not have is an error when set.")
    return rows + ["", note, ""]


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def preset_table() -> list[str]:
    """Every `model.preset`, its family and the shape it sets (a field given beside it overrides that field)."""
    rows = ["### Presets", "", "What each `model.preset` sets; the parameters are `models.param_count`'s (a mixture's "
            "counts every expert).", "", "| preset | family | parameters | layers | d_model | heads | experts | "
            "vocabulary | seq_len | compute dtype |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name in models.PRESETS:
        cfg = models.from_dict({"preset": name})
        family = models.config.family_of_preset(name)
        rows.append(f"| `{name}` | {family} | {_count(models.param_count(cfg))} | {cfg.n_layers} | {cfg.d_model} | "
                    f"{cfg.n_heads} | {cfg.n_experts or '-'} | {cfg.vocab_size:,} | {cfg.seq_len:,} | "
                    f"{cfg.compute_dtype} |")
    return rows + [""]


def render() -> str:
    lines = [_INTRO]
    lines += model_table()
    lines += preset_table()
    for section in sections.SECTIONS:
        lines += section_table(section)
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    PATH.write_text(render())
    sys.stdout.write(f"wrote {PATH}\n")
