"""The GPT family's Hugging Face adapter (models/hf.py): a GPT with GPT-2's options (models/gpt_config.py) <->
transformers' GPT2LMHeadModel, in numpy. Its Conv1D weights are stored [in, out] as ours are, and c_attn's
columns are q, k, v, each head by head, so wqkv [D, 3, H, K] is c_attn reshaped: no transposes. The vocabulary
is padded to a multiple of model.vocab_multiple on import (the gpt2 preset's 64: zero rows, their logits -inf) and
cut back on export (train/hf/export.py)."""
from __future__ import annotations

from typing import Any

import numpy as np

from models.config import ModelConfigError
from models.gpt_config import GPTConfig
from models.hf import HFAdapter, HFConfig, Read, slices

ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}  # theirs -> ours
# What GPT2LMHeadModel is, as our options; export needs them all (tie_embeddings may be either).
GPT2_OPTIONS = {"positions": "learned", "bias": True, "norm": "layernorm"}
TOP = {"embed": "transformer.wte.weight", "positions": "transformer.wpe.weight",
       "final_norm": "transformer.ln_f.weight", "final_norm_bias": "transformer.ln_f.bias"}
# Our per-layer leaf -> its tensor in block h.{i}.
LAYER = {"attn_norm": "ln_1.weight", "attn_norm_bias": "ln_1.bias", "wqkv": "attn.c_attn.weight",
         "wqkv_bias": "attn.c_attn.bias", "wo": "attn.c_proj.weight", "wo_bias": "attn.c_proj.bias",
         "mlp_norm": "ln_2.weight", "mlp_norm_bias": "ln_2.bias", "w_in": "mlp.c_fc.weight",
         "w_in_bias": "mlp.c_fc.bias", "w_out": "mlp.c_proj.weight", "w_out_bias": "mlp.c_proj.bias"}


def _layer(i: int, key: str) -> str:
    return f"transformer.h.{i}.{LAYER[key]}"


def _ours(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """One layer's leaves and their shapes here."""
    D, H, K, F = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_mlp
    return {"attn_norm": (D,), "attn_norm_bias": (D,), "wqkv": (D, 3, H, K), "wqkv_bias": (3, H, K),
            "wo": (H, K, D), "wo_bias": (D,), "mlp_norm": (D,), "mlp_norm_bias": (D,), "w_in": (D, F),
            "w_in_bias": (F,), "w_out": (F, D), "w_out_bias": (D,)}


def hf_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a GPT2LMHeadModel of `cfg`."""
    V, D = cfg.vocab_size, cfg.d_model
    out = {TOP["embed"]: (V, D), TOP["positions"]: (cfg.position_rows, D), TOP["final_norm"]: (D,),
           TOP["final_norm_bias"]: (D,)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (V, D)
    for i in range(cfg.n_layers):
        out.update({_layer(i, k): hf_shapes_of(k, shape) for k, shape in _ours(cfg).items()})
    return out


def to_hf(params: dict[str, Any], cfg: GPTConfig) -> dict[str, np.ndarray]:
    """Our params (numpy, layers in logical order, the vocabulary as exported) -> GPT2LMHeadModel's tensors."""
    out = {TOP[k]: params[k] for k in TOP}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = params["head"].T
    for i in range(cfg.n_layers):
        for key, shape in _ours(cfg).items():
            out[_layer(i, key)] = params["layers"][key][i].reshape(hf_shapes_of(key, shape))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def hf_shapes_of(key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of our leaf `key` of shape `shape`: c_attn [D, 3D], c_proj [D, D], c_attn's bias [3D]."""
    if key == "wqkv":
        return shape[0], int(np.prod(shape[1:]))
    if key == "wo":
        return int(np.prod(shape[:-1])), shape[-1]
    return (int(np.prod(shape)),) if key == "wqkv_bias" else shape


def layer_from_hf(read: Read, key: str, i: int, cfg: GPTConfig, index: tuple | None = None) -> np.ndarray:
    """Our per-layer leaf `key` of layer i (or its block `index`); one layer's tensor is read whole."""
    shape = _ours(cfg)[key]
    return np.asarray(read(_layer(i, key))).reshape(shape)[slices(index, len(shape))]


def _padded_rows(arr: np.ndarray, rows: int) -> np.ndarray:
    """`arr` [n, ...] with zero rows appended up to `rows` (the padded vocabulary)."""
    return np.concatenate([arr, np.zeros((rows - arr.shape[0], *arr.shape[1:]), arr.dtype)]) if rows > len(arr) else arr


def top_from_hf(read: Read, key: str, cfg: GPTConfig, index: tuple | None = None) -> np.ndarray:
    """A leaf outside the stack (or its block `index`); the embedding and an untied head padded to vocab_rows."""
    if key == "head":  # [D, V] from lm_head [V, D]
        return _padded_rows(np.asarray(read("lm_head.weight")), cfg.vocab_rows).T[slices(index, 2)]
    arr = np.asarray(read(TOP[key]))
    if key == "embed":
        arr = _padded_rows(arr, cfg.vocab_rows)
    return arr[slices(index, arr.ndim)]


def hf_config(cfg: GPTConfig, dtype: str, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """config.json of GPT2LMHeadModel."""
    activation = {"gelu_tanh": "gelu_new", "gelu": "gelu"}[cfg.activation]
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.position_rows, "n_ctx": cfg.position_rows, "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.d_mlp, "activation_function": activation,
            "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "resid_pdrop": 0.0,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "bos_token_id": bos_id,
            "eos_token_id": eos_id, "torch_dtype": dtype, "dtype": dtype}


def fields_from_hf(hf: HFConfig) -> dict[str, Any]:
    """Our GPT fields (shapes and GPT-2's options) from a GPT2LMHeadModel config.json."""
    if hf.get("model_type") != "gpt2":
        raise ModelConfigError(f"config.json model_type={hf.get('model_type')!r}: only 'gpt2' imports as GPT")
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ModelConfigError(f"config.json activation_function={act!r}: only {', '.join(ACTIVATIONS)} import")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
        raise ModelConfigError("config.json scales attention other than by 1/sqrt(head_dim); only that imports")
    D, V = int(hf["n_embd"]), int(hf["vocab_size"])
    inner = int(hf.get("n_inner") or 4 * D)
    if inner % D:
        raise ModelConfigError(f"config.json n_inner={inner}: only a multiple of n_embd={D} imports (model.mlp_ratio)")
    return dict(vocab_size=V, d_model=D,
                n_layers=int(hf["n_layer"]), n_heads=int(hf["n_head"]), mlp_ratio=inner // D,
                max_positions=int(hf["n_positions"]), norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
                tie_embeddings=bool(hf.get("tie_word_embeddings", True)), activation=ACTIVATIONS[act], **GPT2_OPTIONS)


def unsupported(cfg: GPTConfig) -> str | None:
    """A GPT without all of GPT-2's options (or with experts) has no GPT2LMHeadModel form."""
    differ = [f"model.{k}={getattr(cfg, k)!r}" for k, v in GPT2_OPTIONS.items() if getattr(cfg, k) != v]
    if differ:
        return (f"{', '.join(differ)}: GPT2LMHeadModel has learned positions, biases and LayerNorm; only a GPT run "
                f"with model.positions=learned, model.bias=True and model.norm=layernorm (the gpt2 preset) exports")
    if cfg.n_experts:
        return f"a mixture of experts (model.n_experts={cfg.n_experts}) has no GPT2LMHeadModel form"
    return None


def rename(name: str) -> str:
    """GPT2Model files (the hub's `gpt2`) name their tensors without the `transformer.` prefix."""
    return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name


ADAPTER = HFAdapter(architectures=("GPT2LMHeadModel",), fields_from_hf=fields_from_hf, hf_config=hf_config,
                    hf_shapes=hf_shapes, to_hf=to_hf, layer_from_hf=layer_from_hf, top_from_hf=top_from_hf,
                    unsupported=unsupported, rename=rename,
                    ignored=(".attn.bias", ".attn.masked_bias", "lm_head.weight"))  # causal-mask buffers; a tied head
