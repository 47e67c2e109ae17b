"""The GPT family's config (the shared fields, an MLP width ratio and the options that make it GPT-2's
architecture) and its presets, from test-sized models to GPT-2, GPT-3 XL and a LLaMA-7B-like shape."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from mesh.numbers import ceil_div
from models.config import LOSS_CHUNK, ModelConfigError, SharedFields, check_common, described

POSITIONS = ("rotary", "learned")
NORMS = ("rmsnorm", "layernorm")
ACTIVATIONS = ("gelu_tanh", "gelu")


@dataclasses.dataclass(frozen=True)
class GPTConfig(SharedFields):
    """The defaults are this project's GPT (RMSNorm, rotary positions, no biases, an untied head, the tanh GELU);
    GPT-2's architecture (the `gpt2` preset, HF GPT2LMHeadModel) is positions=learned (a table of max_positions
    rows, 0: seq_len), bias=True (every projection), norm=layernorm (scale and bias), tie_embeddings=True.
    activation: gelu_tanh (GPT-2's gelu_new) or gelu (the exact erf form). vocab_multiple: the embedding table
    (and an untied head) has vocab_size rounded up to a multiple of it (GPT-2's 50,257 ids in 50,304 rows); the
    padded rows' logits are -inf, so nothing samples or scores them."""
    family: ClassVar[str] = "gpt"
    mlp_ratio: int = described(4, "the MLP's width as a multiple of d_model")
    positions: str = described("rotary", "rotary, or learned (GPT-2's table of absolute positions, max_positions rows)")
    max_positions: int = described(0, "rows of the learned position table; 0: seq_len")
    bias: bool = described(False, "a bias in every projection (GPT-2's)")
    norm: str = described("rmsnorm", "rmsnorm, or layernorm (GPT-2's, with a bias)")
    tie_embeddings: bool = described(False, "the output head reuses the embedding matrix")
    activation: str = described("gelu_tanh", "the MLP's GELU: gelu_tanh (GPT-2's gelu_new) or gelu (the exact erf "
                                             "form)")
    vocab_multiple: int = described(1, "the embedding table has vocab_size rounded up to a multiple of it (gpt2: 64); "
                                       "the padded rows' logits are -inf")

    @property
    def d_mlp(self) -> int:
        return self.d_model * self.mlp_ratio

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding table: vocab_size padded to a multiple of vocab_multiple."""
        return ceil_div(self.vocab_size, self.vocab_multiple) * self.vocab_multiple

    @property
    def position_rows(self) -> int:
        """Rows of the learned position table."""
        return self.max_positions or self.seq_len

    def validate(self) -> "GPTConfig":
        check_common(self, ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"))
        for key, allowed in (("positions", POSITIONS), ("norm", NORMS), ("activation", ACTIVATIONS)):
            if getattr(self, key) not in allowed:
                raise ModelConfigError(f"model.{key}={getattr(self, key)!r}: use one of {', '.join(allowed)}")
        for key in ("bias", "tie_embeddings"):
            if not isinstance(getattr(self, key), bool):
                raise ModelConfigError(f"model.{key}={getattr(self, key)!r}: use True or False")
        self._check_sizes()
        if self.n_experts and (self.bias or self.norm != "rmsnorm"):
            raise ModelConfigError(f"model.n_experts={self.n_experts} with model.bias={self.bias}, model.norm="
                                   f"{self.norm}: a mixture of experts is built with rmsnorm and no biases; set "
                                   f"model.n_experts=0 or model.bias=False and model.norm=rmsnorm")
        return self

    def _check_sizes(self) -> None:
        """The position table and the padded vocabulary."""
        if not isinstance(self.max_positions, int) or self.max_positions < 0:
            raise ModelConfigError(f"model.max_positions={self.max_positions!r}: an integer >= 0 (0: model.seq_len)")
        if self.max_positions and self.positions != "learned":
            raise ModelConfigError(f"model.max_positions={self.max_positions} sizes the learned position table; "
                                   f"set model.positions=learned or model.max_positions=0")
        if self.positions == "learned" and self.seq_len > self.position_rows:
            raise ModelConfigError(f"model.seq_len={self.seq_len} is longer than model.max_positions="
                                   f"{self.max_positions} (the learned position table); lower one or raise the other")
        if not isinstance(self.vocab_multiple, int) or isinstance(self.vocab_multiple, bool) or self.vocab_multiple < 1:
            raise ModelConfigError(f"model.vocab_multiple={self.vocab_multiple!r}: an integer >= 1 (the embedding "
                                   f"table's rows are model.vocab_size rounded up to a multiple of it; 1: no padding)")


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
    # GPT-2 small's architecture (HF GPT2LMHeadModel, `restore_from=hf:DIR` and train.export_hf): LayerNorm, learned
    # positions, biases, a tied head; its 50,257 ids in a table padded to a multiple of 64.
    "gpt2": dict(vocab_size=50257, vocab_multiple=64, seq_len=1024, d_model=768, n_layers=12, n_heads=12, mlp_ratio=4,
                 positions="learned", max_positions=1024, bias=True, norm="layernorm", norm_eps=1e-5,
                 tie_embeddings=True, activation="gelu_tanh", compute_dtype="bfloat16", loss_chunk_size=LOSS_CHUNK),
    # GPT-3 XL shape (Brown et al. 2020, Table 2.1).
    "gpt3-1.3b": dict(vocab_size=50304, seq_len=2048, d_model=2048, n_layers=24, n_heads=16,
                      compute_dtype="bfloat16", remat="save_dots", loss_chunk_size=LOSS_CHUNK),
    # A LLaMA-7B-like shape (Touvron et al. 2023) with a GELU MLP of ratio 4: 6.9B parameters.
    "7b": dict(vocab_size=32000, seq_len=2048, d_model=4096, n_layers=32, n_heads=32,
               compute_dtype="bfloat16", remat="full", loss_chunk_size=LOSS_CHUNK),
}
