"""Bad configurations fail with one line naming the setting, before compiling, and leave the workdir alone."""

import pytest

from mesh.errors import UserError
from tests.helpers import run_cli, tiny_config
from train.loop import runner as loop


def _bad_configs():
    def with_(**changes):
        config = tiny_config()
        for dotted, value in changes.items():
            section, key = dotted.split("__")
            config[section][key] = value
        return config

    unknown_axis = tiny_config()
    unknown_axis.mesh.sequence = 2
    return {
        "product": (with_(mesh__data=3), "mesh: data=3 needs 3 devices but 8 are available"),
        "two_wildcards": (with_(mesh__data=-1, mesh__tensor=-1), "mesh.data and mesh.tensor are both -1"),
        "zero_axis": (with_(mesh__data=8, mesh__fsdp=0), "mesh.fsdp=0"),
        "unknown_axis": (unknown_axis, "mesh.sequence: unknown mesh axis"),
        "indivisible_param": (with_(mesh__data=1, mesh__tensor=8, model__n_heads=4),
                              "is not divisible by mesh axes tensor=8"),
        "batch": (with_(mesh__data=8, train__global_batch_size=12), "train.global_batch_size=12"),
        "strategy": (with_(mesh__data=8, sharding__strategy="zero9"), "sharding.strategy='zero9'"),
        "preset": (with_(mesh__data=8, model__preset="huge"), "model.preset='huge'"),
        "heads": (with_(mesh__data=8, model__n_heads=3), "model.d_model=128 is not divisible by model.n_heads=3"),
        "source": (with_(mesh__data=8, data__source="web"), "data.source='web'"),
        "missing_file": (with_(mesh__data=8, data__source="tokens", data__path="/nonexistent/train.bin"),
                         "data.path='/nonexistent/train.bin'"),
        "order": (with_(mesh__data=8, data__order="shuffled"), "data.order='shuffled'"),
        "mixture": (with_(mesh__data=8, data__source="tokens", data__path="a:0.5,b:-1"), "a mixture is DIR:WEIGHT"),
        "warmup": (with_(mesh__data=8, optimizer__warmup_steps=50), "optimizer.warmup_steps=50"),
        "profile": (with_(mesh__data=8, train__profile_steps="5:30"), "train.profile_steps='5:30': LAST is past"),
        "cudnn_on_cpu": (with_(mesh__data=8, model__attention="cudnn"),
                         "model.attention=cudnn: it needs an NVIDIA GPU"),
        "attention": (with_(mesh__data=8, model__attention="flash"), "model.attention='flash': use one of"),
        "float16": (with_(mesh__data=8, model__compute_dtype="float16"), "model.compute_dtype=float16: float16 needs"),
        "loss_chunk": (with_(mesh__data=8, model__loss_chunk_size=-1), "model.loss_chunk_size=-1"),
        "lora_rank": (with_(mesh__data=8, model__lora_rank=-1), "model.lora_rank=-1: an integer >= 0"),
        "lora_target": (with_(mesh__data=8, model__lora_rank=4, model__lora_targets="q,gate"),
                        "model.lora_targets='q,gate': a comma list of q, k, v, o, mlp"),
        "lora_alpha": (with_(mesh__data=8, model__lora_rank=4, model__lora_alpha=0.0),
                       "model.lora_alpha=0.0: a number > 0"),
    }


@pytest.mark.parametrize("name", sorted(_bad_configs()))
def test_error_is_one_line_and_workdir_untouched(name, tmp_path, monkeypatch):
    config, fragment = _bad_configs()[name]
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    before = {p.name: p.read_bytes() for p in workdir.iterdir()}
    # Compilation must not start: make it explode if reached.
    monkeypatch.setattr(loop.Trainer, "compile", lambda self: pytest.fail("compiled a bad config"))
    with pytest.raises(UserError) as info:
        loop.run(config, str(workdir))
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert {p.name: p.read_bytes() for p in workdir.iterdir()} == before


def test_cli_prints_one_line_and_exits_nonzero(tmp_path):
    result = run_cli("--config=experiments/tiny.py", f"--workdir={tmp_path / 'run'}", "--config.mesh.data=3")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        "error: mesh: data=3 needs 3 devices but 8 are available; change the mesh.* sizes (or set one to -1)")
    assert not (tmp_path / "run").exists()


def test_unwritable_workdir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(UserError, match="--workdir="):
        loop.prepare_workdir(str(blocker / "run"))
    assert blocker.read_text() == "not a directory"


def test_default_experiment_variants():
    from experiments import default
    assert default.get_config().mesh.pipeline == 2
    assert default.get_config("fsdp_tensor").mesh.fsdp == 2 and default.get_config("data_parallel").mesh.data == 8
    with pytest.raises(ValueError, match="unknown variant"):
        default.get_config("bogus")


@pytest.mark.parametrize("key,value,fragment", [
    ("checkpoint.keep", 0, "checkpoint.keep=0: keep at least 1 checkpoint"),
    ("checkpoint.every_steps", -1, "checkpoint.every_steps=-1: must be a number >= 0 (0 turns it off)"),
    ("train.on_nonfinite", "ignore", "train.on_nonfinite='ignore': use 'stop' (default) or 'skip'"),
    ("checkpoint.restore_params_only", True, "checkpoint.restore_params_only=True needs checkpoint.restore_from"),
])
def test_fault_tolerance_settings_are_checked_by_resolve(key, value, fragment):
    from train.config.experiment import resolve
    config = tiny_config(data=8)
    section, name = key.split(".")
    config[section][name] = value
    with pytest.raises(UserError) as info:
        resolve(config, 8)
    assert str(info.value).startswith(fragment) and "\n" not in str(info.value)


def test_attention_resolves_per_platform_into_the_plan():
    from train.config.experiment import resolve
    config = tiny_config(data=8)
    assert resolve(config, 8).model.attention == "xla"  # auto on this CPU
    config.model.update(preset="gpt2-125m", seq_len=64)  # bfloat16, head dimension 64
    assert resolve(config, 8, platform="gpu").model.attention == "cudnn"
    config.model.attention = "xla"
    assert resolve(config, 8, platform="gpu").model.attention == "xla"
