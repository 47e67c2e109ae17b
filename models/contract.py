"""The model contract: what every family provides, so sharding/, train/ and checkpoint/ never name one.

A family's parameters are a plain dict: a `layers` entry whose leaves are stacked on a leading `layers`
axis (run by `lax.scan`; a pipeline stage is a contiguous slice), and "top" entries outside the stack
(embedding, final norm, head; a family chooses their names). The forward pass is split in three pure
functions that the plain step, evaluation and the pipeline cells all call: `embed` (first chunk),
`run_layers` (any chunk) and `head_loss` (last chunk).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from models import attention, documents

Params = dict[str, Any]
ModelConfig = Any  # a family's frozen config dataclass (GPTConfig, LlamaConfig, ...)
LAYERS = "layers"  # the key of the stacked blocks in every family's parameter dict


class Hooks:
    """What the caller (sharding/) lends the model, so that models never name a mesh: `hooks(x, logical_names)`
    hints an activation's sharding, and layouts that need collectives inside a layer override the methods
    that subclasses add here. This base class is one device: no hints, no collectives."""

    def __call__(self, x: jax.Array, names: tuple) -> jax.Array:
        return x

    def context_order(self, length: int) -> jax.Array | None:
        """int32 [length]: the global position held at each position of the layout's sequence order (a
        context-parallel layout's zigzag), or None when the sequence stays in order. The model permutes its
        inputs, targets and loss mask by it once after the shift, and uses it as the rotary positions."""
        return None

    def causal_attention(self, q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array,
                         implementation: str, segment_ids_BxL: jax.Array | None = None) -> jax.Array:
        """Causal attention over the whole sequence (models/attention.attend); a context-parallel layout
        overrides it with a ring over its sequence shards."""
        return attention.attend(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, implementation, segment_ids_BxL)

    def moe_experts(self, x_BxExCxD: jax.Array, experts: Params, expert_fn: Callable) -> jax.Array:
        """Run every expert on its slots of every row (models/moe.py): `expert_fn(experts, x_ExNxD) -> y_ExNxD`
        on the buffers regrouped per expert. A mesh splitting the experts overrides this with all-to-alls."""
        B, E, C, D = x_BxExCxD.shape
        y_ExNxD = expert_fn(experts, jnp.swapaxes(x_BxExCxD, 0, 1).reshape(E, B * C, D))
        return jnp.swapaxes(y_ExNxD.reshape(E, B, C, -1), 0, 1)


Constrain = Hooks  # the name the families' signatures use: the hook is mostly an activation constraint
no_constraint = Hooks()


@dataclasses.dataclass(frozen=True)
class TensorTraffic:
    """Megatron activation all-reduces over `tensor` a family's block does by construction, in units of
    one [rows, seq, d_model] activation: forward per layer (mirrored once in the backward), how many of
    them full rematerialization recomputes, and the top's (embedding lookup forward, head input grad backward)."""
    forward_per_layer: int = 2
    recomputed_by_full_remat: int = 1
    embed_forward: int = 1
    head_backward: int = 1


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family. Every function takes the family's frozen config `cfg` (which must have the fields
    vocab_size, seq_len, d_model, n_layers, compute_dtype, remat; optionally `attention`, which train/config.py
    resolves per platform, `loss_chunk_size`, and document_eos_id: see models/documents.py, whose segment ids and
    positions `run_layers` applies) and an activation hint `constrain`.

    embed(top, inputs_BxL, cfg, constrain) -> x_BxLxD
    run_layers(layers, x_BxLxD, inputs_BxL, cfg, constrain) -> (x_BxLxD, aux)
        `inputs_BxL` lets a family derive positions or document segments per chunk; `aux` is an extra loss
        term added to the loss: a scalar (0.0 for dense models), or for a mixture of experts a dict whose
        `aux_loss` joins the objective and whose other entries are router statistics (models/moe.py).
    head_loss(top, x_BxLxD, targets_BxL, cfg, constrain, loss_mask_BxL=None) -> mean loss over counted targets
    logits(top, x_BxLxD, cfg, constrain) -> float32 logits_BxLxV
    init_params(cfg, seed) -> params;  abstract_params(cfg) -> (shapes, logical axes PartitionSpecs)
    flops_per_token(cfg), param_count(cfg): model FLOPs (6N + attention) and parameters
    lookup_keys(cfg): top keys used only as a lookup (gathered by FSDP in the forward pass only)
    divisibility(cfg): {logical axis: ((setting, size), ...)} that a mesh splitting that axis must divide
    init_cache(cfg, batch, max_len) -> cache;  decode(params, tokens_BxT, cache, length, cfg, constrain)
        -> (float32 logits of the last position [B, V], cache): incremental decoding with a KV cache, the
        T new tokens at positions length..length+T-1 (None: the family cannot sample)
    """
    name: str
    config_cls: type
    presets: Mapping[str, Mapping[str, Any]]
    init_params: Callable
    abstract_params: Callable
    embed: Callable
    run_layers: Callable
    head_loss: Callable
    logits: Callable
    flops_per_token: Callable
    param_count: Callable
    lookup_keys: Callable
    divisibility: Callable
    tensor_traffic: TensorTraffic = TensorTraffic()
    init_cache: Callable | None = None
    decode: Callable | None = None


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


def family_of(cfg: Any) -> Family:
    return FAMILIES[cfg.family]


def top_params(params: Params) -> Params:
    """The parameters outside the layer stack."""
    return {k: v for k, v in params.items() if k != LAYERS}


def forward(params: Params, tokens_BxL: jax.Array, cfg: Any, constrain: Constrain = no_constraint) -> jax.Array:
    """Float32 logits for every position."""
    fam = family_of(cfg)
    order = constrain.context_order(tokens_BxL.shape[1])
    if order is not None:
        tokens_BxL = jnp.take(tokens_BxL, order, axis=1)
    x = fam.embed(top_params(params), tokens_BxL, cfg, constrain)
    x, _ = fam.run_layers(params[LAYERS], x, tokens_BxL, cfg, constrain)
    logits_BxLxV = fam.logits(top_params(params), x, cfg, constrain)
    return logits_BxLxV if order is None else jnp.take(logits_BxLxV, jnp.argsort(order), axis=1)


def loss(params: Params, tokens_BxL1: jax.Array, cfg: Any, constrain: Constrain = no_constraint) -> jax.Array:
    """The training objective of a batch of `seq_len + 1` tokens per row (inputs and shifted targets): the
    language-model loss, the mean over counted targets (all, or with packed documents those not after an
    end-of-document input), plus any auxiliary loss of the layers."""
    return loss_and_metrics(params, tokens_BxL1, cfg, constrain)[0]


def loss_and_metrics(params: Params, tokens_BxL1: jax.Array, cfg: Any,
                     constrain: Constrain = no_constraint) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(objective, metrics): `metrics["loss"]` is the language-model loss alone; a mixture of experts adds its
    router statistics as their own scalars (models/moe.py log_fields)."""
    fam = family_of(cfg)
    tokens_BxL1 = constrain(tokens_BxL1, ("batch", None))  # the shift is local: every device has whole rows
    inputs, targets = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]
    order = constrain.context_order(inputs.shape[1])
    if order is not None:  # the loss is a mean over tokens: once permuted, the sequence never goes back
        inputs, targets = jnp.take(inputs, order, axis=1), jnp.take(targets, order, axis=1)
    top = top_params(params)
    x = fam.embed(top, inputs, cfg, constrain)
    x, aux = fam.run_layers(params[LAYERS], x, inputs, cfg, constrain)
    lm = fam.head_loss(top, x, targets, cfg, constrain, documents.loss_mask(inputs, cfg))
    if not isinstance(aux, dict):
        return lm + aux, {"loss": lm}
    from models import moe  # imported here: models/moe.py builds on this module
    return lm + aux["aux_loss"], {"loss": lm, **moe.log_fields(aux)}


def init_params(cfg: Any, seed: int) -> Params:
    return family_of(cfg).init_params(cfg, seed)


def abstract_params(cfg: Any) -> tuple[Params, dict]:
    return family_of(cfg).abstract_params(cfg)


def flops_per_token(cfg: Any) -> float:
    return family_of(cfg).flops_per_token(cfg)


def param_count(cfg: Any) -> int:
    return family_of(cfg).param_count(cfg)
