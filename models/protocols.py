"""What code outside a family may read of its config, as Protocols: the families' frozen config dataclasses
satisfy them by their fields, so the protocols import nothing and every module of models/ can name them."""
from __future__ import annotations

from typing import ClassVar, Protocol


class ModelConfig(Protocol):
    """What sharding/, checkpoint/ and train/ read of any family's frozen config dataclass: everything else they
    learn through the family's functions (Family below)."""
    family: ClassVar[str]
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    param_dtype: str
    compute_dtype: str
    remat: str  # none | full | save_dots


class TransformerConfig(ModelConfig, Protocol):
    """The fields of the built-in transformer families (models/config.SharedFields) that the planner, attention's
    resolution per platform and the mixture and LoRA settings read; a family of its own need not have them."""
    n_heads: int
    attention: str
    loss_chunk_size: int
    n_experts: int
    moe_every: int
    lora_rank: int

    @property
    def head_dim(self) -> int: ...
