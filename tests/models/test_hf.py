"""Hugging Face interop against transformers: an exported llama3-tiny loads and gives our logits; a tiny random
LlamaForCausalLM imports through `hf:` on a 2- and a 4-device layout with its logits; bad files are one line."""
import json

import jax
import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the `hf` extra (transformers, torch) is not installed")
torch = pytest.importorskip("torch", reason="the `hf` extra (transformers, torch) is not installed")

import models  # noqa: E402
from checkpoint import RestoreFromError, safetensors_io  # noqa: E402
from tests import helpers  # noqa: E402
from tests.helpers import run_cli, tiny_config  # noqa: E402
from tests.hf_models import TOKENS, hf_logits, llama_import_config, trained_export  # noqa: E402
from train.hf import export as hf_export  # noqa: E402
from train.hf import restore as hf_import  # noqa: E402
from train.trainer import Trainer  # noqa: E402


@pytest.mark.parametrize("mesh", [{"tensor": 2}, {"fsdp": 2, "tensor": 2}], ids=["tensor2", "fsdp2_tensor2"])
def test_import_gives_transformers_logits(hf_llama, mesh):
    trainer = Trainer.build(llama_import_config(**mesh), num_devices=2 * len(mesh))
    params = hf_import.load_params(f"hf:{hf_llama}", trainer)
    ours = jax.jit(lambda p, t: models.forward(p, t, trainer.plan.model))(params, TOKENS)
    np.testing.assert_allclose(np.asarray(ours), hf_logits(hf_llama), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """llama3-tiny (2 layers, tied) trained 2 steps and exported: (model config, params, HF directory)."""
    config = tiny_config()
    config.model.update(preset="llama3-tiny", n_layers=2)
    return trained_export(tmp_path_factory.mktemp("export") / "out", config)


def test_export_loads_in_transformers_with_our_logits(exported):
    cfg, params, out = exported
    assert "lm_head.weight" not in safetensors_io.open_tensors(out / "model.safetensors")
    hf = json.loads((out / "config.json").read_text())
    assert hf["eos_token_id"] is None and hf["tie_word_embeddings"] is True
    ours = models.forward(params, TOKENS, cfg)
    np.testing.assert_allclose(np.asarray(ours), hf_logits(out), atol=1e-4, rtol=0)


def test_greedy_decoding_with_the_kv_cache_equals_transformers_generate(exported):
    cfg, params, out = exported
    prompt = TOKENS[:1, :8]
    new, logprobs = helpers.engine_greedy(cfg, params, prompt[0], 16)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        theirs = model.generate(torch.tensor(prompt), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    theirs = theirs.numpy()[0, 8:]
    n = helpers.clear_lead(logprobs)
    assert n >= 8
    np.testing.assert_array_equal(new[:n], theirs[:n])


def _damaged(hf_llama, tmp_path, change):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((hf_llama / "config.json").read_text())
    tensors = {k: np.array(v) for k, v in safetensors_io.open_tensors(hf_llama / "model.safetensors").items()}
    change(tensors)
    safetensors_io.write(bad / "model.safetensors", tensors)
    return bad


@pytest.mark.parametrize("change,fragment", [
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": np.zeros((3, 64), np.float32)}),
     "tensor model.layers.0.mlp.up_proj.weight has shape [3, 64], the config needs [96, 64]"),
    (lambda t: t.update({"model.layers.0.mlp.bias": np.zeros(3, np.float32)}),
     "tensor model.layers.0.mlp.bias is not a tensor of this Llama model"),
    (lambda t: t.pop("model.norm.weight"), "tensor model.norm.weight is missing"),
], ids=["shape", "foreign", "missing"])
def test_bad_tensors_are_one_line_errors(hf_llama, tmp_path, change, fragment):
    trainer = Trainer.build(llama_import_config(), num_devices=1)
    with pytest.raises(RestoreFromError, match="^checkpoint.restore_from=.*" + fragment.replace("[", r"\[")):
        hf_import.check(f"hf:{_damaged(hf_llama, tmp_path, change)}", trainer)
    with pytest.raises(RestoreFromError, match="model.d_mlp=128 vs 96"):
        hf_import.check(f"hf:{hf_llama}", Trainer.build(_with(d_mlp=128), num_devices=1))


def _with(**model):
    config = llama_import_config()
    config.model.update(**model)
    return config


def test_cli_bad_input_exits_2_and_writes_nothing(tmp_path):
    workdir = tmp_path / "run"
    out = run_cli("--config=experiments/tiny.py", f"--workdir={workdir}", "--config.model.preset=llama3-tiny",
                  f"--config.checkpoint.restore_from=hf:{tmp_path}/none", "--config.data.source=synthetic",
                  "--num_cpu_devices=1", "--config.mesh.data=1")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: checkpoint.restore_from='hf:"), out.stderr
    assert not (workdir / "checkpoints").exists()


def test_export_and_sampling_use_the_runs_tokenizer(exported, tmp_path):
    """A run on a DATADIR: its tokenizer.json and bos/eos ids (copied into the workdir at train start) reach the
    HF directory, where AutoTokenizer encodes as we do; train.sample encodes prompts and decodes with it."""
    from train.data import tokenizer as tok_lib
    from train.sample import prompt as sample
    cfg, params, _ = exported
    workdir = tmp_path / "run"
    workdir.mkdir()
    tok = tok_lib.train_bpe(["the cat sat on the mat; the dog sat on the log."] * 8, 280)
    tok.add_special_tokens(["<s>"])
    tok.save(str(workdir / "tokenizer.json"))
    eos, bos = tok.token_to_id(tok_lib.EOS_TEXT), tok.token_to_id("<s>")
    (workdir / "data_meta.json").write_text(json.dumps({"eos_id": eos, "bos_id": bos, "vocab_size": 320}))
    codec = tok_lib.load_run_codec(workdir)
    assert (codec.eos_id, codec.bos_id, codec.from_run) == (eos, bos, True)
    out = tmp_path / "hf"
    hf_export.write(out, cfg, params, "float32", codec)
    for name in ("config.json", "generation_config.json"):
        ids = json.loads((out / name).read_text())
        assert (ids["eos_token_id"], ids["bos_token_id"]) == (eos, bos)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    text = "the dog sat on the cat"
    assert theirs(text)["input_ids"] == codec.encode(text) == tok.encode(text).ids
    assert len(codec.encode(text)) < len(text.encode())  # merges, not bytes
    assert (theirs.eos_token_id, theirs.bos_token_id) == (eos, bos)

    prompt = sample.prompt_tokens(320, codec, text, None)
    assert prompt == codec.encode(text)
    new = codec.encode(" on the mat") + [eos]
    assert sample.render(codec, prompt, new, False) == text + " on the mat" + tok_lib.EOS_TEXT
    assert json.loads(sample.render(codec, prompt, new, True))["text"] == " on the mat" + tok_lib.EOS_TEXT
    (workdir / "tokenizer.json").write_text("{not json")
    with pytest.raises(tok_lib.TokenizerError, match=r"^--workdir=.*tokenizer.json"):
        tok_lib.load_run_codec(workdir)
    assert not tok_lib.load_run_codec(tmp_path).from_run  # no tokenizer: bytes


def test_an_hf_start_takes_the_shapes_from_config_json(hf_llama):
    """The preset alone names the family: config.json gives the shapes the preset's differ in."""
    from train.config import experiment as config_lib
    config = tiny_config()
    config.model.update(preset="llama3-tiny", seq_len=24)
    config.checkpoint.restore_from = f"hf:{hf_llama}"
    cfg = config_lib.resolve(config, 1).model
    assert (cfg.d_model, cfg.d_mlp, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.rope_theta, cfg.rope_scaling,
            cfg.tie_embeddings, cfg.seq_len) == (64, 96, 2, 4, 2, 10000.0, (8.0, 1.0, 4.0, 8), False, 24)
    hf_import.check_model(f"hf:{hf_llama}", cfg)
