"""The GPT family's config (the shared fields plus an MLP width ratio) and its presets, from test-sized
models to GPT-2, GPT-3 XL and a LLaMA-7B-like shape."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from models.config import LOSS_CHUNK, SharedFields, check_common


@dataclasses.dataclass(frozen=True)
class GPTConfig(SharedFields):
    family: ClassVar[str] = "gpt"
    mlp_ratio: int = 4

    @property
    def d_mlp(self) -> int:
        return self.d_model * self.mlp_ratio

    def validate(self) -> "GPTConfig":
        check_common(self, ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"))
        return self


# GPU presets compute in bfloat16 with float32 master weights and the loss in chunks (models/config.LOSS_CHUNK).
GPT_PRESETS: dict[str, dict[str, Any]] = {
    # Tests: 1.6M parameters, every width divisible by 8 so every 8-device layout applies.
    "tiny": dict(vocab_size=256, seq_len=64, d_model=128, n_layers=8, n_heads=8, mlp_ratio=4),
    # Tests of the mixture of experts: tiny's widths, 4 blocks of which every 2nd routes over 8 experts (top-2).
    "moe-tiny": dict(vocab_size=256, seq_len=64, d_model=128, n_layers=4, n_heads=8, mlp_ratio=2, n_experts=8,
                     experts_per_token=2, moe_every=2),
    # The CPU default: trains visibly on the byte-level corpus within minutes on 2 cores.
    "small": dict(vocab_size=256, seq_len=128, d_model=192, n_layers=4, n_heads=8, mlp_ratio=4),
    # GPT-2 small/medium (Radford et al. 2019) with the vocabulary padded to a multiple of 64.
    "gpt2-125m": dict(vocab_size=50304, seq_len=1024, d_model=768, n_layers=12, n_heads=12,
                      compute_dtype="bfloat16", loss_chunk_size=LOSS_CHUNK),
    "gpt2-350m": dict(vocab_size=50304, seq_len=1024, d_model=1024, n_layers=24, n_heads=16,
                      compute_dtype="bfloat16", loss_chunk_size=LOSS_CHUNK),
    # GPT-3 XL shape (Brown et al. 2020, Table 2.1).
    "gpt3-1.3b": dict(vocab_size=50304, seq_len=2048, d_model=2048, n_layers=24, n_heads=16,
                      compute_dtype="bfloat16", remat="save_dots", loss_chunk_size=LOSS_CHUNK),
    # A LLaMA-7B-like shape (Touvron et al. 2023) with a GELU MLP of ratio 4: 6.9B parameters.
    "7b": dict(vocab_size=32000, seq_len=2048, d_model=4096, n_layers=32, n_heads=32,
               compute_dtype="bfloat16", remat="full", loss_chunk_size=LOSS_CHUNK),
}
