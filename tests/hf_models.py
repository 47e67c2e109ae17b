"""The transformers side of the Hugging Face tests: tiny random models of each family made with transformers' own
config classes and saved (the oracle a test imports from or exports against), the ids they are run on, and their
logits. Needs the `hf` extra: only test modules that skip without it import this."""
import functools
import json

import jax
import numpy as np
import torch
import transformers

from tests.helpers import run_steps, tiny_config
from train.hf import export as hf_export
from train.sample import command as sample_lib
from train.trainer import Trainer

TOKENS = np.random.default_rng(0).integers(0, 256, (2, 24))
# A Llama 3.1 rope scaling and an untied head; LLAMA_OURS is the same model as our config (rope_scaling "8,1,4,8").
LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8}, rope_theta=10000.0)
LLAMA_OURS = dict(preset="llama3-tiny", d_model=64, d_mlp=96, n_layers=2, n_heads=4, n_kv_heads=2, rope_theta=10000.0,
                  rope_scaling="8,1,4,8", tie_embeddings=False, seq_len=24)
# head_dim 32 apart from hidden/heads = 16, so a layout that assumed d_model/n_heads would not even load.
QWEN3 = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=64)
QWEN3_OURS = dict(preset="qwen3-tiny", d_model=64, d_mlp=96, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                  seq_len=24)
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


@functools.lru_cache(maxsize=None)
def hf_model(path):
    """transformers' model saved at `path`, in float32, loaded once per path."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def hf_logits(path, tokens=TOKENS) -> np.ndarray:
    with torch.no_grad():
        return hf_model(path)(torch.tensor(tokens)).logits.numpy()


def save_llama(path):
    """A random tiny LlamaForCausalLM (LLAMA) saved at `path`."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(path)
    return path


def llama_import_config(**mesh):
    """Our config of save_llama's model on `mesh`."""
    config = tiny_config(**mesh)
    config.model.update(**LLAMA_OURS)
    return config


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


def trained_export(out, config):
    """`config` trained 2 steps on one device and exported to `out`: (model config, host params, out)."""
    trainer = Trainer.build(config, num_devices=1)
    _, state = run_steps(trainer, 2)
    params = jax.tree.map(np.asarray, jax.device_get(state["params"]))
    hf_export.write(out, trainer.plan.model, params, "float32", None)
    return trainer.plan.model, params, out


def greedy_as_train_sample(run, out, prompt: list[int], class_name: str, new: int = 16) -> list[int]:
    """train.sample's greedy `new` tokens after `prompt` from the run at `run`, asserted equal with prompt-lookup
    speculation (train.sample takes serve.*: guesses verified on the engine's pages, rejected ones' given back) and
    to transformers' generate on the export at `out`, loaded as a `class_name`: the tokens."""
    request = sample_lib.Request(prompt_tokens=",".join(map(str, prompt)), max_new=new, as_json=True)
    ours = json.loads(sample_lib.sample(run, None, request, None))["tokens"]
    guessing = {"speculative": "ngram", "num_speculative_tokens": 3}
    assert json.loads(sample_lib.sample(run, None, request, None, guessing))["tokens"] == ours
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == class_name
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    assert ours == theirs.numpy()[0, len(prompt):].tolist()
    return ours
