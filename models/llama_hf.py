"""The Llama family's Hugging Face adapter (models/hf.py): our parameters <-> the tensors and config.json of
transformers' LlamaForCausalLM (Qwen3ForCausalLM with `qk_norm`: the same names plus q_norm / k_norm), in numpy:
names, the attention and MLP tensors of models/gqa_hf.py, and config.json. A mixture in every block is
MixtralForCausalLM (Qwen3MoeForCausalLM with `qk_norm`): its experts and router in models/llama_moe_hf.py."""
from __future__ import annotations

from typing import Any

import numpy as np

from models import gqa_hf
from models import llama_moe_hf as moe_hf
from models.config import ModelConfigError
from models.hf import HFAdapter, Read
from models.llama_config import LlamaConfig

NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "q_norm": "self_attn.q_norm",
         "k_norm": "self_attn.k_norm"}  # our per-layer vectors -> their HF tensors


def hf_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a checkpoint of `cfg` holds, with its shape."""
    D, K = cfg.d_model, cfg.head_dim
    out = gqa_hf.top_shapes(cfg, cfg.tie_embeddings)
    for i in range(cfg.n_layers):
        out.update({gqa_hf.name(i, "input_layernorm"): (D,), gqa_hf.name(i, "post_attention_layernorm"): (D,),
                    **gqa_hf.attention_shapes(cfg, i)})
        out.update(moe_hf.shapes(cfg, i) if cfg.n_experts else gqa_hf.mlp_shapes(cfg, i))
        if cfg.qk_norm:
            out.update({gqa_hf.name(i, "self_attn.q_norm"): (K,), gqa_hf.name(i, "self_attn.k_norm"): (K,)})
    return out


def _layer_to_hf(p: dict[str, np.ndarray], i: int, cfg: LlamaConfig) -> dict[str, np.ndarray]:
    norms = {gqa_hf.name(i, NORMS[n]): p[n] for n in NORMS if n in p}
    mlp = moe_hf.to_hf(p, i, cfg) if cfg.n_experts else gqa_hf.mlp_to_hf(p, i)
    return {**norms, **mlp, **gqa_hf.attention_to_hf(p, i, cfg)}


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested layer stack as {path joined by '/': leaf}, a mixture block's own leaves ("moe/wqkv") by their
    short names ("wqkv"), as layer_from_hf names them."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}".removeprefix("moe/"): v})
    return out


def to_hf(params: dict[str, Any], cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Our params (numpy, layers in logical order) -> HF tensors, C-contiguous."""
    out = gqa_hf.top_to_hf(params, cfg.tie_embeddings)
    for i in range(cfg.n_layers):
        out.update(_layer_to_hf({k: v[i] for k, v in _flat(params["layers"]).items()}, i, cfg))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def layer_from_hf(read: Read, key: str, i: int, cfg: LlamaConfig, index: tuple | None = None) -> np.ndarray:
    """Our per-layer leaf `key` of layer i (its block `index`, a tuple of slices, or all of it) from HF tensors,
    reading only the rows that block needs: the device's slice of a sharded import."""
    key = key.removeprefix("moe/")  # a mixture block's attention and norms: models/moe.Groups
    if key in ("router", "experts/w_in", "experts/w_down"):
        return moe_hf.from_hf(read, key, i, cfg, index)
    return gqa_hf.layer_from_hf(read, key, i, cfg, index, NORMS)


def hf_config(cfg: LlamaConfig, dtype: str, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """config.json of LlamaForCausalLM (Qwen3ForCausalLM with `qk_norm`), in both spellings transformers 4.x and
    5.x read."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = None
    if cfg.rope_scaling is not None:
        factor, low, high, context = cfg.rope_scaling
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                   "original_max_position_embeddings": context}
        rope.update(scaling)
    arch, model_type = ("Qwen3ForCausalLM", "qwen3") if cfg.qk_norm else ("LlamaForCausalLM", "llama")
    qwen3 = {"use_sliding_window": False, "sliding_window": None} if cfg.qk_norm else {"mlp_bias": False}
    mixture = moe_hf.hf_config(cfg) if cfg.n_experts else {}
    if cfg.n_experts and not cfg.qk_norm:
        qwen3 = {"sliding_window": None}
    return {**qwen3, "architectures": [arch], "model_type": model_type, **mixture, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "max_position_embeddings": cfg.seq_len if scaling is None else
            max(cfg.seq_len, int(scaling["original_max_position_embeddings"] * scaling["factor"])),
            "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
            "rope_parameters": rope, "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
            "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": dtype, "dtype": dtype}


def fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Our model fields from an HF config.json (rope_parameters or the older rope_theta/rope_scaling)."""
    if hf.get("model_type") not in ("llama", "qwen3", "mixtral", "qwen3_moe"):
        raise ModelConfigError(f"config.json model_type={hf.get('model_type')!r}: only llama, qwen3, mixtral and "
                               f"qwen3_moe import")
    if (hf.get("use_sliding_window") or hf.get("attention_bias") or hf.get("mlp_bias")
            or (hf["model_type"] == "mixtral" and hf.get("sliding_window"))):
        raise ModelConfigError("config.json: sliding-window attention and attention or MLP biases are not built "
                               "here; only models without them import")
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type") == "llama3" else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) not in ("llama3", "default", None):
        raise ModelConfigError(f"config.json rope scaling {scaling.get('rope_type')!r}: only llama3 imports")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    heads = hf["num_attention_heads"]
    mixture = moe_hf.fields_from_hf(hf) if hf["model_type"] in ("mixtral", "qwen3_moe") else dict(
        n_experts=0, d_mlp=hf["intermediate_size"])
    return dict(qk_norm=hf["model_type"] in ("qwen3", "qwen3_moe"),
                head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, **mixture,
                vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
                n_heads=heads, n_kv_heads=hf.get("num_key_value_heads") or heads,
                norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
                rope_scaling=None if scaling is None else tuple(float(scaling[k]) for k in (
                    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def unsupported(cfg: LlamaConfig) -> str | None:
    return moe_hf.unsupported(cfg) if cfg.n_experts else None


ADAPTER = HFAdapter(architectures=("LlamaForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM",
                                   "Qwen3MoeForCausalLM"), fields_from_hf=fields_from_hf,
                    hf_config=hf_config, hf_shapes=hf_shapes, to_hf=to_hf, layer_from_hf=layer_from_hf,
                    top_from_hf=gqa_hf.top_from_hf, unsupported=unsupported, ignored=("rotary_emb.inv_freq",))
