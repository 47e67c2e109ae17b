"""Model shape and numerics (a frozen dataclass) and the named presets, from a test-sized model to 7B."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

REMAT_POLICIES = ("none", "full", "save_dots")
DTYPES = ("float32", "bfloat16", "float16")


class ModelConfigError(ValueError):
    """A model setting the user can fix; the message is one line naming the setting."""


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 8
    n_heads: int = 8
    mlp_ratio: int = 4
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"  # none | full | save_dots

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_mlp(self) -> int:
        return self.d_model * self.mlp_ratio

    def validate(self) -> "GPTConfig":
        for key in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, key) < 1:
                raise ModelConfigError(f"model.{key}={getattr(self, key)}: must be a positive integer")
        if self.d_model % self.n_heads:
            raise ModelConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; change one of them")
        if self.head_dim % 2:
            raise ModelConfigError(
                f"model.d_model/model.n_heads={self.head_dim}: rotary embeddings need an even head dimension")
        for key in ("param_dtype", "compute_dtype"):
            if getattr(self, key) not in DTYPES:
                raise ModelConfigError(f"model.{key}={getattr(self, key)!r}: use one of {', '.join(DTYPES)}")
        if self.remat not in REMAT_POLICIES:
            raise ModelConfigError(f"model.remat={self.remat!r}: use one of {', '.join(REMAT_POLICIES)}")
        return self


# Presets. GPU presets compute in bfloat16 with float32 master weights.
PRESETS: dict[str, dict[str, Any]] = {
    # Tests: 1.6M parameters, every width divisible by 8 so every 8-device layout applies.
    "tiny": dict(vocab_size=256, seq_len=64, d_model=128, n_layers=8, n_heads=8, mlp_ratio=4),
    # The CPU default: trains visibly on the byte-level corpus within minutes on 2 cores.
    "small": dict(vocab_size=256, seq_len=128, d_model=192, n_layers=4, n_heads=8, mlp_ratio=4),
    # GPT-2 small/medium (Radford et al. 2019) with the vocabulary padded to a multiple of 64.
    "gpt2-125m": dict(vocab_size=50304, seq_len=1024, d_model=768, n_layers=12, n_heads=12,
                      compute_dtype="bfloat16"),
    "gpt2-350m": dict(vocab_size=50304, seq_len=1024, d_model=1024, n_layers=24, n_heads=16,
                      compute_dtype="bfloat16"),
    # GPT-3 XL shape (Brown et al. 2020, Table 2.1).
    "gpt3-1.3b": dict(vocab_size=50304, seq_len=2048, d_model=2048, n_layers=24, n_heads=16,
                      compute_dtype="bfloat16", remat="save_dots"),
    # A LLaMA-7B-like shape (Touvron et al. 2023) with a GELU MLP of ratio 4: 6.9B parameters.
    "7b": dict(vocab_size=32000, seq_len=2048, d_model=4096, n_layers=32, n_heads=32,
               compute_dtype="bfloat16", remat="full"),
}


def from_dict(values: Mapping[str, Any]) -> GPTConfig:
    """Build from a config section: `preset` first, then any explicit field overrides it."""
    values = dict(values)
    preset = values.pop("preset", None) or None
    fields = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ModelConfigError(f"model.preset={preset!r}: unknown preset; use one of {', '.join(PRESETS)}")
        fields.update(PRESETS[preset])
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    for key, value in values.items():
        if key not in known:
            raise ModelConfigError(f"model.{key}: unknown model setting; use one of {', '.join(sorted(known))}")
        if value is not None:
            fields[key] = value
    return GPTConfig(**fields).validate()
