"""The Gemma 3 family's Hugging Face adapter (models/hf.py): our parameters <-> transformers' Gemma3ForCausalLM
(model_type gemma3_text), and the text tower of a Gemma3ForConditionalGeneration directory (model_type gemma3: the
same tensors under language_model, config.json's text fields in `text_config`; its vision tower and projector are
left out). The attention and MLP tensors are models/gqa_hf.py's; the four norms per block and the q/k norms are
zero-centred vectors in both (x (1 + w))."""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from models import gqa_hf
from models.config import ModelConfigError
from models.gemma3_config import Gemma3Config
from models.hf import HFAdapter

NORMS = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
         "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm",
         "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}
# A multimodal checkpoint's tensors outside the text model (transformers 5 names them under model., 4.x without).
LEFT_OUT = {"vision_tower.": "the vision tower", "multi_modal_projector.": "the multimodal projector"}


def hf_shapes(cfg: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor name a checkpoint of `cfg` holds, with its shape."""
    out = gqa_hf.top_shapes(cfg, cfg.tie_embeddings)
    for i in range(cfg.n_layers):
        out.update({gqa_hf.name(i, NORMS[n]): (cfg.head_dim if n in ("q_norm", "k_norm") else cfg.d_model,)
                    for n in NORMS})
        out.update({**gqa_hf.attention_shapes(cfg, i), **gqa_hf.mlp_shapes(cfg, i)})
    return out


def to_hf(params: dict[str, Any], cfg: Gemma3Config) -> dict[str, np.ndarray]:
    """Our params (numpy, layers in logical order) -> HF tensors, C-contiguous."""
    out = gqa_hf.top_to_hf(params, cfg.tie_embeddings)
    for i in range(cfg.n_layers):
        p = {k: v[i] for k, v in params["layers"].items()}
        out.update({gqa_hf.name(i, NORMS[n]): p[n] for n in NORMS})
        out.update({**gqa_hf.attention_to_hf(p, i, cfg), **gqa_hf.mlp_to_hf(p, i)})
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def rename(name: str) -> str:
    """A multimodal checkpoint's text tensors as a Gemma3ForCausalLM names them (language_model.model.* of
    transformers 4.x, model.language_model.* of 5.x), its other tensors without the `model.` prefix."""
    for theirs, ours in (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head.")):
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    if name.startswith(tuple("model." + prefix for prefix in LEFT_OUT)):
        return name[len("model."):]
    return name


def _rope(hf: dict[str, Any]) -> tuple[float, float, float]:
    """(global theta, local theta, global linear factor) from rope_parameters (transformers 5) or rope_theta,
    rope_local_base_freq and rope_scaling (4.x)."""
    params = hf.get("rope_parameters") or {}
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    scaling = hf.get("rope_scaling") or {}
    kinds = {full.get("rope_type", "default"), local.get("rope_type", "default"),
             scaling.get("rope_type", scaling.get("type", "linear"))}
    if kinds - {"default", "linear"}:
        raise ModelConfigError(f"rope types {sorted(kinds)}: only default and linear rotary scaling import")
    if local.get("rope_type", "default") != "default":
        raise ModelConfigError("a scaled rotary embedding on the sliding layers does not import")
    factor = float(full.get("factor", scaling.get("factor", 1.0))) if "linear" in kinds else 1.0
    return (float(full.get("rope_theta", hf.get("rope_theta", 1_000_000.0))),
            float(local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0))), factor)


def _layer_types(hf: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """global_every when config.json's layer_types (or sliding_window_pattern) repeats (k-1) sliding layers and a
    global one, else the pattern spelled out in layer_types."""
    every = int(hf.get("sliding_window_pattern") or 6)
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                      for i in range(n_layers)]
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown or len(types) != n_layers:
        raise ModelConfigError(f"layer_types {sorted(unknown) or len(types)}: only full_attention and "
                               f"sliding_attention, one per layer, import")
    ours = ["global" if t == "full_attention" else "sliding" for t in types]
    for k in range(1, n_layers + 1):
        if ours == ["global" if (i + 1) % k == 0 else "sliding" for i in range(n_layers)]:
            return dict(global_every=k, layer_types="")
    return dict(global_every=6, layer_types=",".join(ours))


def fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Our model fields from a gemma3_text config.json, or the text_config of a gemma3 one."""
    text = hf.get("text_config") if hf.get("model_type") == "gemma3" else hf
    if not isinstance(text, dict) or text.get("model_type", "gemma3_text") != "gemma3_text":
        raise ModelConfigError(f"config.json model_type={hf.get('model_type')!r}: only gemma3_text, or gemma3 with a "
                               f"text_config, imports as Gemma 3")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if text.get(key) is not None:
            raise ModelConfigError(f"config.json {key}={text[key]}: logit soft-capping (Gemma 2) is not built here")
    if text.get("use_bidirectional_attention") or text.get("attention_bias"):
        raise ModelConfigError("config.json: bidirectional attention and attention biases are not built here")
    act = text.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise ModelConfigError(f"config.json hidden_activation={act!r}: only {', '.join(ACTIVATIONS)} import")
    heads, n_layers = int(text["num_attention_heads"]), int(text["num_hidden_layers"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    theta, local, factor = _rope(text)
    return dict(vocab_size=int(text["vocab_size"]), d_model=int(text["hidden_size"]), n_layers=n_layers,
                n_heads=heads, n_kv_heads=int(text.get("num_key_value_heads") or heads), head_dim=head_dim,
                d_mlp=int(text["intermediate_size"]), norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                sliding_window=int(text.get("sliding_window") or 4096), **_layer_types(text, n_layers),
                rope_theta=theta, rope_local_theta=local, rope_linear_factor=factor,
                query_pre_attn_scalar=float(text.get("query_pre_attn_scalar") or head_dim),
                activation=ACTIVATIONS[act],
                tie_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True))))


def hf_config(cfg: Gemma3Config, dtype: str, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """config.json of Gemma3ForCausalLM, the rotary settings in both spellings transformers 4.x and 5.x read."""
    linear = {"rope_type": "linear", "factor": cfg.rope_linear_factor} if cfg.rope_linear_factor != 1.0 else None
    types = ["full_attention" if cfg.global_layer(i) else "sliding_attention" for i in range(cfg.n_layers)]
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "hidden_activation": "gelu_pytorch_tanh" if cfg.activation == "gelu_tanh" else "gelu",
            "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
            "sliding_window": cfg.sliding_window, "layer_types": types,
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                                   **(linear or {})},
                                "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}},
            "rope_theta": cfg.rope_theta, "rope_local_base_freq": cfg.rope_local_theta, "rope_scaling": linear,
            "attention_bias": False, "attn_logit_softcapping": None, "final_logit_softcapping": None,
            "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": bos_id, "eos_token_id": eos_id,
            "torch_dtype": dtype, "dtype": dtype}


ADAPTER = HFAdapter(architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
                    fields_from_hf=fields_from_hf, hf_config=hf_config, hf_shapes=hf_shapes, to_hf=to_hf,
                    layer_from_hf=functools.partial(gqa_hf.layer_from_hf, norms=NORMS), top_from_hf=gqa_hf.top_from_hf,
                    rename=rename,
                    ignored=("lm_head.weight",), left_out=LEFT_OUT)  # a tied head (in `wanted` when untied)
