"""The layer stack both families run as their `run_layers`: packed-document segments and rotary positions from
the inputs (or a context-parallel layout's global order), then one scanned, rematerialized block per layer, or,
for a mixture of experts, the groups of models/moe.py. A family lends its block, attention and expert MLP."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from models import documents, lora, moe
from models.contract import Constrain, LayerAux, Params
from models.layers import remat, rms_norm
from models.protocols import ModelConfig


def run_stack(layers: Params, x_BxLxD: jax.Array, inputs_BxL: jax.Array, cfg: ModelConfig, constrain: Constrain,
              block: Callable, attention: Callable, expert_mlp: Callable):
    """Apply a stack (or any contiguous slice of it). `block(p, x, segment_ids, positions) -> x` is one dense
    layer, `attention(p, h, segment_ids, positions) -> out` its attention on the normed input, `expert_mlp(w,
    x_ExNxD, cfg) -> y_ExNxD` one expert's MLP. Returns (x, aux): 0.0 for a dense stack (it adds nothing to the
    loss), the router's losses and statistics for a mixture (moe.run_groups)."""
    layers = lora.freeze(layers, cfg)
    segment_ids, positions = segments_and_positions(inputs_BxL, x_BxLxD.shape[1], cfg, constrain)

    def dense(p, x):
        return block(p, x, segment_ids, positions)

    if moe.is_moe(cfg):
        def attention_residual(p, x):
            return x + attention(p, rms_norm(x, p["attn_norm"], cfg.norm_eps), segment_ids, positions)
        return moe.run_groups(layers, x_BxLxD, cfg, constrain, dense, attention_residual,
                              lambda w, x: expert_mlp(w, x, cfg))
    body = remat(dense, cfg.remat)
    x_BxLxD, _ = jax.lax.scan(lambda x, p: (body(p, x), None), x_BxLxD, layers)
    return x_BxLxD, None


def segments_and_positions(inputs_BxL: jax.Array, length: int, cfg: ModelConfig,
              constrain: Constrain) -> tuple[jax.Array | None, jax.Array | None]:
    """Packed documents' (segment ids, positions) of the `length` positions the stack runs. A context-parallel
    layout's permuted sequence keeps its global rotary positions; its documents are found in the global order
    (they run along it) and their ids and positions permuted like the inputs. `inputs_BxL` is the stack's own
    sequence (L = length), or, where it runs a slice of each row (a pipeline cell under context parallelism), the
    whole rows in order (L > length): the positions are then the slice's and the segment ids the whole rows' in
    order, for the layout's attention to read every block's ids."""
    order = constrain.context_order(length)
    if order is None:
        return documents.segments(inputs_BxL, cfg)
    whole = inputs_BxL.shape[1] > length
    segment_ids, positions = documents.segments(
        inputs_BxL if whole else jnp.take(inputs_BxL, jnp.argsort(order), axis=1), cfg)
    if segment_ids is None:
        return None, order
    return (segment_ids if whole else jnp.take(segment_ids, order, axis=1)), jnp.take(positions, order, axis=1)


def layer_aux(x_BxLxD: jax.Array, stats: dict | None) -> tuple[jax.Array, LayerAux]:
    """`run_stack`'s result as the contract's `run_layers` returns it: (x, (aux loss, metrics)); a dense stack
    adds 0 to the objective and logs nothing, a mixture its weighted router losses and moe.log_fields."""
    if stats is None:
        return x_BxLxD, (jnp.zeros((), jnp.float32), {})
    return x_BxLxD, (stats["aux_loss"], moe.log_fields(stats))
