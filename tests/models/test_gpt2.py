"""GPT-2 both ways through the GPT family's Hugging Face adapter, judged by transformers: a tiny random
GPT2LMHeadModel imported with `restore_from=hf:DIR` (shapes from its config.json, the vocabulary padded) gives its
logits on tensor=2, and exports back to the same tensors; a trained GPT with GPT-2's options, exported, loads in
transformers, whose greedy decoding equals ours; LoRA merges over the biases; bad directories are one line."""
import functools
import json
import re

import jax
import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the `hf` extra (transformers, torch) is not installed")
torch = pytest.importorskip("torch", reason="the `hf` extra (transformers, torch) is not installed")

import models  # noqa: E402
from checkpoint import RestoreFromError, safetensors_io  # noqa: E402
from models import lora  # noqa: E402
from tests import helpers  # noqa: E402
from tests.helpers import tiny_config  # noqa: E402
from tests.hf_models import trained_export  # noqa: E402
from train.config import experiment as config_lib  # noqa: E402
from train.export_hf import command as export_hf  # noqa: E402
from train.hf import export as hf_export  # noqa: E402
from train.hf import restore as hf_import  # noqa: E402
from train.trainer import Trainer  # noqa: E402

VOCAB = 250  # padded to 256 on import
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 16))
GPT2_OPTIONS = dict(positions="learned", bias=True, norm="layernorm", tie_embeddings=True)


@functools.lru_cache(maxsize=None)
def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logits(path) -> np.ndarray:
    with torch.no_grad():
        return _hf_model(path)(torch.tensor(TOKENS)).logits.numpy()


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A random tiny GPT2LMHeadModel saved by transformers, every bias and norm drawn at random too."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                  layer_norm_epsilon=1e-5, bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "ln_" in name and name.endswith("weight") else 0.0))
    path = tmp_path_factory.mktemp("gpt2") / "tiny"
    model.save_pretrained(path)
    return path


def _import_config(path, **mesh):
    config = tiny_config(**mesh)
    # The preset names the family and what config.json does not carry (the padding multiple among them).
    config.model.update(preset="gpt2", seq_len=16, compute_dtype="float32", loss_chunk_size=0)
    config.checkpoint.restore_from = f"hf:{path}"
    return config


def test_import_gives_transformers_logits_and_exports_the_same_tensors(gpt2_dir, tmp_path):
    trainer = Trainer.build(_import_config(gpt2_dir, tensor=2), num_devices=2)
    cfg = trainer.plan.model
    assert (cfg.vocab_size, cfg.vocab_rows, cfg.d_model, cfg.max_positions, cfg.norm) == (VOCAB, 256, 32, 32,
                                                                                          "layernorm")
    assert models.param_count(cfg) == _hf_model(gpt2_dir).num_parameters() + (256 - VOCAB) * 32  # the padded rows
    params = hf_import.load_params(f"hf:{gpt2_dir}", trainer)
    ours = np.asarray(jax.jit(lambda p, t: models.forward(p, t, cfg))(params, TOKENS))
    np.testing.assert_allclose(ours[..., :VOCAB], _hf_logits(gpt2_dir), atol=1e-4, rtol=0)
    assert np.all(ours[..., VOCAB:] == -np.inf)
    hf_export.write(tmp_path / "out", cfg, jax.tree.map(np.asarray, jax.device_get(params)), "float32", None)
    theirs = safetensors_io.open_tensors(gpt2_dir / "model.safetensors")
    back = safetensors_io.open_tensors(tmp_path / "out" / "model.safetensors")
    assert set(back) == {k for k in theirs if k != "lm_head.weight"}
    for name, arr in back.items():
        np.testing.assert_array_equal(arr, theirs[name], err_msg=name)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == VOCAB


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A GPT with GPT-2's options (untied at first: an untied head exports too) trained 2 steps and exported."""
    config = tiny_config()
    config.model.update(n_layers=2, d_model=64, **{**GPT2_OPTIONS, "tie_embeddings": False})
    return trained_export(tmp_path_factory.mktemp("export") / "out", config)


def test_export_loads_in_transformers_and_greedy_decoding_agrees(exported):
    cfg, params, out = exported
    assert "lm_head.weight" in safetensors_io.open_tensors(out / "model.safetensors")
    np.testing.assert_allclose(np.asarray(models.forward(params, TOKENS, cfg)), _hf_logits(out), atol=1e-4, rtol=0)
    prompt = TOKENS[:1, :8]
    new, logprobs = helpers.engine_greedy(cfg, params, prompt[0], 16)
    with torch.no_grad():
        theirs = _hf_model(out).generate(torch.tensor(prompt), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    n = helpers.clear_lead(logprobs)
    assert n >= 8
    np.testing.assert_array_equal(new[:n], theirs.numpy()[0, 8:8 + n])


def test_lora_merges_over_the_biases(exported):
    cfg, params, _ = exported
    adapted = models.from_dict({**{k: getattr(cfg, k) for k in ("vocab_size", "seq_len", "d_model", "n_layers")},
                                **GPT2_OPTIONS, "lora_rank": 2, "lora_targets": "q,v,o,mlp"})
    with_adapters = jax.tree.map(np.asarray, models.init_params(adapted, 1))
    with_adapters["layers"][lora.KEY] = jax.tree.map(lambda x: x + 0.05, with_adapters["layers"][lora.KEY])
    base_cfg, merged = hf_export.merged(adapted, with_adapters)
    both = jax.jit(lambda m, a: (models.forward(m, TOKENS, base_cfg), models.forward(a, TOKENS, adapted)))
    ours, theirs = both(merged, with_adapters)
    assert np.abs(np.asarray(ours) - np.asarray(models.forward(params, TOKENS, cfg))).max() > 1e-2  # adapted
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-4, rtol=0)


def _resolve_error(config, fragment):
    with pytest.raises(RestoreFromError, match=r"^checkpoint.restore_from='hf:.*': " + fragment):
        config_lib.resolve(config, 1)


def test_bad_directories_and_overrides_are_one_line(gpt2_dir, tmp_path):
    config = _import_config(gpt2_dir)
    config.model.d_model = 64
    _resolve_error(config, r"the run's model differs from config.json \(model.d_model=64 vs 32\)")
    config = _import_config(gpt2_dir)
    config.model.preset = "llama3-tiny"
    _resolve_error(config, r"config.json has architectures \['GPT2LMHeadModel'\] \(the gpt family\) but "
                           r"model.preset='llama3-tiny' is a llama model")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    safetensors_io.write(tmp_path / "model.safetensors", {"w": np.zeros(4, np.float32)})
    every = [f"{a} ({f.name})" for f in models.FAMILIES.values() if f.hf for a in f.hf.architectures]
    assert "GPT2LMHeadModel (gpt)" in every and "Gemma3ForCausalLM (gemma3)" in every
    with pytest.raises(RestoreFromError, match=r"^checkpoint.restore_from='hf:.*': config.json has architectures "
                                               r"\['BertForMaskedLM'\], which no model family reads; supported: "
                                               + re.escape(", ".join(every)) + "$"):
        hf_import.check_model(f"hf:{tmp_path}", config_lib.resolve(_import_config(tmp_path), 1).model)
    rotary = tiny_config()
    rotary.model.n_layers = 2
    with pytest.raises(RestoreFromError, match="but the run's model is llama"):
        llama = tiny_config()
        llama.model.update(preset="llama3-tiny")
        hf_import.check_model(f"hf:{gpt2_dir}", config_lib.resolve(llama, 1).model)
    with pytest.raises(export_hf.ExportError, match=r"model.positions='rotary', model.bias=False"):
        export_hf._check_exportable(tmp_path, config_lib.resolve(rotary, 1).model, False)


def test_gpt2model_names_and_buffers_import(gpt2_dir, tmp_path):
    """The hub's `gpt2` files name tensors without `transformer.` and may carry the causal-mask buffers."""
    theirs = {k: np.array(v) for k, v in safetensors_io.open_tensors(gpt2_dir / "model.safetensors").items()}
    hub = {k.removeprefix("transformer."): v for k, v in theirs.items()}
    hub["h.0.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), np.float32))
    (tmp_path / "config.json").write_text((gpt2_dir / "config.json").read_text())
    safetensors_io.write(tmp_path / "model.safetensors", hub)
    cfg = config_lib.resolve(_import_config(tmp_path), 1).model
    tensors = hf_import.check_model(f"hf:{tmp_path}", cfg)
    wqkv = models.family_of(cfg).hf.layer_from_hf(tensors.__getitem__, "wqkv", 1, cfg)
    np.testing.assert_array_equal(wqkv.reshape(32, -1), theirs["transformer.h.1.attn.c_attn.weight"])


def test_the_gpt2_preset_is_gpt2_small():
    """The preset against GPT-2 small's config.json and its 124,439,808 parameters (plus the 47 padded rows)."""
    cfg = models.from_dict({"preset": "gpt2"})
    hub = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024,
           "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None, "activation_function": "gelu_new",
           "layer_norm_epsilon": 1e-5}
    assert {k: getattr(cfg, k) for k in models.family_of(cfg).hf.fields_from_hf(hub)} == \
        models.family_of(cfg).hf.fields_from_hf(hub)
    assert models.param_count(cfg) == 124_439_808 + (50304 - 50257) * 768
