"""The DeepSeek family's config (DeepSeek-V2/V3 and the models built on V3's shape, e.g. Moonlight) and its presets,
from the published config.json files of deepseek-ai/DeepSeek-V3, deepseek-ai/DeepSeek-V2-Lite and
moonshotai/Moonlight-16B-A3B, plus a test-sized `deepseek-v3-tiny`."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from models.config import LOSS_CHUNK, ModelConfigError, SharedFields, check_common, described

SCORING = ("sigmoid", "softmax")
# YaRN's settings in config.json's rope_scaling, in the order the tuple form takes them.
YARN_FIELDS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.0, "mscale_all_dim": 0.0}


def parse_yarn(value: Any) -> tuple[float, int, float, float, float, float] | None:
    """None / "" / "none" -> no scaling; config.json's YaRN dict, a 6-sequence or "FACTOR,ORIGINAL_CONTEXT,
    BETA_FAST,BETA_SLOW,MSCALE,MSCALE_ALL_DIM" -> a tuple in YARN_FIELDS' order."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    try:
        if isinstance(value, dict):
            kind = value.get("rope_type", value.get("type", "yarn"))
            if kind != "yarn":
                raise ModelConfigError(f"model.rope_scaling type {kind!r}: only yarn (DeepSeek's) is built here")
            value = [value[k] if k in value or k not in YARN_DEFAULTS else YARN_DEFAULTS[k] for k in YARN_FIELDS]
        elif isinstance(value, str):
            value = value.split(",")
        factor, context, fast, slow, mscale, all_dim = (float(v or 0) for v in value)
    except (KeyError, TypeError, ValueError):
        raise ModelConfigError(f"model.rope_scaling={value!r}: use 'FACTOR,ORIGINAL_CONTEXT,BETA_FAST,BETA_SLOW,"
                               f"MSCALE,MSCALE_ALL_DIM' (e.g. '40,4096,32,1,1,1', YaRN) or 'none'") from None
    if not (factor >= 1 and context >= 1 and fast > slow > 0):
        raise ModelConfigError(f"model.rope_scaling={value!r}: need factor >= 1, a positive original context and "
                               f"beta_fast > beta_slow > 0")
    return factor, int(context), fast, slow, mscale, all_dim


@dataclasses.dataclass(frozen=True)
class DeepSeekConfig(SharedFields):
    """DeepSeek-V3 (Liu et al. 2024): multi-head latent attention (queries through an optional low rank
    `q_lora_rank`, keys and values rebuilt from one `kv_lora_rank` latent per token, a shared rotary key of
    `qk_rope_head_dim` beside each head's `qk_nope_head_dim`, values of `v_head_dim`), `first_k_dense_replace` dense
    layers of width `d_mlp`, then mixture layers of `n_experts` routed experts of width `moe_d_mlp` and
    `n_shared_experts` shared ones; the balancing bias moved by `bias_update_speed` after each step; and
    `num_nextn_predict_layers` multi-token prediction modules trained with weight `mtp_loss_weight`."""
    family: ClassVar[str] = "deepseek"
    norm_eps: float = described(1e-6, "the epsilon of every norm")
    d_mlp: int = described(256, "the dense layers' SwiGLU width (config.json's intermediate_size)")
    moe_d_mlp: int = described(64, "each expert's SwiGLU width (moe_intermediate_size)")
    n_experts: int = described(8, "routed experts of each mixture layer (n_routed_experts)")
    n_shared_experts: int = described(1, "shared experts every token runs through, beside the routed ones")
    first_k_dense_replace: int = described(1, "dense layers before the mixture layers")
    scoring_func: str = described("sigmoid", "the router's scores: sigmoid (DeepSeek-V3, with the balancing bias) "
                                             "or softmax (DeepSeek-V2)")
    n_group: int = described(1, "groups of experts; a token chooses among the topk_group best groups")
    topk_group: int = described(1, "groups a token's experts come from")
    norm_topk_prob: bool = described(True, "the chosen experts' weights renormalized to sum to 1")
    routed_scaling_factor: float = described(1.0, "the routed experts' weights are scaled by it")
    bias_update_speed: float = described(1e-3, "the balancing bias moves this much per step against each expert's "
                                               "excess load (auxiliary-loss-free balancing); 0 freezes it")
    seq_balance_weight: float = described(0.0, "the weight of the sequence-wise balance loss in the objective")
    load_balance_weight: float = described(0.0, "the weight of the load-balancing loss in the objective (Switch)")
    router_z_loss_weight: float = described(0.0, "the weight of the router's z-loss in the objective (ST-MoE)")
    q_lora_rank: int = described(0, "the queries' low rank; 0: a plain query projection (DeepSeek-V2-Lite)")
    kv_lora_rank: int = described(64, "the latent's width: what a token caches beside its rotary key")
    qk_nope_head_dim: int = described(32, "each head's query/key dimensions without rotary embedding")
    qk_rope_head_dim: int = described(16, "the rotary query/key dimensions (the key's shared by every head)")
    v_head_dim: int = described(32, "each head's value width")
    rope_theta: float = described(10_000.0, "the rotary embeddings' base frequency")
    rope_scaling: Any = described(None, "YaRN: FACTOR,ORIGINAL_CONTEXT,BETA_FAST,BETA_SLOW,MSCALE,MSCALE_ALL_DIM "
                                        "(e.g. 40,4096,32,1,1,1), or none")
    num_nextn_predict_layers: int = described(0, "multi-token prediction modules (MTP), each predicting one token "
                                                 "further")
    mtp_loss_weight: float = described(0.0, "the MTP loss's weight in the objective (lambda); 0: off")
    tie_embeddings: bool = described(False, "the output head reuses the embedding matrix")

    def __post_init__(self):
        object.__setattr__(self, "rope_scaling", parse_yarn(self.rope_scaling))

    @property
    def head_dim(self) -> int:
        """A query/key head's width (what the attention kernels see)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def validate(self) -> "DeepSeekConfig":
        check_common(self, ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_mlp", "moe_d_mlp",
                            "n_experts", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                            "n_group", "topk_group"))
        for key in ("q_lora_rank", "n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ModelConfigError(f"model.{key}={value!r}: an integer >= 0")
        if self.first_k_dense_replace >= self.n_layers:
            raise ModelConfigError(f"model.first_k_dense_replace={self.first_k_dense_replace}: fewer than "
                                   f"model.n_layers={self.n_layers} (at least one mixture layer)")
        if self.moe_every != 1:
            raise ModelConfigError(f"model.moe_every={self.moe_every}: DeepSeek's layers after the dense ones are "
                                   f"all mixture layers; use 1")
        if self.scoring_func not in SCORING:
            raise ModelConfigError(f"model.scoring_func={self.scoring_func!r}: use one of {', '.join(SCORING)}")
        if self.n_experts % self.n_group or self.n_experts // self.n_group < 2 and self.n_group > 1:
            raise ModelConfigError(f"model.n_group={self.n_group}: must divide model.n_experts={self.n_experts} into "
                                   f"groups of at least 2 experts")
        if not 1 <= self.topk_group <= self.n_group or self.experts_per_token > self.topk_group * (
                self.n_experts // self.n_group):
            raise ModelConfigError(f"model.topk_group={self.topk_group}: from 1 to model.n_group={self.n_group}, and "
                                   f"its groups must hold model.experts_per_token={self.experts_per_token} experts")
        for key in ("bias_update_speed", "seq_balance_weight", "mtp_loss_weight", "routed_scaling_factor"):
            if not isinstance(getattr(self, key), (int, float)) or getattr(self, key) < 0:
                raise ModelConfigError(f"model.{key}={getattr(self, key)!r}: a number >= 0")
        if self.qk_rope_head_dim % 2:
            raise ModelConfigError(f"model.qk_rope_head_dim={self.qk_rope_head_dim}: rotary embeddings need an even "
                                   f"width")
        if self.num_nextn_predict_layers and self.mtp_loss_weight and self.document_eos_id >= 0:
            raise ModelConfigError(f"model.mtp_loss_weight={self.mtp_loss_weight} with data.document_mask: multi-token "
                                   f"prediction across packed documents is not built; set one of them off")
        if self.lora_rank:
            raise ModelConfigError(f"model.lora_rank={self.lora_rank}: the DeepSeek family takes no LoRA adapters "
                                   f"yet; use 0")
        return self


# The published checkpoints' shapes, trained here at 4,096 tokens a row in bfloat16, the loss in chunks.
_V3_YARN = (40.0, 4096, 32.0, 1.0, 1.0, 1.0)
_BIG = dict(seq_len=4096, compute_dtype="bfloat16", loss_chunk_size=LOSS_CHUNK, remat="full", rope_theta=10_000.0,
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
DEEPSEEK_PRESETS: dict[str, dict[str, Any]] = {
    # Tests: bytes; one dense layer then two mixture layers (stack of 2: pipeline=2 splits it), 8 experts in 2
    # groups with a shared one, queries through a low rank, YaRN, one MTP module; widths divisible by tensor=2.
    "deepseek-v3-tiny": dict(vocab_size=256, seq_len=64, d_model=64, n_layers=3, n_heads=4, d_mlp=128, moe_d_mlp=32,
                             n_experts=8, experts_per_token=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                             topk_group=1, routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=32,
                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                             rope_scaling=(4.0, 16, 32.0, 1.0, 1.0, 1.0), num_nextn_predict_layers=1,
                             mtp_loss_weight=0.3, seq_balance_weight=1e-4),
    # DeepSeek-V3 (671B, 37B active): 256 experts in 8 groups, 4 groups and 8 experts per token, one shared expert,
    # three dense layers, queries of rank 1536, one MTP module (lambda 0.3, gamma 0.001, alpha 1e-4: the paper's).
    "deepseek-v3-671b": dict(_BIG, vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, d_mlp=18432,
                             moe_d_mlp=2048, n_experts=256, experts_per_token=8, n_shared_experts=1,
                             first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                             q_lora_rank=1536, rope_scaling=_V3_YARN, num_nextn_predict_layers=1,
                             mtp_loss_weight=0.3, seq_balance_weight=1e-4),
    # DeepSeek-V2-Lite (16B, 2.4B active): softmax scores without a bias, top-6 of 64 unrenormalized, two shared
    # experts, plain queries; its expert-level balance loss (aux_loss_alpha) as the sequence-wise one (seq_aux).
    "deepseek-v2-lite": dict(_BIG, vocab_size=102400, d_model=2048, n_layers=27, n_heads=16, d_mlp=10944,
                             moe_d_mlp=1408, n_experts=64, experts_per_token=6, n_shared_experts=2,
                             first_k_dense_replace=1, scoring_func="softmax", norm_topk_prob=False,
                             rope_scaling=(40.0, 4096, 32.0, 1.0, 0.707, 0.707), seq_balance_weight=1e-3,
                             remat="save_dots"),
    # Moonlight-16B-A3B (Moonshot AI): DeepSeek-V3's architecture at V2-Lite's size, sigmoid scores with the bias.
    "moonlight-16b-a3b": dict(_BIG, vocab_size=163840, seq_len=8192, d_model=2048, n_layers=27, n_heads=16,
                              d_mlp=11264, moe_d_mlp=1408, n_experts=64, experts_per_token=6, n_shared_experts=2,
                              first_k_dense_replace=1, routed_scaling_factor=2.446, rope_theta=50_000.0, norm_eps=1e-5,
                              seq_balance_weight=1e-3, remat="save_dots"),
}
