"""Families beyond Llama-3 and GPT-2 to and from Hugging Face, judged by transformers on tiny random models made
with its own config classes (float32): Qwen3 (the Llama family with qk_norm and its own head_dim), Mixtral and
Qwen3-MoE (a mixture in every block, their routers' normalizations) import with transformers' logits, on a
tensor=2 or expert=2 layout, and our params exported load in transformers with our logits."""

import jax
import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the `hf` extra (transformers, torch) is not installed")
torch = pytest.importorskip("torch", reason="the `hf` extra (transformers, torch) is not installed")

import models  # noqa: E402
from checkpoint import safetensors_io  # noqa: E402
from tests import helpers  # noqa: E402
from tests.helpers import tiny_config  # noqa: E402
from tests.hf_models import MIXTURES, QWEN3_OURS, TOKENS, hf_logits, hf_model, save_mixture, save_qwen3  # noqa: E402
from train.hf import export as hf_export  # noqa: E402
from train.hf import restore as hf_import  # noqa: E402
from train.trainer import Trainer  # noqa: E402


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return save_qwen3(tmp_path_factory.mktemp("qwen3") / "hf")


def test_qwen3_imports_on_tensor2_with_transformers_logits(qwen3_dir):
    config = tiny_config(tensor=2)
    config.model.update(**QWEN3_OURS, tie_embeddings=False)
    trainer = Trainer.build(config, num_devices=2)
    params = hf_import.load_params(f"hf:{qwen3_dir}", trainer)
    ours = jax.jit(lambda p, t: models.forward(p, t, trainer.plan.model))(params, TOKENS)
    np.testing.assert_allclose(np.asarray(ours), hf_logits(qwen3_dir), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def qwen3_exported(tmp_path_factory):
    """qwen3-tiny (2 layers, tied) at its seed-0 init, q/k norm scales perturbed, exported: (cfg, params, dir)."""
    cfg = models.from_dict(dict(QWEN3_OURS, seq_len=64))
    params = jax.tree.map(np.asarray, models.init_params(cfg, 0))
    rng = np.random.default_rng(1)
    for key in ("q_norm", "k_norm"):
        params["layers"][key] = rng.uniform(0.5, 1.5, params["layers"][key].shape).astype(np.float32)
    out = tmp_path_factory.mktemp("export") / "out"
    hf_export.write(out, cfg, params, "float32", None)
    return cfg, params, out


def test_qwen3_export_loads_in_transformers_with_our_logits(qwen3_exported):
    cfg, params, out = qwen3_exported
    assert type(hf_model(out)).__name__ == "Qwen3ForCausalLM"
    np.testing.assert_allclose(np.asarray(models.forward(params, TOKENS, cfg)), hf_logits(out), atol=1e-4, rtol=0)


def test_qwen3_kv_cache_decoding_gives_transformers_logits(qwen3_exported):
    """The serving engine's path (a prompt chunk, then one token at a time over the paged cache) applies the q/k
    norms too: each step's top log-probabilities are transformers' at that position of the prompt and the tokens
    drawn."""
    cfg, params, out = qwen3_exported
    prompt = TOKENS[:1, :8]
    new, logprobs = helpers.engine_greedy(cfg, params, prompt[0], 12)
    full = np.concatenate([prompt, np.asarray([new[:11]])], axis=1)
    with torch.no_grad():
        theirs = torch.log_softmax(hf_model(out)(torch.tensor(full)).logits, -1).numpy()[0, 7:]
    for row, step in zip(logprobs, theirs):
        ids = sorted(row)
        np.testing.assert_allclose([row[i] for i in ids], step[ids], atol=1e-4, rtol=0)
    assert new == [int(np.argmax(step)) for step in theirs]


@pytest.fixture(scope="module", params=sorted(MIXTURES))
def mixture_dir(request, tmp_path_factory):
    """(kind, the path of save_mixture's model)."""
    return request.param, save_mixture(request.param, tmp_path_factory.mktemp(request.param) / "hf")


def test_mixture_imports_with_transformers_logits_and_exports_the_same_tensors(mixture_dir, tmp_path):
    kind, path = mixture_dir
    config = tiny_config(expert=2) if kind == "mixtral" else tiny_config(tensor=2)
    config.model.update(**MIXTURES[kind][1], seq_len=24, tie_embeddings=False)
    config.checkpoint.restore_from = f"hf:{path}"
    trainer = Trainer.build(config, num_devices=2)
    cfg = trainer.plan.model
    assert (cfg.capacity_factor, cfg.router_z_loss_weight, cfg.load_balance_weight) == (0.0, 0.0, 0.001)
    assert cfg.router == ("topk_softmax" if kind == "mixtral" else "softmax")
    params = hf_import.load_params(f"hf:{path}", trainer)
    ours = jax.jit(lambda p, t: models.forward(p, t, cfg))(params, TOKENS)
    np.testing.assert_allclose(np.asarray(ours), hf_logits(path), atol=1e-4, rtol=0)
    hf_export.write(tmp_path / "out", cfg, jax.tree.map(np.asarray, jax.device_get(params)), "float32", None)
    theirs = safetensors_io.open_tensors(path / "model.safetensors")
    back = safetensors_io.open_tensors(tmp_path / "out" / "model.safetensors")
    assert sorted(back) == sorted(theirs)
    for name in theirs:
        np.testing.assert_array_equal(back[name], theirs[name], err_msg=name)
    np.testing.assert_allclose(hf_logits(tmp_path / "out"), hf_logits(path), atol=1e-5, rtol=0)  # config.json


@pytest.mark.parametrize("fields,fragment", [
    (dict(preset="qwen3-tiny", head_dim=-4), r"^model.head_dim=-4: each head's width, an integer >= 1"),
    (dict(preset="qwen3-tiny", head_dim=15), r"^the head dimension 15 \(model.head_dim"),
    (dict(preset="qwen3-tiny", qk_norm="yes"), r"^model.qk_norm='yes': use True or False$"),
    (dict(preset="mixtral-tiny", router="top2"), r"^model.router='top2': use one of auto, topk_softmax, softmax$"),
    (dict(preset="qwen3-moe-tiny", lora_rank=4, lora_targets="q,mlp"),
     r"^model.lora_targets='q,mlp' with model.n_experts=4: a mixture's adapters are on attention only; drop mlp"),
], ids=["head_dim", "odd_head_dim", "qk_norm", "router", "lora_mlp_on_experts"])
def test_bad_new_settings_are_one_line(fields, fragment):
    with pytest.raises(models.ModelConfigError, match=fragment):
        models.from_dict(fields)


def test_mixtures_without_a_hugging_face_form_say_why():
    unsupported = models.FAMILIES["llama"].hf.unsupported
    assert "model.moe_every=2" in unsupported(models.from_dict(dict(preset="mixtral-tiny", moe_every=2)))
    assert "model.router=topk_softmax" in unsupported(models.from_dict(dict(preset="mixtral-tiny", router="softmax")))
    assert unsupported(models.from_dict(dict(preset="qwen3-moe-tiny"))) is None
