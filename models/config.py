"""What every family's config shares (fields, checks, the mixture-of-experts settings) and `from_dict`, which picks
the family from the preset or `model.family` and builds its config with the explicit fields overriding the preset."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from mesh.errors import UserError  # the one module of ours models imports: the base of user errors
from models.attention import IMPLEMENTATIONS as ATTENTION  # resolved per platform there
from models.contract import FAMILIES
from models.lora import TARGETS as LORA_TARGETS
from models.lora import targets as lora_targets

REMAT_POLICIES = ("none", "full", "save_dots")
# How the router weighs a token's top-k experts (models/moe.route): auto renormalizes their probabilities when k > 1
# (Switch keeps the top-1 probability); topk_softmax always (Mixtral: a softmax over the chosen logits); softmax
# never (Qwen3-MoE with norm_topk_prob false).
ROUTERS = ("auto", "topk_softmax", "softmax")
DTYPES = ("float32", "bfloat16", "float16")


class ModelConfigError(UserError):
    """A model setting the user can fix; the message is one line naming the setting."""


def described(default: Any, help: str) -> Any:
    """A config field with its one-line help: the field is a `model.*` setting, and the configuration reference
    (train/config/model_settings.py, docs/configuration.md) shows the help beside it."""
    return dataclasses.field(default=default, metadata={"help": help})


def check_common(cfg: SharedFields, positive: tuple[str, ...]) -> None:
    """Checks every family shares: positive sizes, dtypes, remat policy, an even head dimension."""
    for key in positive:
        if getattr(cfg, key) < 1:
            raise ModelConfigError(f"model.{key}={getattr(cfg, key)}: must be a positive integer")
    if cfg.d_model % cfg.n_heads:
        raise ModelConfigError(
            f"model.d_model={cfg.d_model} is not divisible by model.n_heads={cfg.n_heads}; change one of them")
    if cfg.head_dim % 2:
        raise ModelConfigError(
            f"the head dimension {cfg.head_dim} (model.head_dim, or model.d_model/model.n_heads): rotary embeddings "
            f"need an even head dimension")
    for key in ("param_dtype", "compute_dtype"):
        if getattr(cfg, key) not in DTYPES:
            raise ModelConfigError(f"model.{key}={getattr(cfg, key)!r}: use one of {', '.join(DTYPES)}")
    if cfg.compute_dtype == "float16":
        raise ModelConfigError("model.compute_dtype=float16: float16 needs dynamic loss scaling, which this "
                               "trainer does not do; use bfloat16 (same speed, float32's range) or float32")
    if cfg.attention not in ATTENTION:
        raise ModelConfigError(f"model.attention={cfg.attention!r}: use one of {', '.join(ATTENTION)}")
    if not isinstance(cfg.loss_chunk_size, int) or cfg.loss_chunk_size < 0:
        raise ModelConfigError(f"model.loss_chunk_size={cfg.loss_chunk_size!r}: tokens per loss chunk, an integer "
                               f">= 0 (0 computes every logit at once)")
    if cfg.remat not in REMAT_POLICIES:
        raise ModelConfigError(f"model.remat={cfg.remat!r}: use one of {', '.join(REMAT_POLICIES)}")
    if not cfg.norm_eps > 0:
        raise ModelConfigError(f"model.norm_eps={cfg.norm_eps}: must be a positive number")
    check_moe(cfg)
    check_lora(cfg)


def check_moe(cfg: SharedFields) -> None:
    """The mixture-of-experts settings (models/moe.py); n_experts 0 is a dense model and ignores the rest."""
    if not isinstance(cfg.n_experts, int) or cfg.n_experts < 0:
        raise ModelConfigError(f"model.n_experts={cfg.n_experts!r}: an integer >= 0 (0: a dense model)")
    if not cfg.n_experts:
        return
    if not isinstance(cfg.experts_per_token, int) or not 1 <= cfg.experts_per_token <= cfg.n_experts:
        raise ModelConfigError(f"model.experts_per_token={cfg.experts_per_token!r}: the top-k experts of each token, "
                               f"an integer from 1 to model.n_experts={cfg.n_experts}")
    if not isinstance(cfg.capacity_factor, (int, float)) or cfg.capacity_factor < 0:
        raise ModelConfigError(f"model.capacity_factor={cfg.capacity_factor!r}: a number >= 0 (0: dropless)")
    if cfg.router not in ROUTERS:
        raise ModelConfigError(f"model.router={cfg.router!r}: use one of {', '.join(ROUTERS)}")
    if not isinstance(cfg.moe_every, int) or cfg.moe_every < 1 or cfg.n_layers % cfg.moe_every:
        raise ModelConfigError(f"model.moe_every={cfg.moe_every!r}: every k-th block is a mixture of experts, and k "
                               f"must divide model.n_layers={cfg.n_layers}; change one of them")
    for key in ("router_z_loss_weight", "load_balance_weight"):
        if not isinstance(getattr(cfg, key), (int, float)) or getattr(cfg, key) < 0:
            raise ModelConfigError(f"model.{key}={getattr(cfg, key)!r}: a number >= 0 (0: not in the objective)")


def check_lora(cfg: SharedFields) -> None:
    """The low-rank adapter settings (models/lora.py); lora_rank 0 trains every weight and ignores alpha."""
    rank = cfg.lora_rank
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ModelConfigError(f"model.lora_rank={rank!r}: an integer >= 0 (0: no adapters, every weight trains)")
    unknown = [t for t in lora_targets(cfg) if t not in LORA_TARGETS]
    if unknown or not lora_targets(cfg):
        raise ModelConfigError(f"model.lora_targets={cfg.lora_targets!r}: a comma list of {', '.join(LORA_TARGETS)}")
    if not rank:
        return
    if not isinstance(cfg.lora_alpha, (int, float)) or not cfg.lora_alpha > 0:
        raise ModelConfigError(f"model.lora_alpha={cfg.lora_alpha!r}: a number > 0 (adapters add "
                               f"alpha/rank x A.B to each weight)")
    if "mlp" in lora_targets(cfg) and any(s.mlp == "experts" for s in FAMILIES[cfg.family].layer_specs(cfg)):
        raise ModelConfigError(f"model.lora_targets={cfg.lora_targets!r} with model.n_experts={cfg.n_experts}: a "
                               f"mixture's adapters are on attention only; drop mlp (q, k, v, o adapt every layer)")


@dataclasses.dataclass(frozen=True)
class LoRAFields:
    """Low-rank adapters (models/lora.py): lora_rank 0 trains the whole model; above 0 the base is frozen and each
    projection of `lora_targets` (q, k, v, o: attention; mlp: both MLP matrices, not on a mixture) gains
    (alpha/rank)·A·B."""
    lora_rank: int = described(0, "LoRA's rank; 0: no adapters, every weight trains; above 0 the base "
                                  "(checkpoint.restore_from) is frozen")
    lora_alpha: float = described(16.0, "adapters add alpha/rank x A.B to each weight")
    lora_targets: str = described("q,v", "comma list of the projections that get adapters: " + ", ".join(LORA_TARGETS))


@dataclasses.dataclass(frozen=True)
class MoEFields(LoRAFields):
    """Mixture-of-experts settings shared by every family (models/moe.py). n_experts 0: dense MLPs.
    Every `moe_every`-th block (the last of each group of moe_every) routes each token to its top
    `experts_per_token` experts; capacity_factor 0 is dropless, else each expert takes at most
    ceil(capacity_factor * seq_len * k / n_experts) tokens of a row. The router's z-loss (ST-MoE) and
    load-balancing loss (Switch) join the objective with these weights (the usual 1e-3 and 1e-2)."""
    n_experts: int = described(0, "experts of each mixture-of-experts block; 0: a dense model (models/moe.py)")
    experts_per_token: int = described(2, "the top-k experts each token is routed to")
    capacity_factor: float = described(0.0, "tokens an expert takes, as a multiple of its even share of a row; 0: "
                                            "dropless")
    moe_every: int = described(1, "every k-th block is a mixture of experts (k divides n_layers)")
    router: str = described("auto", "the top-k experts' weights: auto (renormalized when k > 1), topk_softmax "
                                    "(always renormalized: Mixtral), softmax (never: Qwen3-MoE without norm_topk_prob)")
    router_z_loss_weight: float = described(1e-3, "the weight of the router's z-loss in the objective (ST-MoE)")
    load_balance_weight: float = described(1e-2, "the weight of the load-balancing loss in the objective (Switch)")


@dataclasses.dataclass(frozen=True)
class SharedFields(MoEFields):
    """The fields every built-in family has, with their defaults (a family may change a default, e.g. norm_eps).
    `head_dim` follows from them."""
    vocab_size: int = described(256, "tokens in the vocabulary; unset: the DATADIR's (its meta.json), else the "
                                     "preset's")
    seq_len: int = described(64, "tokens per row")
    d_model: int = described(128, "the width of the residual stream")
    n_layers: int = described(8, "transformer blocks")
    n_heads: int = described(8, "attention (query) heads")
    param_dtype: str = described("float32", "the dtype the parameters are kept in: " + ", ".join(DTYPES))
    compute_dtype: str = described("float32", "the dtype the matmuls run in: float32 or bfloat16 (float16 would need "
                                              "loss scaling)")
    remat: str = described("none", "what the backward pass recomputes: " + ", ".join(REMAT_POLICIES)
                           + " (save_dots keeps matmul outputs)")
    norm_eps: float = described(1e-6, "the epsilon of every norm")
    # Packed documents end at this token (set by train.config from data.document_mask and the DATADIR's
    # eos id; -1: a row is one stream): see models/documents.py.
    document_eos_id: int = -1
    # Rows carry a loss mask, a target that does not count stored as -(id+1) (set by train.config from
    # data.loss_mask): see models/documents.py.
    masked_targets: bool = False
    attention: str = described("auto", f"{', '.join(ATTENTION)}; auto: cuDNN's flash kernel where it runs, else XLA's")
    loss_chunk_size: int = described(0, "positions per chunk of the head + loss; 0: all at once (models/lm_loss.py)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# GPU presets compute the head and the loss in chunks of 256 positions: on a gpt2-125m step of batch 8 (one CPU
# device, --compile_only) that cut XLA's temporaries by 2.82 GB (24.06 -> 21.25 GB; 128 gave the same, 512 only
# 2.04 GB).
LOSS_CHUNK = 256


def family_of_preset(preset: str) -> str:
    for name, family in FAMILIES.items():
        if preset in family.presets:
            return name
    every = [p for family in FAMILIES.values() for p in family.presets]
    raise ModelConfigError(f"model.preset={preset!r}: unknown preset; use one of {', '.join(every)}")


def from_dict(values: Mapping[str, Any]) -> Any:
    """Build from a config section: `preset` (which implies the family) first, then any explicit field
    overrides it. `family` alone (no preset) starts from that family's defaults."""
    values = dict(values)
    preset = values.pop("preset", None) or None
    family = values.pop("family", None) or None
    if family is not None and family not in FAMILIES:
        raise ModelConfigError(f"model.family={family!r}: unknown family; use one of {', '.join(FAMILIES)}")
    if preset is not None:
        implied = family_of_preset(preset)
        if family is not None and family != implied:
            raise ModelConfigError(f"model.family={family!r} but model.preset={preset!r} is a {implied} preset; "
                                   f"drop one of them")
        family = implied
    spec = FAMILIES[family or "gpt"]
    fields = dict(spec.presets[preset]) if preset is not None else {}
    known = {f.name for f in dataclasses.fields(spec.config_cls)}
    for key, value in values.items():
        if value is None:
            continue
        if key not in known:
            raise ModelConfigError(f"model.{key}: not a setting of the {spec.name} family; use one of "
                                   f"{', '.join(sorted(known))}")
        fields[key] = value
    return spec.config_cls(**fields).validate()
