"""The Llama family's Hugging Face adapter (models/hf.py): our parameters <-> the tensors and config.json of
transformers' LlamaForCausalLM (Qwen3ForCausalLM with `qk_norm`: the same names plus q_norm / k_norm), in numpy:
names, transposes ([out, in] there, [in, out] here) and the fused per-kv-group layout of wqkv and w_in
(models/llama.py). Rotary embeddings are half-split in both, so no rows are permuted. A mixture in every block is
MixtralForCausalLM (Qwen3MoeForCausalLM with `qk_norm`): its experts and router in models/llama_moe_hf.py."""
from __future__ import annotations

from typing import Any

import numpy as np

from models import llama_moe_hf as moe_hf
from models.config import ModelConfigError
from models.hf import HFAdapter, Read, slices, span
from models.llama_config import LlamaConfig


def _layer(i: int, name: str) -> str:
    return f"model.layers.{i}.{name}.weight"


def hf_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a checkpoint of `cfg` holds, with its shape."""
    D, H, G, K, F, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_mlp, cfg.vocab_size
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (V, D)
    for i in range(cfg.n_layers):
        out.update({_layer(i, "input_layernorm"): (D,), _layer(i, "post_attention_layernorm"): (D,),
                    _layer(i, "self_attn.q_proj"): (H * K, D), _layer(i, "self_attn.k_proj"): (G * K, D),
                    _layer(i, "self_attn.v_proj"): (G * K, D), _layer(i, "self_attn.o_proj"): (D, H * K)})
        out.update(moe_hf.shapes(cfg, i) if cfg.n_experts else {
            _layer(i, "mlp.gate_proj"): (F, D), _layer(i, "mlp.up_proj"): (F, D), _layer(i, "mlp.down_proj"): (D, F)})
        if cfg.qk_norm:
            out.update({_layer(i, "self_attn.q_norm"): (K,), _layer(i, "self_attn.k_norm"): (K,)})
    return out


def _layer_to_hf(p: dict[str, np.ndarray], i: int, cfg: LlamaConfig) -> dict[str, np.ndarray]:
    D, G, K = cfg.d_model, cfg.n_kv_heads, cfg.head_dim
    R = cfg.n_heads // G
    wqkv = p["wqkv"]  # [D, G, R+2, K]
    norms = {_layer(i, f"self_attn.{n}"): p[n] for n in ("q_norm", "k_norm") if n in p}
    mlp = moe_hf.to_hf(p, i, cfg) if cfg.n_experts else {
        _layer(i, "mlp.gate_proj"): p["w_in"][:, 0].T, _layer(i, "mlp.up_proj"): p["w_in"][:, 1].T,
        _layer(i, "mlp.down_proj"): p["w_down"].T}
    return {**norms, **mlp, _layer(i, "input_layernorm"): p["attn_norm"],
            _layer(i, "post_attention_layernorm"): p["mlp_norm"],
            _layer(i, "self_attn.q_proj"): wqkv[:, :, :R].reshape(D, -1).T,
            _layer(i, "self_attn.k_proj"): wqkv[:, :, R].reshape(D, G * K).T,
            _layer(i, "self_attn.v_proj"): wqkv[:, :, R + 1].reshape(D, G * K).T,
            _layer(i, "self_attn.o_proj"): p["wo"].reshape(-1, D).T}


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested layer stack as {path joined by '/': leaf}, a mixture block's own leaves ("moe/wqkv") by their
    short names ("wqkv"), as layer_from_hf names them."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}".removeprefix("moe/"): v})
    return out


def to_hf(params: dict[str, Any], cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Our params (numpy, layers in logical order) -> HF tensors, C-contiguous."""
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = params["head"].T
    for i in range(cfg.n_layers):
        out.update(_layer_to_hf({k: v[i] for k, v in _flat(params["layers"]).items()}, i, cfg))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def layer_from_hf(read: Read, key: str, i: int, cfg: LlamaConfig, index: tuple | None = None) -> np.ndarray:
    """Our per-layer leaf `key` of layer i (its block `index`, a tuple of slices, or all of it) from HF tensors,
    reading only the rows that block needs: the device's slice of a sharded import."""
    H, G, K, R = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    key = key.removeprefix("moe/")  # a mixture block's attention and norms: models/moe.Groups
    if key in ("router", "experts/w_in", "experts/w_down"):
        return moe_hf.from_hf(read, key, i, cfg, index)
    if key in ("attn_norm", "mlp_norm"):
        (s_d,) = slices(index, 1)
        return np.asarray(read(_layer(i, "input_layernorm" if key == "attn_norm" else "post_attention_layernorm"))[s_d])
    if key in ("q_norm", "k_norm"):  # [K]
        (s_k,) = slices(index, 1)
        return np.asarray(read(_layer(i, f"self_attn.{key}"))[s_k])
    if key == "wqkv":  # [D, G, R+2, K]: q rows of groups g0..g1 are contiguous in q_proj, k/v rows in k/v_proj
        s_d, s_g, s_r, s_k = slices(index, 4)
        g0, g1 = span(s_g, G)
        q = np.asarray(read(_layer(i, "self_attn.q_proj"))[g0 * R * K:g1 * R * K, s_d]).T.reshape(-1, g1 - g0, R, K)
        k, v = (np.asarray(read(_layer(i, f"self_attn.{n}_proj"))[g0 * K:g1 * K, s_d]).T.reshape(-1, g1 - g0, 1, K)
                for n in "kv")
        return np.concatenate([q, k, v], axis=2)[:, :, s_r, s_k]
    if key == "wo":  # [H, K, D] from o_proj [D, H*K]
        s_h, s_k, s_d = slices(index, 3)
        h0, h1 = span(s_h, H)
        o = np.asarray(read(_layer(i, "self_attn.o_proj"))[s_d, h0 * K:h1 * K])
        return o.T.reshape(h1 - h0, K, -1)[:, s_k]
    if key == "w_in":  # [D, 2, F] from gate_proj / up_proj [F, D]
        s_d, s_t, s_f = slices(index, 3)
        return np.stack([np.asarray(read(_layer(i, f"mlp.{n}_proj"))[s_f, s_d]).T for n in ("gate", "up")],
                        axis=1)[:, s_t]
    if key == "w_down":  # [F, D] from down_proj [D, F]
        s_f, s_d = slices(index, 2)
        return np.asarray(read(_layer(i, "mlp.down_proj"))[s_d, s_f]).T
    raise KeyError(key)


def top_from_hf(read: Read, key: str, cfg: LlamaConfig | None = None, index: tuple | None = None) -> np.ndarray:
    """A top-level leaf (or its block `index`) from HF tensors."""
    if key == "head":  # [D, V] from lm_head [V, D]
        s_d, s_v = slices(index, 2)
        return np.asarray(read("lm_head.weight")[s_v, s_d]).T
    name = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight"}[key]
    return np.asarray(read(name)[slices(index, 1 if key == "final_norm" else 2)])


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
                    top_from_hf=top_from_hf, unsupported=unsupported, ignored=("rotary_emb.inv_freq",))
