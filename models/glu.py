"""Gated MLPs (Shazeer 2020), shared by the families that use them: act(x W_gate) * (x W_up), then W_down; SwiGLU
(SiLU: Llama, Qwen3, Mixtral's experts) or GeGLU (tanh GELU: Gemma 3). The gate and up projections are stored
fused, w_in [D, 2, F], and w_down [F, D]; an expert layer's [E, D, 2, F] and [E, F, D]."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models import lora
from models.contract import Hooks, Params
from models.layers import param, weight
from models.protocols import TransformerConfig

AXES = {"w_in": ("embed", None, "mlp"), "w_down": ("mlp", "embed")}
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def declare(layer: nnx.Module, cfg: TransformerConfig, rngs: nnx.Rngs, lead: tuple, out_std: float,
            width: int = 0) -> None:
    """The MLP matrices of a stacked layer module, with the `lead` (sizes, logical axes) of its stack; `width` F
    (0: d_mlp)."""
    S, A = lead
    D, F, dt = cfg.d_model, width or cfg.d_mlp, jnp.dtype(cfg.param_dtype)
    layer.w_in = param(rngs, (*S, D, 2, F), (*A, *AXES["w_in"]), dt, 0.02)
    layer.w_down = param(rngs, (*S, F, D), (*A, *AXES["w_down"]), dt, out_std)


class Experts(nnx.Module):
    """G groups' gated experts: w_in [G, E, D, 2, F] (gate and up), w_down [G, E, F, D]; F `width` (0: d_mlp), the
    leading axis's logical name `lead` (a stack's `layers`; None outside the stack)."""

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs, G: int, width: int = 0, lead: str | None = "layers"):
        E, D, F, dt = cfg.n_experts, cfg.d_model, width or cfg.d_mlp, jnp.dtype(cfg.param_dtype)
        self.w_in = param(rngs, (G, E, D, 2, F), (lead, "experts", "embed", None, "mlp"), dt, 0.02)
        self.w_down = param(rngs, (G, E, F, D), (lead, "experts", "mlp", "embed"), dt,
                            0.02 / math.sqrt(2 * cfg.n_layers))


def mlp(p: Params, h_BxLxD: jax.Array, cfg: TransformerConfig, hooks: Hooks, activation: str) -> jax.Array:
    # [B, L, 2, F], the weight's own order of free dimensions: "tblf" made XLA's CPU backend transpose the whole
    # weight in every call, a copy that dominated a decode step.
    gate_up = jnp.einsum("bld,dtf->bltf", h_BxLxD, weight(p, "w_in", AXES, cfg.compute_dtype, hooks))
    gate_up = hooks(lora.add(gate_up, p, "mlp_in", h_BxLxD, cfg), ("batch", "seq", None, "mlp"))
    u_BxLxF = hooks(ACTIVATIONS[activation](gate_up[:, :, 0]) * gate_up[:, :, 1], ("batch", "seq", "mlp"))
    down = jnp.einsum("blf,fd->bld", u_BxLxF, weight(p, "w_down", AXES, cfg.compute_dtype, hooks))
    return lora.add(down, p, "mlp_out", u_BxLxF, cfg)


def expert_mlp(w: Params, x_ExNxD: jax.Array, cfg: TransformerConfig, activation: str) -> jax.Array:
    """Each expert's gated MLP on its own rows."""
    cdt = jnp.dtype(cfg.compute_dtype)
    gate_up = jnp.einsum("end,edtf->entf", x_ExNxD, w["w_in"].astype(cdt))  # the weight's order, as in mlp
    u_ExNxF = ACTIVATIONS[activation](gate_up[:, :, 0]) * gate_up[:, :, 1]
    return jnp.einsum("enf,efd->end", u_ExNxF, w["w_down"].astype(cdt))


def projections(cfg: TransformerConfig) -> dict[str, lora.Projection]:
    """What the `mlp` LoRA target adapts: w_in (gate and up together, [D -> 2, F]) and w_down."""
    D, F = cfg.d_model, cfg.d_mlp
    return {"mlp_in": lora.Projection("w_in", (), (D,), ("embed",), (2, F), (None, "mlp")),
            "mlp_out": lora.Projection("w_down", (), (F,), ("mlp",), (D,), ("embed",))}


def saved_width(cfg: TransformerConfig) -> int:
    """Activations a layer keeps per token: gate, up and their product (F each)."""
    return 3 * cfg.d_mlp
