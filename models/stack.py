"""The layer stack as the built-in transformer families declare and train it: its parameters (stacked dense layers, or
a mixture's groups, models/moe.py; LoRA adapters beside them), and `runner`, the contract's run_layers for a
family's Block: packed-document segments and rotary positions from the inputs (or a context-parallel layout's
global order), then one scanned, rematerialized layer per stack entry, each running its own LayerSpec's attention
(by the layer's logical index when the model's attention kinds differ: AttentionHalves)."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from models import documents, lora, moe
from models.contract import Block, BlockOf, Constrain, LayerAux, Params, RunLayers, layer_specs
from models.layer_spec import attention_kinds
from models.layers import remat, rotation, rotation_by_kind
from models.protocols import ModelConfig

# attention(p, x, layer) -> what the attention half of logical layer `layer` adds (None: every layer's is one kind)
AttentionHalf = Callable[[Params, jax.Array, "jax.Array | None"], jax.Array]


# ----------------------------------------------------------------------------- parameters

def build(cfg: ModelConfig, rngs: nnx.Rngs, layers_cls: type, experts_cls: type) -> nnx.Module:
    """The layer stack of a family: its stacked dense layers `layers_cls(cfg, rngs)`, or mixture-of-experts groups
    (models/moe.py) of its layers and `experts_cls(cfg, rngs, groups)`."""
    if not moe.is_moe(cfg):
        return layers_cls(cfg, rngs)
    return moe.Groups(cfg, rngs, lambda shape, axes, with_mlp: layers_cls(cfg, rngs, (shape, axes), with_mlp),
                      lambda G: experts_cls(cfg, rngs, G))


def add_adapters(layers: nnx.Module, cfg: ModelConfig, projections: dict[str, lora.Projection],
                 rngs: nnx.Rngs) -> None:
    """The LoRA adapters of a stack: beside the blocks' weights, so each block finds its own under `lora`; a
    mixture's in its `dense` stack and `moe` blocks (the attention projections: config.check_lora refuses `mlp`)."""
    if not moe.is_moe(cfg):
        layers.lora = lora.Adapters(cfg, projections, rngs)
        return
    G, k = moe.groups(cfg), cfg.moe_every
    if k > 1:
        layers.dense.lora = lora.Adapters(cfg, projections, rngs, ((G, k - 1), ("layers", None)))
    layers.moe.lora = lora.Adapters(cfg, projections, rngs, ((G,), ("layers",)))


# ----------------------------------------------------------------------------- the forward pass

def runner(block_of: BlockOf) -> RunLayers:
    """The contract's run_layers for a family whose layer is `block_of(cfg, hooks)`: (x, (aux loss, metrics))."""
    def run_layers(layers: Params, x_BxLxD: jax.Array, inputs_BxL: jax.Array, cfg: ModelConfig, constrain: Constrain,
                   layer_ids: jax.Array | None = None) -> tuple[jax.Array, LayerAux]:
        return layer_aux(*run_stack(layers, x_BxLxD, inputs_BxL, cfg, constrain, block_of(cfg, constrain), layer_ids))
    return run_layers


def run_stack(layers: Params, x_BxLxD: jax.Array, inputs_BxL: jax.Array, cfg: ModelConfig, constrain: Constrain,
              block: Block, layer_ids: jax.Array | None = None):
    """Apply a stack (or any contiguous slice of it, `layer_ids` its logical entries) of `block`s. Returns (x, aux):
    None for a dense stack (it adds nothing to the loss), the router's losses and statistics for a mixture
    (moe.run_groups)."""
    layers = lora.freeze(layers, cfg)
    segment_ids, positions = documents.segments_and_positions(inputs_BxL, x_BxLxD.shape[1], cfg, constrain)
    attention = AttentionHalves(block, cfg, constrain, segment_ids, positions)

    def layer(p, x, index):
        return mlp_half(block, p, x + attention(p, x, index), constrain)

    if moe.is_moe(cfg):
        return moe.run_groups(layers, x_BxLxD, cfg, constrain, block, layer, attention, layer_ids)
    body = remat(layer, cfg.remat)
    if attention.uniform:  # no layer needs its index: the scan reads the weights alone
        x_BxLxD, _ = jax.lax.scan(lambda x, p: (body(p, x, None), None), x_BxLxD, layers)
        return x_BxLxD, None
    ids = jnp.arange(cfg.n_layers, dtype=jnp.int32) if layer_ids is None else layer_ids
    x_BxLxD, _ = jax.lax.scan(lambda x, pi: (body(pi[0], x, pi[1]), None), x_BxLxD, (layers, ids))
    return x_BxLxD, None


def mlp_half(block: Block, p: Params, x_BxLxD: jax.Array, constrain: Constrain) -> jax.Array:
    """x plus a dense layer's MLP half."""
    out = block.mlp_output(p, block.mlp(p, block.mlp_input(p, x_BxLxD)))
    return constrain(x_BxLxD + out, ("batch", "seq", "embed"))


KINDS_SCOPE = "attention_kinds"  # the name of the switch between attention kinds, which the audit weighs by


class AttentionHalves:
    """(p, x, layer) -> the attention half's addition of logical layer `layer` over whole sequences, with its kind's
    rotary embedding and window (its LayerSpec). When the kinds differ, the family's attention half still runs as
    one program for every layer: the rotary frequencies are data indexed by the layer's kind, and only the
    attention itself switches between windows (`lax.switch` under the name KINDS_SCOPE), so the projections and
    their collectives (tensor-parallel all-reduces, FSDP gathers) stay outside any conditional."""

    def __init__(self, block: Block, cfg: ModelConfig, constrain: Constrain, segment_ids_BxL: jax.Array | None,
                 positions: jax.Array | None):
        specs = layer_specs(cfg)
        self.block, self.positions, self.kinds = block, positions, attention_kinds(specs)
        self.uniform = len(self.kinds) == 1
        self.kind_of = [self.kinds.index(s.attention_kind) for s in specs]
        self.windows = sorted({k.window for k in self.kinds})
        self.window_of = [self.windows.index(s.window) for s in specs]
        assert len({k.rope_dim for k in self.kinds}) == 1, self.kinds

        def attend(window: int) -> Callable:
            return lambda q, k, v: constrain.causal_attention(q, k, v, cfg.attention, segment_ids_BxL, window)
        self.attend = [attend(w) for w in self.windows]

    def __call__(self, p: Params, x_BxLxD: jax.Array, layer: jax.Array | None) -> jax.Array:
        if self.uniform:
            kind = self.kinds[0]
            return self.block.attention(p, x_BxLxD, rotation(kind.rope, kind.rope_dim, self.positions), self.attend[0])
        kind = jnp.asarray(self.kind_of, jnp.int32)[layer]
        rotate = rotation_by_kind([k.rope for k in self.kinds], self.kinds[0].rope_dim, self.positions, kind)
        if len(self.windows) == 1:
            return self.block.attention(p, x_BxLxD, rotate, self.attend[0])
        window = jnp.asarray(self.window_of, jnp.int32)[layer]

        def attend(q, k, v):
            with jax.named_scope(KINDS_SCOPE):
                return jax.lax.switch(window, self.attend, q, k, v)
        return self.block.attention(p, x_BxLxD, rotate, attend)


def layer_aux(x_BxLxD: jax.Array, stats: dict | None) -> tuple[jax.Array, LayerAux]:
    """`run_stack`'s result as the contract's `run_layers` returns it: (x, (aux loss, metrics)); a dense stack
    adds 0 to the objective and logs nothing, a mixture its weighted router losses and moe.log_fields."""
    if stats is None:
        return x_BxLxD, (jnp.zeros((), jnp.float32), {})
    return x_BxLxD, (stats["aux_loss"], moe.log_fields(stats))
