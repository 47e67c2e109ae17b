"""The mixture half of the Llama family's HF adapter (models/llama_hf.py): MixtralForCausalLM and
Qwen3MoeForCausalLM keep each expert's SwiGLU as three [out, in] matrices and the router as gate [E, D]; ours are
experts w_in [E, D, 2, F], w_down [E, F, D] and router [D, E] per block (models/moe.py, an MoE block in every
layer). Mixtral spells them block_sparse_moe.experts.j.w1 (gate), w3 (up), w2 (down); Qwen3-MoE
mlp.experts.j.gate_proj, up_proj, down_proj."""
from __future__ import annotations

from typing import Any

import numpy as np

from models.config import ModelConfigError
from models.hf import Read, slices
from models.llama_config import LlamaConfig
from models.moe import renormalizes


def _names(cfg: LlamaConfig) -> tuple[str, dict[str, str]]:
    """(the block's MLP prefix, our gate/up/down -> its expert tensor names)."""
    if cfg.qk_norm:
        return "mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    return "block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}


def _expert(i: int, j: int, part: str, cfg: LlamaConfig) -> str:
    prefix, names = _names(cfg)
    return f"model.layers.{i}.{prefix}.experts.{j}.{names[part]}.weight"


def _router(i: int, cfg: LlamaConfig) -> str:
    return f"model.layers.{i}.{_names(cfg)[0]}.gate.weight"


def shapes(cfg: LlamaConfig, i: int) -> dict[str, tuple[int, ...]]:
    """The mixture tensors of layer i with their shapes."""
    D, F, E = cfg.d_model, cfg.d_mlp, cfg.n_experts
    out = {_router(i, cfg): (E, D)}
    for j in range(E):
        out.update({_expert(i, j, "gate", cfg): (F, D), _expert(i, j, "up", cfg): (F, D),
                    _expert(i, j, "down", cfg): (D, F)})
    return out


def to_hf(p: dict[str, np.ndarray], i: int, cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Layer i's router and experts (`p`: router, experts/w_in, experts/w_down of that layer) as HF tensors."""
    out = {_router(i, cfg): p["router"].T}
    for j in range(cfg.n_experts):
        w_in = p["experts/w_in"][j]  # [D, 2, F]
        out.update({_expert(i, j, "gate", cfg): w_in[:, 0].T, _expert(i, j, "up", cfg): w_in[:, 1].T,
                    _expert(i, j, "down", cfg): p["experts/w_down"][j].T})
    return out


def from_hf(read: Read, key: str, i: int, cfg: LlamaConfig, index: tuple | None) -> np.ndarray:
    """Our mixture leaf `key` (router, experts/w_in, experts/w_down) of layer i, or its block `index`."""
    if key == "router":  # [D, E] from gate [E, D]
        s_d, s_e = slices(index, 2)
        return np.asarray(read(_router(i, cfg))[s_e, s_d]).T
    if key == "experts/w_in":  # [E, D, 2, F] from each expert's gate and up [F, D]
        s_e, s_d, s_t, s_f = slices(index, 4)
        return np.stack([np.stack([np.asarray(read(_expert(i, j, part, cfg))[s_f, s_d]).T for part in ("gate", "up")],
                                  axis=1)[:, s_t] for j in range(cfg.n_experts)[s_e]])
    if key == "experts/w_down":  # [E, F, D] from each expert's down [D, F]
        s_e, s_f, s_d = slices(index, 3)
        return np.stack([np.asarray(read(_expert(i, j, "down", cfg))[s_d, s_f]).T for j in range(cfg.n_experts)[s_e]])
    raise KeyError(key)


def hf_config(cfg: LlamaConfig) -> dict[str, Any]:
    """config.json's mixture fields (and its architecture) for an MoE block in every layer."""
    common = {"num_experts_per_tok": cfg.experts_per_token, "router_aux_loss_coef": cfg.load_balance_weight,
              "output_router_logits": False}
    if cfg.qk_norm:
        return {**common, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "num_experts": cfg.n_experts, "moe_intermediate_size": cfg.d_mlp, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "norm_topk_prob": renormalizes(cfg)}
    return {**common, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": cfg.n_experts, "router_jitter_noise": 0.0}


def fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Our mixture fields from a mixtral / qwen3_moe config.json: dropless (as transformers runs it), its
    load-balancing coefficient, no z-loss (it has none)."""
    common = dict(experts_per_token=hf["num_experts_per_tok"], capacity_factor=0.0, moe_every=1,
                  load_balance_weight=float(hf.get("router_aux_loss_coef", 0.0)), router_z_loss_weight=0.0)
    if hf["model_type"] == "mixtral":
        return dict(common, n_experts=hf["num_local_experts"], router="topk_softmax", d_mlp=hf["intermediate_size"])
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ModelConfigError(f"config.json decoder_sparse_step={hf.get('decoder_sparse_step')} mlp_only_layers="
                               f"{hf.get('mlp_only_layers')}: only a mixture in every layer imports")
    experts = hf.get("num_experts") or hf["num_local_experts"]  # the published spelling, or transformers 5's
    return dict(common, n_experts=experts, d_mlp=hf["moe_intermediate_size"],
                router="topk_softmax" if hf.get("norm_topk_prob", True) else "softmax")


def unsupported(cfg: LlamaConfig) -> str | None:
    if cfg.moe_every != 1:
        return (f"model.moe_every={cfg.moe_every}: Mixtral and Qwen3-MoE have a mixture in every block; only "
                f"model.moe_every=1 converts")
    if not cfg.qk_norm and not renormalizes(cfg):
        return (f"model.router={cfg.router!r} with model.experts_per_token={cfg.experts_per_token}: Mixtral "
                f"renormalizes the top-k weights; use model.router=topk_softmax")
    return None
