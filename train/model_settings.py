"""The model.* settings: `preset` and `family`, then every field of the registered families' config dataclasses
(models/*_config.py), each a typed placeholder that keeps the preset's value while unset. The families own the
fields and their checks; this module adds the help the configuration reference shows."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar

from ml_collections import config_dict

import models
from models import attention as attention_lib
from models.config import DTYPES, REMAT_POLICIES
from models.lora import TARGETS as LORA_TARGETS
from train.settings import Section, setting

# Family fields resolve() fills in from the data (models/documents.py), never the user's settings.
DERIVED = ("document_eos_id", "masked_targets")

# The help of each family field, in the order the reference lists them; a field not listed here still becomes a
# setting (listed after these).
HELP: dict[str, str] = {
    "vocab_size": "tokens in the vocabulary; unset: the DATADIR's (its meta.json), else the preset's",
    "seq_len": "tokens per row",
    "d_model": "the width of the residual stream",
    "n_layers": "transformer blocks",
    "n_heads": "attention (query) heads",
    "mlp_ratio": "the MLP's width as a multiple of d_model",
    "n_kv_heads": "key/value heads (grouped-query attention)",
    "d_mlp": "the SwiGLU MLP's width",
    "norm_eps": "the epsilon of every norm",
    "rope_theta": "the rotary embeddings' base frequency",
    "rope_scaling": "Llama 3.1's rotary scaling FACTOR,LOW_FREQ_FACTOR,HIGH_FREQ_FACTOR,ORIGINAL_CONTEXT "
                    "(e.g. 8,1,4,8192), or none",
    "tie_embeddings": "the output head reuses the embedding matrix",
    "param_dtype": "the dtype the parameters are kept in: " + ", ".join(DTYPES),
    "compute_dtype": "the dtype the matmuls run in: float32 or bfloat16 (float16 would need loss scaling)",
    "remat": "what the backward pass recomputes: " + ", ".join(REMAT_POLICIES) + " (save_dots keeps matmul outputs)",
    "attention": f"{', '.join(attention_lib.IMPLEMENTATIONS)}; auto: cuDNN's flash kernel where it runs, else XLA's",
    "loss_chunk_size": "positions per chunk of the head + loss; 0: all at once (models/lm_loss.py)",
    "n_experts": "experts of each mixture-of-experts block; 0: a dense model (models/moe.py)",
    "experts_per_token": "the top-k experts each token is routed to",
    "capacity_factor": "tokens an expert takes, as a multiple of its even share of a row; 0: dropless",
    "moe_every": "every k-th block is a mixture of experts (k divides n_layers)",
    "router_z_loss_weight": "the weight of the router's z-loss in the objective (ST-MoE)",
    "load_balance_weight": "the weight of the load-balancing loss in the objective (Switch)",
    "lora_rank": "LoRA's rank; 0: no adapters, every weight trains; above 0 the base (checkpoint.restore_from) "
                 "is frozen",
    "lora_alpha": "adapters add alpha/rank x A.B to each weight",
    "lora_targets": "comma list of the projections that get adapters: " + ", ".join(LORA_TARGETS),
    # GPT's options (models/gpt_config.py); the gpt2 preset sets GPT-2's architecture
    "positions": "rotary, or learned (GPT-2's table of absolute positions, max_positions rows)",
    "max_positions": "rows of the learned position table; 0: seq_len",
    "bias": "a bias in every projection (GPT-2's)",
    "norm": "rmsnorm, or layernorm (GPT-2's, with a bias)",
    "activation": "the MLP's GELU: gelu_tanh (GPT-2's gelu_new) or gelu (the exact erf form)",
    "vocab_multiple": "the embedding table has vocab_size rounded up to a multiple of it (gpt2: 64); the padded "
                      "rows' logits are -inf",
}


@dataclasses.dataclass(frozen=True)
class ModelSection(Section):
    """The model: a preset (which implies its family), then any field of that family, which overrides the
    preset's value (models/*_config.py check them)."""
    KEY: ClassVar[str] = "model"
    preset: str = setting("tiny", "a preset of a family (it implies model.family); the fields below override it",
                          allowed="a preset of models/gpt_config.py or models/llama_config.py")
    family: str = setting(None, "gpt or llama without a preset: that family's defaults", kind=str)


def _config_type(cls: type, field: dataclasses.Field) -> type:
    """The ConfigDict type of a family field: its annotation where that is a plain type (X | None: X), else its
    default's type, else str (rope_scaling, typed Any: a string on the command line)."""
    try:
        hint = typing.get_type_hints(cls).get(field.name)
    except (NameError, TypeError):
        hint = None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    for kind in (args[0] if len(args) == 1 else hint, type(field.default)):
        if kind in (int, float, str, bool):
            return kind
    return str


def family_fields() -> dict[str, tuple[type, tuple[str, ...]]]:
    """{field: (its config type, the families that have it)} over every registered family, in the reference's
    order (HELP's, then the rest)."""
    found: dict[str, tuple[type, tuple[str, ...]]] = {}
    for name, family in models.FAMILIES.items():
        for f in dataclasses.fields(family.config_cls):
            if f.name not in DERIVED:
                kind, owners = found.get(f.name, (_config_type(family.config_cls, f), ()))
                found[f.name] = (kind, owners + (name,))
    order = [k for k in HELP if k in found] + [k for k in found if k not in HELP]
    return {k: found[k] for k in order}


def model_keys() -> dict[str, Any]:
    """The model.* section of the base config: preset, family, and every family field as a None placeholder."""
    keys = ModelSection.defaults()
    keys.update({name: config_dict.placeholder(kind) for name, (kind, _) in family_fields().items()})
    return keys
