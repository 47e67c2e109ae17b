"""Hugging Face tensors of the layers that models/gqa.py and models/glu.py declare, shared by the adapters of the
families built from them (Llama, Qwen3, Mixtral, Gemma 3): transformers stores q_proj [H*K, D], k_proj and v_proj
[G*K, D], o_proj [D, H*K] and the MLP's gate_proj and up_proj [F, D], down_proj [D, F], each [out, in]; ours are the
fused wqkv [D, G, R+2, K], wo [H, K, D], w_in [D, 2, F], w_down [F, D], [in, out]. Rotary embeddings are half-split
in both, so no rows are permuted. numpy only."""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import numpy as np

from models.hf import Read, slices, span
from models.protocols import TransformerConfig


def name(i: int, tensor: str) -> str:
    """The HF name of layer i's tensor `tensor` (e.g. "self_attn.q_proj")."""
    return f"model.layers.{i}.{tensor}.weight"


def attention_shapes(cfg: TransformerConfig, i: int) -> dict[str, tuple[int, ...]]:
    D, H, G, K = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    return {name(i, "self_attn.q_proj"): (H * K, D), name(i, "self_attn.k_proj"): (G * K, D),
            name(i, "self_attn.v_proj"): (G * K, D), name(i, "self_attn.o_proj"): (D, H * K)}


def mlp_shapes(cfg: TransformerConfig, i: int) -> dict[str, tuple[int, ...]]:
    D, F = cfg.d_model, cfg.d_mlp
    return {name(i, "mlp.gate_proj"): (F, D), name(i, "mlp.up_proj"): (F, D), name(i, "mlp.down_proj"): (D, F)}


def attention_to_hf(p: dict[str, np.ndarray], i: int, cfg: TransformerConfig) -> dict[str, np.ndarray]:
    """Layer i's q/k/v/o projections as HF tensors (`p`: one layer's leaves)."""
    D, G, K = cfg.d_model, cfg.n_kv_heads, cfg.head_dim
    R = cfg.n_heads // G
    wqkv = p["wqkv"]  # [D, G, R+2, K]
    return {name(i, "self_attn.q_proj"): wqkv[:, :, :R].reshape(D, -1).T,
            name(i, "self_attn.k_proj"): wqkv[:, :, R].reshape(D, G * K).T,
            name(i, "self_attn.v_proj"): wqkv[:, :, R + 1].reshape(D, G * K).T,
            name(i, "self_attn.o_proj"): p["wo"].reshape(-1, D).T}


def mlp_to_hf(p: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """Layer i's gated MLP as HF tensors."""
    return {name(i, "mlp.gate_proj"): p["w_in"][:, 0].T, name(i, "mlp.up_proj"): p["w_in"][:, 1].T,
            name(i, "mlp.down_proj"): p["w_down"].T}


def from_hf(read: Read, key: str, i: int, cfg: TransformerConfig, index: tuple | None = None) -> np.ndarray | None:
    """Our leaf `key` (wqkv, wo, w_in or w_down) of layer i, or its block `index` (a tuple of slices), reading only
    the rows that block needs (a device's slice of a sharded import); None for another key."""
    H, G, K, R = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    if key == "wqkv":  # [D, G, R+2, K]: q rows of groups g0..g1 are contiguous in q_proj, k/v rows in k/v_proj
        s_d, s_g, s_r, s_k = slices(index, 4)
        g0, g1 = span(s_g, G)
        q = np.asarray(read(name(i, "self_attn.q_proj"))[g0 * R * K:g1 * R * K, s_d]).T.reshape(-1, g1 - g0, R, K)
        k, v = (np.asarray(read(name(i, f"self_attn.{n}_proj"))[g0 * K:g1 * K, s_d]).T.reshape(-1, g1 - g0, 1, K)
                for n in "kv")
        return np.concatenate([q, k, v], axis=2)[:, :, s_r, s_k]
    if key == "wo":  # [H, K, D] from o_proj [D, H*K]
        s_h, s_k, s_d = slices(index, 3)
        h0, h1 = span(s_h, H)
        o = np.asarray(read(name(i, "self_attn.o_proj"))[s_d, h0 * K:h1 * K])
        return o.T.reshape(h1 - h0, K, -1)[:, s_k]
    if key == "w_in":  # [D, 2, F] from gate_proj / up_proj [F, D]
        s_d, s_t, s_f = slices(index, 3)
        return np.stack([np.asarray(read(name(i, f"mlp.{n}_proj"))[s_f, s_d]).T for n in ("gate", "up")],
                        axis=1)[:, s_t]
    if key == "w_down":  # [F, D] from down_proj [D, F]
        s_f, s_d = slices(index, 2)
        return np.asarray(read(name(i, "mlp.down_proj"))[s_d, s_f]).T
    return None


def layer_from_hf(read: Read, key: str, i: int, cfg: TransformerConfig, index: tuple | None = None,
                  norms: Mapping[str, str] = MappingProxyType({})) -> np.ndarray:
    """Our per-layer leaf `key` of layer i (or its block `index`): a projection (`from_hf`), or one of the
    family's per-layer vectors, `norms` mapping each to its HF tensor (a norm's scale)."""
    if key in norms:
        (s,) = slices(index, 1)
        return np.asarray(read(name(i, norms[key]))[s])
    arr = from_hf(read, key, i, cfg, index)
    if arr is None:
        raise KeyError(key)
    return arr


def top_from_hf(read: Read, key: str, cfg: TransformerConfig | None = None, index: tuple | None = None) -> np.ndarray:
    """A top-level leaf (embed, final_norm, head) or its block `index` from HF tensors."""
    if key == "head":  # [D, V] from lm_head [V, D]
        s_d, s_v = slices(index, 2)
        return np.asarray(read("lm_head.weight")[s_v, s_d]).T
    tensor = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight"}[key]
    return np.asarray(read(tensor)[slices(index, 1 if key == "final_norm" else 2)])


def top_to_hf(params: dict[str, np.ndarray], tied: bool) -> dict[str, np.ndarray]:
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    if not tied:
        out["lm_head.weight"] = params["head"].T
    return out


def top_shapes(cfg: TransformerConfig, tied: bool) -> dict[str, tuple[int, ...]]:
    V, D = cfg.vocab_size, cfg.d_model
    return {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), **({} if tied else
                                                                               {"lm_head.weight": (V, D)})}
