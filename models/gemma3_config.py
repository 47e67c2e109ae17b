"""The Gemma 3 family's config (the text model: Gemma3ForCausalLM, and the text tower of Gemma3ForConditionalGeneration)
and its presets, from the published config.json files of google/gemma-3-{1b,4b,12b,27b}."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from models.config import LOSS_CHUNK, ModelConfigError, SharedFields, check_common, described

ACTIVATIONS = ("gelu_tanh", "gelu")
LAYER_TYPES = ("sliding", "global")


@dataclasses.dataclass(frozen=True)
class Gemma3Config(SharedFields):
    """Gemma 3 (Gemma Team 2025): every `global_every`-th layer global (causal over the whole sequence, rotary base
    `rope_theta`, linear scaling by `rope_linear_factor`), the others sliding over the `sliding_window` latest positions
    (rotary base `rope_local_theta`); or the pattern spelled out in `layer_types`. Queries and keys RMS-normed per
    head, scores scaled by query_pre_attn_scalar^-1/2, four norms per block (before and after attention and MLP), all
    of the form x (1 + w), the embedding scaled by sqrt(d_model), a GeGLU MLP, a head tied to the embedding."""
    family: ClassVar[str] = "gemma3"
    norm_eps: float = described(1e-6, "the epsilon of every norm")
    n_kv_heads: int = described(4, "key/value heads (grouped-query attention)")
    d_mlp: int = described(512, "the GeGLU MLP's width")
    head_dim: int = described(0, "each attention head's width; 0: d_model/n_heads")
    sliding_window: int = described(32, "positions a sliding layer's query sees, its own included")
    global_every: int = described(6, "every k-th layer is global (causal over the whole sequence), the others "
                                     "sliding; 1: every layer global")
    layer_types: str = described("", "the pattern spelled out, a comma list of sliding and global, one per layer "
                                     "(config.json's layer_types); empty: from global_every")
    rope_theta: float = described(1_000_000.0, "the global layers' rotary base frequency")
    rope_local_theta: float = described(10_000.0, "the sliding layers' rotary base frequency")
    rope_linear_factor: float = described(1.0, "the global layers' linear rotary scaling factor (1: none; Gemma 3 "
                                               "4B and larger: 8)")
    query_pre_attn_scalar: float = described(0.0, "attention scores are scaled by its -1/2 power; 0: head_dim")
    activation: str = described("gelu_tanh", "the MLP's GELU: gelu_tanh (gelu_pytorch_tanh) or gelu (exact)")
    tie_embeddings: bool = described(True, "the output head reuses the embedding matrix")

    def __post_init__(self):
        # Stored resolved, so every reader of cfg.head_dim sees the width itself.
        if self.head_dim == 0 and isinstance(self.n_heads, int) and self.n_heads > 0:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)

    def global_layer(self, layer: int) -> bool:
        """Whether layer `layer` is global."""
        if self.layer_types:
            return self.layer_types.split(",")[layer].strip() == "global"
        return (layer + 1) % self.global_every == 0

    def validate(self) -> "Gemma3Config":
        if not isinstance(self.head_dim, int) or isinstance(self.head_dim, bool) or self.head_dim < 1:
            raise ModelConfigError(f"model.head_dim={self.head_dim!r}: each head's width, an integer >= 1 "
                                   f"(0: d_model/n_heads)")
        check_common(self, ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_mlp",
                            "sliding_window", "global_every"))
        if self.n_heads % self.n_kv_heads:
            raise ModelConfigError(f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads="
                                   f"{self.n_kv_heads}; grouped-query attention shares each kv head by a whole group")
        if self.n_experts:
            raise ModelConfigError(f"model.n_experts={self.n_experts}: Gemma 3 has no mixture of experts; use 0")
        types = [t.strip() for t in self.layer_types.split(",")] if self.layer_types else []
        if types and (len(types) != self.n_layers or set(types) - set(LAYER_TYPES)):
            raise ModelConfigError(f"model.layer_types={self.layer_types!r}: a comma list of sliding and global, one "
                                   f"per layer (model.n_layers={self.n_layers}); or empty to use model.global_every")
        for key in ("rope_theta", "rope_local_theta"):
            if not getattr(self, key) > 0:
                raise ModelConfigError(f"model.{key}={getattr(self, key)}: must be a positive number")
        if not self.rope_linear_factor >= 1:
            raise ModelConfigError(f"model.rope_linear_factor={self.rope_linear_factor}: a factor >= 1 (1: none)")
        if not self.query_pre_attn_scalar >= 0:
            raise ModelConfigError(f"model.query_pre_attn_scalar={self.query_pre_attn_scalar}: a number > 0, or 0 "
                                   f"for head_dim")
        if self.activation not in ACTIVATIONS:
            raise ModelConfigError(f"model.activation={self.activation!r}: use one of {', '.join(ACTIVATIONS)}")
        if not isinstance(self.tie_embeddings, bool):
            raise ModelConfigError(f"model.tie_embeddings={self.tie_embeddings!r}: use True or False")
        return self


# The published checkpoints' shapes (config.json of google/gemma-3-*-pt; the 4B and larger in text_config), trained
# here at 4,096 tokens a row, in bfloat16, the loss in chunks.
_GEMMA3 = dict(seq_len=4096, norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_theta=10_000.0, global_every=6,
               compute_dtype="bfloat16", loss_chunk_size=LOSS_CHUNK)
_LARGE = dict(_GEMMA3, vocab_size=262208, sliding_window=1024, rope_linear_factor=8.0, remat="full")
GEMMA3_PRESETS: dict[str, dict[str, Any]] = {
    # Tests: bytes, a window of 8 within 64 positions, five sliding layers then one global, each kind its own base.
    "gemma3-tiny": dict(vocab_size=256, seq_len=64, d_model=64, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=16,
                        d_mlp=128, sliding_window=8, global_every=6, rope_theta=1_000_000.0, rope_local_theta=10_000.0),
    "gemma3-1b": dict(_GEMMA3, vocab_size=262144, d_model=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256,
                      d_mlp=6912, sliding_window=512, query_pre_attn_scalar=256.0, remat="save_dots"),
    "gemma3-4b": dict(_LARGE, d_model=2560, n_layers=34, n_heads=8, n_kv_heads=4, head_dim=256, d_mlp=10240,
                      query_pre_attn_scalar=256.0),
    "gemma3-12b": dict(_LARGE, d_model=3840, n_layers=48, n_heads=16, n_kv_heads=8, head_dim=256, d_mlp=15360,
                       query_pre_attn_scalar=256.0),
    "gemma3-27b": dict(_LARGE, d_model=5376, n_layers=62, n_heads=32, n_kv_heads=16, head_dim=128, d_mlp=21504,
                       query_pre_attn_scalar=168.0),
}
