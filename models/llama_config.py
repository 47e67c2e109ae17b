"""The Llama-3 family's config and presets with the published shapes (Llama 3.1 / 3.2 model cards and
their Hugging Face config.json files), plus a test-sized `llama3-tiny` on the byte vocabulary.

Qwen3 (dense) is this family with two options rather than a family of its own: its block is Llama's (RMSNorm,
GQA with rotary positions, SwiGLU) except for a per-head RMSNorm on queries and keys before the rotation
(`qk_norm`) and a head dimension set apart from d_model/n_heads (`head_dim`)."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from models.config import LOSS_CHUNK, ModelConfigError, SharedFields, check_common, described

# Llama 3.1's rotary frequency scaling: (factor, low_freq_factor, high_freq_factor, original context).
ROPE_SCALING_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def parse_rope_scaling(value: Any) -> tuple[float, float, float, int] | None:
    """None / "" / "none" -> no scaling; "8,1,4,8192", a 4-sequence or a dict with ROPE_SCALING_FIELDS -> a tuple."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    try:
        if isinstance(value, dict):
            value = [value[k] for k in ROPE_SCALING_FIELDS]
        elif isinstance(value, str):
            value = value.split(",")
        factor, low, high, context = (float(v) for v in value)
    except (KeyError, TypeError, ValueError):
        raise ModelConfigError(f"model.rope_scaling={value!r}: use 'FACTOR,LOW_FREQ_FACTOR,HIGH_FREQ_FACTOR,"
                               f"ORIGINAL_CONTEXT' (e.g. '8,1,4,8192') or 'none'") from None
    if not (factor >= 1 and 0 < low < high and context >= 1):
        raise ModelConfigError(f"model.rope_scaling={value!r}: need factor >= 1, 0 < low_freq_factor < "
                               f"high_freq_factor and a positive original context")
    return factor, low, high, int(context)


@dataclasses.dataclass(frozen=True)
class LlamaConfig(SharedFields):
    family: ClassVar[str] = "llama"
    norm_eps: float = described(1e-5, "the epsilon of every norm")
    n_kv_heads: int = described(4, "key/value heads (grouped-query attention)")
    d_mlp: int = described(384, "the SwiGLU MLP's width")
    rope_theta: float = described(500000.0, "the rotary embeddings' base frequency")
    rope_scaling: Any = described(None, "Llama 3.1's rotary scaling FACTOR,LOW_FREQ_FACTOR,HIGH_FREQ_FACTOR,"
                                        "ORIGINAL_CONTEXT (e.g. 8,1,4,8192), or none")
    tie_embeddings: bool = described(False, "the output head reuses the embedding matrix")
    qk_norm: bool = described(False, "a per-head RMSNorm on queries and keys before the rotary embedding (Qwen3)")
    head_dim: int = described(0, "each attention head's width; 0: d_model/n_heads")

    def __post_init__(self):
        object.__setattr__(self, "rope_scaling", parse_rope_scaling(self.rope_scaling))
        # Stored resolved, so every reader of cfg.head_dim (the shared property elsewhere) sees the width itself.
        if self.head_dim == 0 and isinstance(self.n_heads, int) and self.n_heads > 0:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)

    def validate(self) -> "LlamaConfig":
        if not isinstance(self.head_dim, int) or isinstance(self.head_dim, bool) or self.head_dim < 1:
            raise ModelConfigError(f"model.head_dim={self.head_dim!r}: each head's width, an integer >= 1 "
                                   f"(0: d_model/n_heads)")
        check_common(self, ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_mlp"))
        if self.n_heads % self.n_kv_heads:
            raise ModelConfigError(f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads="
                                   f"{self.n_kv_heads}; grouped-query attention shares each kv head by a whole group")
        if not self.rope_theta > 0:
            raise ModelConfigError(f"model.rope_theta={self.rope_theta}: must be a positive number")
        if not isinstance(self.tie_embeddings, bool):
            raise ModelConfigError(f"model.tie_embeddings={self.tie_embeddings!r}: use True or False")
        if not isinstance(self.qk_norm, bool):
            raise ModelConfigError(f"model.qk_norm={self.qk_norm!r}: use True or False")
        return self


_LLAMA3 = dict(vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0, compute_dtype="bfloat16",
               loss_chunk_size=LOSS_CHUNK)
_QWEN3 = dict(vocab_size=151936, seq_len=2048, head_dim=128, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
              compute_dtype="bfloat16", loss_chunk_size=LOSS_CHUNK)
LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    # Tests: bytes, every width divisible by 4 so tensor=2 and tensor=4 layouts apply (n_kv_heads=4).
    "llama3-tiny": dict(vocab_size=256, seq_len=64, d_model=128, n_layers=8, n_heads=8, n_kv_heads=4, d_mlp=384,
                        tie_embeddings=True),
    # About 100M parameters (100.7M, embeddings tied) with Llama 3's blocks: the serving benchmark's CPU-sized model.
    "llama3-100m": dict(_LLAMA3, vocab_size=32768, seq_len=1024, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4,
                        d_mlp=2048, tie_embeddings=True, compute_dtype="float32"),
    "llama3.2-1b": dict(_LLAMA3, seq_len=2048, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_mlp=8192,
                        rope_scaling=(32.0, 1.0, 4.0, 8192), tie_embeddings=True, remat="save_dots"),
    "llama3.2-3b": dict(_LLAMA3, seq_len=2048, d_model=3072, n_layers=28, n_heads=24, n_kv_heads=8, d_mlp=8192,
                        rope_scaling=(32.0, 1.0, 4.0, 8192), tie_embeddings=True, remat="save_dots"),
    "llama3.1-8b": dict(_LLAMA3, seq_len=2048, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_mlp=14336,
                        rope_scaling=(8.0, 1.0, 4.0, 8192), remat="full"),
    "llama3.1-70b": dict(_LLAMA3, seq_len=2048, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_mlp=28672,
                         rope_scaling=(8.0, 1.0, 4.0, 8192), remat="full"),
    # Mixtral 8x7B (Jiang et al. 2024): Mistral 7B's shape with 8 SwiGLU experts per block, top-2; 46.7B parameters,
    # 12.9B active per token.
    "mixtral-8x7b": dict(vocab_size=32000, seq_len=2048, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         d_mlp=14336, norm_eps=1e-5, rope_theta=1e6, compute_dtype="bfloat16", remat="full",
                         loss_chunk_size=LOSS_CHUNK, n_experts=8, experts_per_token=2),
    # Qwen3 (Qwen/Qwen3-*/config.json): q/k norms, head_dim 128 apart from d_model/n_heads for the two smaller.
    "qwen3-tiny": dict(vocab_size=256, seq_len=64, d_model=128, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32,
                       d_mlp=384, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, tie_embeddings=True),
    "qwen3-0.6b": dict(_QWEN3, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, d_mlp=3072, tie_embeddings=True,
                       remat="save_dots"),
    "qwen3-1.7b": dict(_QWEN3, d_model=2048, n_layers=28, n_heads=16, n_kv_heads=8, d_mlp=6144, tie_embeddings=True,
                       remat="save_dots"),
    "qwen3-8b": dict(_QWEN3, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, d_mlp=12288, remat="full"),
    # Mixtures as Hugging Face has them: an expert layer in every block, dropless, no z-loss, the published
    # router_aux_loss_coef. Qwen3-30B-A3B: 128 experts of width 768, top-8 renormalized (norm_topk_prob).
    "qwen3-30b-a3b": dict(_QWEN3, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, d_mlp=768, n_experts=128,
                          experts_per_token=8, router="topk_softmax", load_balance_weight=1e-3,
                          router_z_loss_weight=0.0, remat="full"),
    "qwen3-moe-tiny": dict(vocab_size=256, seq_len=64, d_model=128, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=32,
                           d_mlp=96, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, n_experts=4, experts_per_token=2,
                           router="softmax", load_balance_weight=1e-3, router_z_loss_weight=0.0),
    "mixtral-tiny": dict(vocab_size=256, seq_len=64, d_model=128, n_layers=2, n_heads=8, n_kv_heads=4, d_mlp=96,
                         rope_theta=1e6, n_experts=4, experts_per_token=2, router="topk_softmax",
                         load_balance_weight=0.02, router_z_loss_weight=0.0),
}
