"""The DeepSeek family's Hugging Face adapter (models/hf.py): our parameters <-> transformers' DeepseekV3ForCausalLM,
whose names are DeepSeek's published checkpoints'. transformers keeps [out, in] matrices: q_proj [H*(Kn+Kr), D] (or
q_a_proj [Rq, D], q_a_layernorm, q_b_proj [H*(Kn+Kr), Rq]), kv_a_proj_with_mqa [R+Kr, D], kv_a_layernorm [R],
kv_b_proj [H*(Kn+Kv), R], o_proj [D, H*Kv]; a dense layer's mlp.{gate,up,down}_proj; a mixture layer's
mlp.gate.weight [E, D] and its buffer mlp.gate.e_score_correction_bias [E] (our `expert_bias`), each expert's
mlp.experts.j.{gate,up,down}_proj (what save_pretrained writes; the fused gate_up_proj [E, 2F, D] and down_proj
[E, D, F] of transformers' in-memory layout import too) and mlp.shared_experts.*. The rotary dimensions are stored
interleaved in pairs (rope_interleave, DeepSeek's layout), ours half-split: the rope rows of the query and latent
projections are permuted on the way in and back on the way out. The MTP modules are layers n_layers + k with
DeepSeek's names: enorm, hnorm, eh_proj [D, 2D] (embedding half first), shared_head.norm, and copies of the shared
embed_tokens and shared_head.head that the import leaves unread. numpy only."""
from __future__ import annotations

from typing import Any

import numpy as np

from models.config import ModelConfigError
from models.deepseek_config import YARN_FIELDS, DeepSeekConfig, parse_yarn
from models.hf import HFAdapter, Read, slices

NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "q_norm": "self_attn.q_a_layernorm",
         "kv_norm": "self_attn.kv_a_layernorm", "enorm": "enorm", "hnorm": "hnorm", "head_norm": "shared_head.norm"}
MATRICES = {"wq": "self_attn.q_proj", "wq_a": "self_attn.q_a_proj", "wq_b": "self_attn.q_b_proj",
            "wkv_a": "self_attn.kv_a_proj_with_mqa", "wkv_b": "self_attn.kv_b_proj", "wo": "self_attn.o_proj"}
MLPS = {"w_in": "mlp", "w_down": "mlp", "shared/w_in": "mlp.shared_experts", "shared/w_down": "mlp.shared_experts"}
BIAS = "mlp.gate.e_score_correction_bias"


def name(i: int, tensor: str) -> str:
    return f"model.layers.{i}.{tensor}" + ("" if tensor == BIAS else ".weight")


def rope_order(width: int) -> np.ndarray:
    """Our half-split rotary dimension c is the checkpoint's interleaved dimension rope_order[c]."""
    return np.concatenate([np.arange(0, width, 2), np.arange(1, width, 2)])


# ----------------------------------------------------------------------------- one layer, both ways

def _attention_shapes(cfg: DeepSeekConfig) -> dict[str, tuple[int, ...]]:
    D, H, R = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank
    Kn, Kr, Kv, Rq = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    q = ({"wq_a": (Rq, D), "q_norm": (Rq,), "wq_b": (H * (Kn + Kr), Rq)} if Rq else {"wq": (H * (Kn + Kr), D)})
    return {**q, "wkv_a": (R + Kr, D), "kv_norm": (R,), "wkv_b": (H * (Kn + Kv), R), "wo": (D, H * Kv),
            "attn_norm": (D,), "mlp_norm": (D,)}


def layer_shapes(cfg: DeepSeekConfig, i: int, mixture: bool) -> dict[str, tuple[int, ...]]:
    """Layer i's tensors (a mixture layer's or a dense one's) with their shapes."""
    D, E, F = cfg.d_model, cfg.n_experts, cfg.moe_d_mlp
    out = {name(i, NORMS.get(k) or MATRICES[k]): s for k, s in _attention_shapes(cfg).items()}
    if not mixture:
        return {**out, **_mlp_shapes(i, "mlp", D, cfg.d_mlp)}
    out[name(i, "mlp.gate")] = (E, D)
    if cfg.scoring_func == "sigmoid":
        out[name(i, BIAS)] = (E,)
    for j in range(E):
        out.update(_mlp_shapes(i, f"mlp.experts.{j}", D, F))
    if cfg.n_shared_experts:
        out.update(_mlp_shapes(i, "mlp.shared_experts", D, cfg.n_shared_experts * F))
    return out


def _mlp_shapes(i: int, prefix: str, D: int, F: int) -> dict[str, tuple[int, ...]]:
    return {name(i, f"{prefix}.gate_proj"): (F, D), name(i, f"{prefix}.up_proj"): (F, D),
            name(i, f"{prefix}.down_proj"): (D, F)}


def layer_to_hf(p: dict[str, np.ndarray], i: int, cfg: DeepSeekConfig) -> dict[str, np.ndarray]:
    """Layer i's tensors from one layer's leaves `p` (flat keys: "wq", "experts/w_in", "shared/w_down", ...)."""
    D, Kn = cfg.d_model, cfg.qk_nope_head_dim
    order = rope_order(cfg.qk_rope_head_dim)
    out: dict[str, np.ndarray] = {}
    for key, arr in p.items():
        if key in NORMS:
            out[name(i, NORMS[key])] = arr
        elif key in ("wq", "wq_b"):  # [in, H, Kn+Kr]: the rope part back to interleaved
            hf = arr.copy()
            hf[..., Kn + order] = arr[..., Kn:]
            out[name(i, MATRICES[key])] = hf.reshape(arr.shape[0], -1).T
        elif key == "wkv_a":
            hf = arr.copy()
            hf[:, cfg.kv_lora_rank + order] = arr[:, cfg.kv_lora_rank:]
            out[name(i, MATRICES[key])] = hf.T
        elif key in ("wq_a", "wkv_b"):
            out[name(i, MATRICES[key])] = arr.reshape(arr.shape[0], -1).T
        elif key == "wo":
            out[name(i, MATRICES[key])] = arr.reshape(-1, D).T
        elif key in MLPS and key.endswith("w_in"):
            out[name(i, f"{MLPS[key]}.gate_proj")], out[name(i, f"{MLPS[key]}.up_proj")] = arr[:, 0].T, arr[:, 1].T
        elif key in MLPS:
            out[name(i, f"{MLPS[key]}.down_proj")] = arr.T
        elif key == "router":
            out[name(i, "mlp.gate")] = arr.T
        elif key == "expert_bias":
            out[name(i, BIAS)] = arr
        elif key == "experts/w_in":
            for j in range(arr.shape[0]):
                out[name(i, f"mlp.experts.{j}.gate_proj")] = arr[j, :, 0].T
                out[name(i, f"mlp.experts.{j}.up_proj")] = arr[j, :, 1].T
        elif key == "experts/w_down":
            out.update({name(i, f"mlp.experts.{j}.down_proj"): arr[j].T for j in range(arr.shape[0])})
        elif key == "eh_proj":  # [2, D, D] (embedding half, hidden half) -> [D, 2D]
            out[name(i, "eh_proj")] = np.concatenate([arr[0].T, arr[1].T], axis=1)
        else:
            raise KeyError(key)
    return out


def _experts(read: Read, i: int, part: str, rows: range, index_rest: tuple) -> np.ndarray:
    """Experts `rows` of layer i: w_in [e, D, 2, F] or w_down [e, F, D], from per-expert or fused tensors."""
    fused = f"model.layers.{i}.mlp.experts.gate_up_proj"
    try:
        if part == "w_in":
            w = np.asarray(read(fused)[rows.start:rows.stop])  # [e, 2F, D]
            arr = np.moveaxis(w.reshape(w.shape[0], 2, -1, w.shape[-1]), 3, 1)
        else:
            arr = np.swapaxes(np.asarray(read(f"model.layers.{i}.mlp.experts.down_proj")[rows.start:rows.stop]), 1, 2)
    except KeyError:
        if part == "w_in":
            arr = np.stack([np.stack([np.asarray(read(name(i, f"mlp.experts.{j}.{t}_proj"))).T
                                      for t in ("gate", "up")], axis=1) for j in rows])
        else:
            arr = np.stack([np.asarray(read(name(i, f"mlp.experts.{j}.down_proj"))).T for j in rows])
    return arr[(slice(None), *index_rest)]


def layer_from_hf(read: Read, key: str, i: int, cfg: DeepSeekConfig, index: tuple | None = None) -> np.ndarray:
    """Our leaf `key` (flat: "moe/wq", "experts/w_in", ...) of HF layer i, or its block `index`."""
    key = key.removeprefix("moe/")
    if key in ("experts/w_in", "experts/w_down"):
        s = slices(index, 4 if key.endswith("w_in") else 3)
        return _experts(read, i, key.split("/")[1], range(cfg.n_experts)[s[0]], s[1:])
    return _whole(read, key, i, cfg)[tuple(index or ())]


def _whole(read: Read, key: str, i: int, cfg: DeepSeekConfig) -> np.ndarray:
    """Our whole leaf `key` of HF layer i (every one but the experts')."""
    H, Kn, Kr, R, D = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.d_model
    order = rope_order(Kr)
    if key in NORMS:
        return np.asarray(read(name(i, NORMS[key])))
    if key in ("wq", "wq_b"):
        w = np.asarray(read(name(i, MATRICES[key]))).T.reshape(-1, H, Kn + Kr)
        return np.concatenate([w[..., :Kn], w[..., Kn + order]], axis=-1)
    if key == "wkv_a":
        w = np.asarray(read(name(i, MATRICES[key]))).T
        return np.concatenate([w[:, :R], w[:, R + order]], axis=1)
    if key == "wq_a":
        return np.asarray(read(name(i, MATRICES[key]))).T
    if key == "wkv_b":
        return np.asarray(read(name(i, MATRICES[key]))).T.reshape(R, H, -1)
    if key == "wo":
        return np.asarray(read(name(i, MATRICES[key]))).T.reshape(H, -1, D)
    if key in MLPS and key.endswith("w_in"):
        return np.stack([np.asarray(read(name(i, f"{MLPS[key]}.{t}_proj"))).T for t in ("gate", "up")], axis=1)
    if key in MLPS:
        return np.asarray(read(name(i, f"{MLPS[key]}.down_proj"))).T
    if key == "router":
        return np.asarray(read(name(i, "mlp.gate"))).T
    if key == "expert_bias":
        return np.asarray(read(name(i, BIAS)))
    if key == "eh_proj":
        w = np.asarray(read(name(i, "eh_proj")))
        return np.stack([w[:, :D].T, w[:, D:].T])
    raise KeyError(key)


# ----------------------------------------------------------------------------- the whole model

def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested stack as {path joined by '/': leaf}, a mixture layer's attention and norms ("moe/wq") short."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}".removeprefix("moe/"): v})
    return out


def _layers(cfg: DeepSeekConfig) -> list[tuple[str, int, int, bool]]:
    """(our top entry, its index there, the HF layer, a mixture layer?) of every layer: the dense prefix, the stack,
    the MTP modules."""
    k, n = cfg.first_k_dense_replace, cfg.n_layers
    return ([("prefix", j, j, False) for j in range(k)] + [("layers", j, k + j, True) for j in range(n - k)]
            + [("mtp", m, n + m, True) for m in range(cfg.num_nextn_predict_layers)])


def hf_shapes(cfg: DeepSeekConfig) -> dict[str, tuple[int, ...]]:
    V, D = cfg.vocab_size, cfg.d_model
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for where, _, i, mixture in _layers(cfg):
        out.update(layer_shapes(cfg, i, mixture))
        if where == "mtp":
            out.update({name(i, "enorm"): (D,), name(i, "hnorm"): (D,), name(i, "eh_proj"): (D, 2 * D),
                        name(i, "shared_head.norm"): (D,), name(i, "shared_head.head"): (V, D),
                        name(i, "embed_tokens"): (V, D)})
    return out


def to_hf(params: dict[str, Any], cfg: DeepSeekConfig) -> dict[str, np.ndarray]:
    """Our params (numpy, layers in logical order) -> HF tensors, C-contiguous."""
    head = params["head"].T if "head" in params else params["embed"]
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"],
           "lm_head.weight": head}
    for where, j, i, _ in _layers(cfg):
        out.update(layer_to_hf({k: v[j] for k, v in _flat(params[where]).items()}, i, cfg))
        if where == "mtp":
            out.update({name(i, "shared_head.head"): head, name(i, "embed_tokens"): params["embed"]})
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def top_from_hf(read: Read, key: str, cfg: DeepSeekConfig, index: tuple | None = None) -> np.ndarray:
    """A top-level leaf (embed, final_norm, head) or a leaf of the dense prefix or the MTP modules ("prefix/wq",
    "mtp/moe/wq": [k or M, ...]), or its block `index`."""
    where, _, rest = key.partition("/")
    if where in ("prefix", "mtp"):
        first = 0 if where == "prefix" else cfg.n_layers
        count = cfg.first_k_dense_replace if where == "prefix" else cfg.num_nextn_predict_layers
        s = tuple(index or ())
        rows = range(count)[s[0]] if s else range(count)
        return np.stack([layer_from_hf(read, rest, first + j, cfg, s[1:]) for j in rows])
    if key == "head":
        s_d, s_v = slices(index, 2)
        return np.asarray(read("lm_head.weight")[s_v, s_d]).T
    tensor = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight"}[key]
    return np.asarray(read(tensor)[slices(index, 1 if key == "final_norm" else 2)])


def stack_from_hf(read: Read, key: str, j: int, cfg: DeepSeekConfig, index: tuple | None = None) -> np.ndarray:
    """Stack entry j (the mixture layer first_k_dense_replace + j)."""
    return layer_from_hf(read, key, cfg.first_k_dense_replace + j, cfg, index)


# ----------------------------------------------------------------------------- config.json

def hf_config(cfg: DeepSeekConfig, dtype: str, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """config.json of DeepseekV3ForCausalLM, the rotary settings in both spellings transformers 4.x and 5.x read."""
    yarn = None if cfg.rope_scaling is None else {"type": "yarn", "rope_type": "yarn",
                                                  **dict(zip(YARN_FIELDS, cfg.rope_scaling))}
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(yarn or {})}
    longest = cfg.seq_len if yarn is None else max(cfg.seq_len, int(yarn["factor"] * yarn[YARN_FIELDS[1]]))
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "moe_intermediate_size": cfg.moe_d_mlp,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_heads, "n_shared_experts": cfg.n_shared_experts,
            "n_routed_experts": cfg.n_experts, "routed_scaling_factor": cfg.routed_scaling_factor,
            "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank or None,
            "qk_rope_head_dim": cfg.qk_rope_head_dim, "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "v_head_dim": cfg.v_head_dim, "n_group": cfg.n_group, "topk_group": cfg.topk_group,
            "num_experts_per_tok": cfg.experts_per_token, "first_k_dense_replace": cfg.first_k_dense_replace,
            "norm_topk_prob": cfg.norm_topk_prob, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "moe_layer_freq": 1, "hidden_act": "silu", "max_position_embeddings": longest,
            "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": yarn, "rope_parameters": rope,
            "rope_interleave": True, "attention_bias": False, "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
            "aux_loss_alpha": cfg.seq_balance_weight, "seq_aux": True, "tie_word_embeddings": cfg.tie_embeddings,
            "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": dtype, "dtype": dtype}


def fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Our model fields from a deepseek_v3 config.json (rope_parameters or the older rope_theta / rope_scaling)."""
    if hf.get("model_type") != "deepseek_v3":
        raise ModelConfigError(f"config.json model_type={hf.get('model_type')!r}: only deepseek_v3 imports as "
                               f"DeepSeek")
    if hf.get("attention_bias") or hf.get("scoring_func", "sigmoid") != "sigmoid" or not hf.get(
            "rope_interleave", True) or hf.get("moe_layer_freq", 1) != 1:
        raise ModelConfigError("config.json: attention biases, softmax scores, a half-split rotary layout and "
                               "moe_layer_freq > 1 are not built here")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type") == "yarn" else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    heads, q_rank = int(hf["num_attention_heads"]), hf.get("q_lora_rank")
    return dict(vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]),
                d_mlp=int(hf["intermediate_size"]), moe_d_mlp=int(hf["moe_intermediate_size"]),
                n_layers=int(hf["num_hidden_layers"]), n_heads=heads, n_experts=int(hf["n_routed_experts"]),
                experts_per_token=int(hf["num_experts_per_tok"]), n_shared_experts=int(hf.get("n_shared_experts") or 0),
                first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0), n_group=int(hf.get("n_group") or 1),
                topk_group=int(hf.get("topk_group") or 1), norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)), q_lora_rank=int(q_rank or 0),
                kv_lora_rank=int(hf["kv_lora_rank"]), qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
                qk_rope_head_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
                norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
                rope_scaling=parse_yarn(scaling), capacity_factor=0.0, moe_every=1, scoring_func="sigmoid",
                num_nextn_predict_layers=int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def unsupported(cfg: DeepSeekConfig) -> str | None:
    if cfg.scoring_func != "sigmoid":
        return (f"model.scoring_func={cfg.scoring_func!r}: DeepseekV3ForCausalLM routes by sigmoid scores; "
                f"DeepSeek-V2's softmax routing has no export here")
    return None


ADAPTER = HFAdapter(architectures=("DeepseekV3ForCausalLM",), fields_from_hf=fields_from_hf, hf_config=hf_config,
                    hf_shapes=hf_shapes, to_hf=to_hf, layer_from_hf=stack_from_hf, top_from_hf=top_from_hf,
                    unsupported=unsupported)
