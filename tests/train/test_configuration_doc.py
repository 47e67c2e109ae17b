"""The settings' declarations (train/config/sections.py, train/config/model_settings.py) are the one place a
setting is written:
docs/configuration.md is generated from them and must be current, the base config and the model.* keys come from
them, their checks give the one-line errors, and the config.json of an older run still resolves."""
import dataclasses
import json
import shutil

import pytest

import models
from tests.helpers import ROOT
from train.config import model_settings, sections
from train.config import reference as config_reference
from train.config.experiment import ConfigError, base_config, load_run_config, resolve


def test_the_committed_reference_is_current(monkeypatch):
    for name, family in list(models.FAMILIES.items()):  # families other tests register (a toy) are not documented
        if not family.config_cls.__module__.startswith("models."):
            monkeypatch.delitem(models.FAMILIES, name)
    committed = config_reference.PATH.read_text() if config_reference.PATH.exists() else ""
    assert committed == config_reference.render(), (
        f"docs/configuration.md is stale: run `{config_reference.COMMAND}` and commit the result")


def test_the_base_config_is_the_declarations():
    config = base_config()
    declared = {"model", *(s.KEY for s in sections.SECTIONS)}
    assert set(config.keys()) == declared
    for section in sections.SECTIONS:
        assert set(config[section.KEY].keys()) == set(section.specs()), section.KEY
        for name, spec in section.specs().items():
            assert config[section.KEY].to_dict()[name] == spec.default, f"{section.KEY}.{name}"
    text = config_reference.PATH.read_text()
    for section in ("model", *(s.KEY for s in sections.SECTIONS)):
        for key in config[section].keys():
            assert f"| `{section}.{key}` |" in text, f"{section}.{key} is missing from docs/configuration.md"


def test_model_keys_are_every_family_field_but_the_derived_ones():
    fields = {f.name for family in models.FAMILIES.values() for f in dataclasses.fields(family.config_cls)}
    keys = set(base_config().model.keys())
    assert keys == {"preset", "family"} | fields - set(model_settings.DERIVED)
    assert "mlp_ratio" in keys and "n_kv_heads" in keys and "document_eos_id" not in keys
    assert base_config().model.get_type("rope_scaling") is str  # typed Any on LlamaConfig: a string to override


def test_a_new_family_field_becomes_a_setting(monkeypatch):
    """A field added to a family's config dataclass is a model.* key, typed from its annotation, in the reference."""
    @dataclasses.dataclass(frozen=True)
    class ProbeConfig(models.GPTConfig):
        family = "probe"
        probe_width: int | None = 3

    monkeypatch.setitem(models.FAMILIES, "probe", dataclasses.replace(models.FAMILIES["gpt"], name="probe",
                                                                     config_cls=ProbeConfig))
    model = base_config().model
    assert "probe_width" in model and model.probe_width is None and model.get_type("probe_width") is int
    assert "| `model.probe_width` | unset | int | (probe only) |" in config_reference.render()


@pytest.mark.parametrize("key,value,message", [
    ("train.eval_every", -1, "train.eval_every=-1: must be a positive number"),
    ("optimizer.lr", 0.0, "optimizer.lr=0.0: must be a positive number"),
    ("fault_injection.hang_s", -1.0, "fault_injection.hang_s=-1.0: must be a number >= 0 (0 turns it off)"),
    ("checkpoint.max_failed_saves", 0, "checkpoint.max_failed_saves=0: use a whole number >= 1 (that many "
                                       "failed saves in a row stop the run)"),
    ("checkpoint.enabled", None, "checkpoint.enabled=None: use True or False"),
    ("data.order", "shuffled", "data.order='shuffled': use epochs (each window once per epoch) or random"),
])
def test_declared_checks_name_the_setting(key, value, message):
    config = base_config()
    section, name = key.split(".")
    config[section][name] = value
    with pytest.raises(ConfigError) as info:
        resolve(config, 8)
    assert str(info.value) == message


def test_a_config_json_from_an_older_run_resolves_with_the_newer_defaults(tmp_path):
    """The fixture's config.json predates data.order, data.loss_mask, the local tier and max_failed_saves."""
    shutil.copy(ROOT / "tests" / "fixtures" / "checkpoint_604b7c2" / "config.json", tmp_path / "config.json")
    saved = json.loads((tmp_path / "config.json").read_text())["config"]
    assert "local_dir" not in saved["checkpoint"] and "order" not in saved["data"]
    plan = resolve(load_run_config(tmp_path), 8)
    assert plan.checkpoint == sections.CheckpointSection(
        every_steps=saved["checkpoint"]["every_steps"], every_minutes=saved["checkpoint"]["every_minutes"],
        keep=saved["checkpoint"]["keep"], keep_period=saved["checkpoint"]["keep_period"])
    assert plan.data.source == "synthetic" and plan.data.order == "epochs" and plan.data.files is None
    assert plan.train.steps == saved["train"]["steps"] == plan.steps and plan.train.loggers == ("tensorboard",)
    assert sections.CheckpointSection.from_config({}) == sections.CheckpointSection()
