"""One layer declared as data: its attention kind (causal over the whole sequence, a sliding window, or a compressed
latent cache), its rotary embedding, and a dense or expert MLP. A family gives one `LayerSpec` per layer
(`Family.layer_specs`); the training stack, each pipeline stage, context parallelism, the paged decode and its cache,
and the planner all read them, so a pattern such as Gemma 3's five sliding layers to one global layer, gpt-oss's
alternation or DeepSeek-V3's dense layers before its expert layers is a list, not code.

    Gemma 3:     LayerSpec("sliding", window=1024, rope=Rope(10_000.0)) x5, then
                 LayerSpec("causal", rope=Rope(1_000_000.0, "linear", factor=8.0))
    gpt-oss:     LayerSpec("sliding", window=128, ...) and LayerSpec("causal", ...) alternating, mlp="experts"
    DeepSeek-V3: LayerSpec("latent", latent_rank=512, rope_dim=64, rope=Rope(...yarn...)), mlp="dense" x3, then
                 mlp="experts"
"""
from __future__ import annotations

import dataclasses

ATTENTION_KINDS = ("causal", "sliding", "latent")
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
MLP_KINDS = ("dense", "experts")


@dataclasses.dataclass(frozen=True)
class Rope:
    """A layer's rotary embedding (Su et al. 2021): base `theta` and its scaling. `linear` divides every frequency by
    `factor` (position interpolation, Gemma 3's global layers); `llama3` divides the low frequencies by `factor` and
    interpolates the band between `original_context / low_freq_factor` and `original_context / high_freq_factor`
    wavelengths (Llama 3.1); `yarn` (Peng et al. 2023, DeepSeek-V2/V3) divides the dimensions that turn fewer than
    `beta_slow` times over `original_context` positions by `factor`, keeps those that turn more than `beta_fast` times
    and ramps linearly between, and scales the rotated dimensions by mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) (models/layers.rope_attention_factor; 1 for DeepSeek's published configs)."""
    theta: float = 10_000.0
    scaling: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer. `attention`: `causal` (every earlier position), `sliding` (the `window` latest positions, the
    query's own included: a query at i sees keys i - window < j <= i), or `latent` (keys and values rebuilt from one
    cached latent of `latent_rank` numbers per token, plus a shared rotary key). `rope`: the rotary embedding, None
    for a model without one (learned absolute positions); `rope_dim`: the rotated dimensions of a head, 0 for all of
    them. `mlp`: a dense MLP or a mixture of experts."""
    attention: str = "causal"
    window: int = 0
    latent_rank: int = 0
    rope: Rope | None = Rope()
    rope_dim: int = 0
    mlp: str = "dense"

    def __post_init__(self):
        assert self.attention in ATTENTION_KINDS, self.attention
        assert (self.attention == "sliding") == (self.window > 0), (self.attention, self.window)
        assert (self.attention == "latent") == (self.latent_rank > 0), (self.attention, self.latent_rank)
        assert self.rope is None or self.rope.scaling in ROPE_SCALINGS, self.rope
        assert self.mlp in MLP_KINDS, self.mlp

    @property
    def attention_kind(self) -> "LayerSpec":
        """The spec without its MLP: layers whose attention runs the same program share it."""
        return dataclasses.replace(self, mlp="dense")


def attention_kinds(specs: tuple[LayerSpec, ...]) -> tuple[LayerSpec, ...]:
    """The distinct attention kinds of `specs`, in order of first appearance (what a stack dispatches on)."""
    return tuple(dict.fromkeys(s.attention_kind for s in specs))


def attended_keys(spec: LayerSpec, seq_len: int) -> float:
    """The keys a query of a `seq_len` row attends, counted as FLOP counts count causal attention: seq_len for a
    causal layer (PaLM's 12 * layers * heads * head_dim * seq_len counts the whole score matrix, twice the mean of
    seq_len / 2 keys a causal query sees); for a sliding window w < seq_len twice its mean, w (1 - (w - 1) / (2 L))."""
    if spec.attention != "sliding" or spec.window >= seq_len:
        return float(seq_len)
    w = spec.window
    return 2.0 * w * (1.0 - (w - 1) / (2.0 * seq_len))


def window_pages(window: int, page_size: int) -> int:
    """The most pages a sliding layer's cache holds for one sequence between steps: the window's positions span at
    most ceil(window / page_size) + 1 pages, whatever the sequence's length."""
    return -(-window // page_size) + 1
