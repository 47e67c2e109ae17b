"""Families beyond Llama-3 and GPT-2 to and from Hugging Face, judged by transformers on tiny random models made
with its own config classes (float32): Qwen3 (the Llama family with qk_norm and its own head_dim), Mixtral and
Qwen3-MoE (a mixture in every block, their routers' normalizations) import with transformers' logits, on a
tensor=2 or expert=2 layout, and our params exported load in transformers with our logits."""
import functools

import jax
import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the `hf` extra (transformers, torch) is not installed")
torch = pytest.importorskip("torch", reason="the `hf` extra (transformers, torch) is not installed")

import models  # noqa: E402
from checkpoint import safetensors_io  # noqa: E402
from tests import helpers  # noqa: E402
from tests.helpers import tiny_config  # noqa: E402
from train.hf import export as hf_export  # noqa: E402
from train.hf import restore as hf_import  # noqa: E402
from train.trainer import Trainer  # noqa: E402

TOKENS = np.random.default_rng(0).integers(0, 256, (2, 24))
# head_dim 32 apart from hidden/heads = 16, so a layout that assumed d_model/n_heads would not even load.
QWEN3 = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=64)
OURS = dict(preset="qwen3-tiny", d_model=64, d_mlp=96, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, seq_len=24)


@functools.lru_cache(maxsize=None)
def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _hf_logits(path) -> np.ndarray:
    with torch.no_grad():
        return _hf_model(path)(torch.tensor(TOKENS)).logits.numpy()


def save_qwen3(path):
    """A random tiny Qwen3ForCausalLM (untied head), its q/k norm scales drawn away from ones, saved at `path`."""
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3, tie_word_embeddings=False))
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                w.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return save_qwen3(tmp_path_factory.mktemp("qwen3") / "hf")


def test_qwen3_imports_on_tensor2_with_transformers_logits(qwen3_dir):
    config = tiny_config(tensor=2)
    config.model.update(**OURS, tie_embeddings=False)
    trainer = Trainer.build(config, num_devices=2)
    params = hf_import.load_params(f"hf:{qwen3_dir}", trainer)
    ours = jax.jit(lambda p, t: models.forward(p, t, trainer.plan.model))(params, TOKENS)
    np.testing.assert_allclose(np.asarray(ours), _hf_logits(qwen3_dir), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def qwen3_exported(tmp_path_factory):
    """qwen3-tiny (2 layers, tied) at its seed-0 init, q/k norm scales perturbed, exported: (cfg, params, dir)."""
    cfg = models.from_dict(dict(OURS, seq_len=64))
    params = jax.tree.map(np.asarray, models.init_params(cfg, 0))
    rng = np.random.default_rng(1)
    for key in ("q_norm", "k_norm"):
        params["layers"][key] = rng.uniform(0.5, 1.5, params["layers"][key].shape).astype(np.float32)
    out = tmp_path_factory.mktemp("export") / "out"
    hf_export.write(out, cfg, params, "float32", None)
    return cfg, params, out


def test_qwen3_export_loads_in_transformers_with_our_logits(qwen3_exported):
    cfg, params, out = qwen3_exported
    assert type(_hf_model(out)).__name__ == "Qwen3ForCausalLM"
    np.testing.assert_allclose(np.asarray(models.forward(params, TOKENS, cfg)), _hf_logits(out), atol=1e-4, rtol=0)


def test_qwen3_kv_cache_decoding_gives_transformers_logits(qwen3_exported):
    """The serving engine's path (a prompt chunk, then one token at a time over the paged cache) applies the q/k
    norms too: each step's top log-probabilities are transformers' at that position of the prompt and the tokens
    drawn."""
    cfg, params, out = qwen3_exported
    prompt = TOKENS[:1, :8]
    new, logprobs = helpers.engine_greedy(cfg, params, prompt[0], 12)
    full = np.concatenate([prompt, np.asarray([new[:11]])], axis=1)
    with torch.no_grad():
        theirs = torch.log_softmax(_hf_model(out)(torch.tensor(full)).logits, -1).numpy()[0, 7:]
    for row, step in zip(logprobs, theirs):
        ids = sorted(row)
        np.testing.assert_allclose([row[i] for i in ids], step[ids], atol=1e-4, rtol=0)
    assert new == [int(np.argmax(step)) for step in theirs]


MIXTURES = {  # transformers' config class and ours (the preset and the import's shapes)
    "mixtral": (lambda: transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6,
        max_position_embeddings=64, tie_word_embeddings=False),
                dict(preset="mixtral-tiny", d_model=64, n_heads=4, n_kv_heads=2)),
    "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(  # norm_topk_prob false: the chosen experts' probabilities
        **dict(QWEN3, intermediate_size=128), moe_intermediate_size=96, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, tie_word_embeddings=False),
                  dict(preset="qwen3-moe-tiny", d_model=64, n_heads=4, n_kv_heads=2)),
}


def save_mixture(kind: str, path):
    """A random tiny MixtralForCausalLM or Qwen3MoeForCausalLM (untied), saved by transformers at `path`."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MIXTURES[kind][0]())
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith(("norm.weight", "gate.weight")):  # norms away from ones, routers decisive
                w.uniform_(0.5, 1.5) if "norm" in name else w.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path


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
    np.testing.assert_allclose(np.asarray(ours), _hf_logits(path), atol=1e-4, rtol=0)
    hf_export.write(tmp_path / "out", cfg, jax.tree.map(np.asarray, jax.device_get(params)), "float32", None)
    theirs = safetensors_io.open_tensors(path / "model.safetensors")
    back = safetensors_io.open_tensors(tmp_path / "out" / "model.safetensors")
    assert sorted(back) == sorted(theirs)
    for name in theirs:
        np.testing.assert_array_equal(back[name], theirs[name], err_msg=name)
    np.testing.assert_allclose(_hf_logits(tmp_path / "out"), _hf_logits(path), atol=1e-5, rtol=0)  # config.json


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
