"""The model contract: what every family provides, so sharding/, train/ and checkpoint/ never name one.

A family's parameters are a plain dict: a `layers` entry whose leaves are stacked on a leading `layers`
axis (run by `lax.scan`; a pipeline stage is a contiguous slice), and "top" entries outside the stack
(embedding, final norm, head; a family chooses their names). The forward pass is split in three pure
functions that the plain step, evaluation and the pipeline cells all call: `embed` (first chunk),
`run_layers` (any chunk) and `head_loss` (last chunk).

Layers are declared as data: `Family.layer_specs(cfg)` gives one `LayerSpec` per layer (its attention kind and
window, its rotary base and scaling, a dense or expert MLP), and every reader takes them from there: the stack,
each pipeline stage, context parallelism, the paged decode and its cache, the planner. A transformer family lends
its layer once, as a `Block` that the training stack (models/stack.py) and the paged decode (models/paged.py)
both run.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol

import jax
import jax.numpy as jnp

from models import attention, documents, lora
from models.hf import HFAdapter
from models.layer_spec import LayerSpec, attended_keys
from models.protocols import ModelConfig, TransformerConfig

Params = dict[str, Any]  # nested dicts of arrays (or ShapeDtypeStructs); a leaf's type is the caller's


Metrics = dict[str, jax.Array]  # to log beside the loss: float32 scalars, or vectors [n] logged as name0..name{n-1}
LayerAux = tuple[jax.Array, Metrics]  # (what the layers add to the objective, their metrics)
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
                         implementation: str, segment_ids_BxL: jax.Array | None = None, window: int = 0) -> jax.Array:
        """Causal attention over the whole sequence, or within the `window` latest positions (a sliding layer;
        0: no window) (models/attention.attend); a context-parallel layout overrides it with a ring over its
        sequence shards."""
        return attention.attend(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, implementation, segment_ids_BxL, window=window)

    def whole_rows(self, x_BxLxD: jax.Array) -> jax.Array:
        """`x` with every row's sequence whole on each device but for context parallelism's split (a mixture of
        experts routes each row's tokens together): a layout that splits the sequence otherwise (sequence
        parallelism) gathers it here; the others leave `x` as it is."""
        return x_BxLxD

    def rows_in_order(self, x_BxLxD: jax.Array) -> jax.Array:
        """A context-parallel layout (`context_order` not None) splits the rows over its sequence's devices in
        place of the sequence and puts each row back in its order, so a mixture of experts sees whole rows."""
        return x_BxLxD

    def rows_to_context(self, x_BxLxD: jax.Array) -> jax.Array:
        """The inverse of `rows_in_order`: the layout's sequence order, the rows whole again."""
        return x_BxLxD

    def weight(self, w: jax.Array, names: tuple) -> jax.Array:
        """The parameter `w` (logical `names`) as a matmul takes it: a layout may pin it gathered over the axes
        that only store it split (FSDP's), where XLA would otherwise move its shards elsewhere; else as is."""
        return w

    def batch_mean(self, x: jax.Array) -> jax.Array:
        """The mean over the whole batch of `x`, a mean over the rows this program holds (a mixture's router
        statistics): the identity where the program sees the whole batch (one device, or jit's global view);
        a region that splits the rows by hand (a pipeline's, manual over the batch axes) averages its replicas."""
        return x

    def moe_experts(self, x_BxExCxD: jax.Array, experts: Params,
                    expert_fn: Callable[[Params, jax.Array], jax.Array]) -> jax.Array:
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
class ExpertBuffers:
    """A mixture of experts' per-expert token buffers, which its layouts move: `layers` mixture layers, each
    with buffers [rows, experts, capacity, d_model] (capacity: slots per expert per row of seq_len tokens)."""
    layers: int
    experts: int
    capacity: int


# The family's functions, typed. Shapes are in the argument names: B rows, L positions, D d_model, V vocab.
InitParams = Callable[[ModelConfig, int], Params]  # (cfg, seed) -> params
AbstractParams = Callable[[ModelConfig], tuple[Params, dict]]  # cfg -> (shapes, logical-axes PartitionSpecs)
Logits = Callable[[Params, jax.Array, ModelConfig, Hooks], jax.Array]  # (top, x_BxLxD, ...) -> f32 logits_BxLxV
PerConfig = Callable[[ModelConfig], float]  # a count of the model: FLOPs per token, parameters, heads
Divisibility = Callable[[ModelConfig], dict[str, tuple[tuple[str, int], ...]]]
LayerSpecs = Callable[[ModelConfig], tuple[LayerSpec, ...]]  # cfg -> one spec per layer


class Embed(Protocol):
    def __call__(self, top: Params, inputs_BxL: jax.Array, cfg: ModelConfig, hooks: Hooks,
                 positions: jax.Array | None = None) -> jax.Array:
        """x_BxLxD of the inputs; `positions` ([L] or [B, L]) where a model embeds positions itself (learned
        absolute positions) and the caller knows them (the paged decode's flat batch), else derived here."""


class RunLayers(Protocol):
    def __call__(self, layers: Params, x_BxLxD: jax.Array, inputs_BxL: jax.Array, cfg: ModelConfig,
                 constrain: Hooks, layer_ids: jax.Array | None = None) -> tuple[jax.Array, LayerAux]:
        """`layers`: the stack or any contiguous slice of it; `layer_ids` (int32, one per entry of its leading
        axis): the logical stack positions it holds, by which each entry finds its LayerSpec; None: the whole
        stack in order, or a slice whose layers are all of one attention kind (`uniform_attention`)."""


class HeadLoss(Protocol):
    def __call__(self, top: Params, x_BxLxD: jax.Array, targets_BxL: jax.Array, cfg: ModelConfig, constrain: Hooks,
                 loss_mask_BxL: jax.Array | None = None) -> tuple[jax.Array, Metrics]: ...


class LayerBytes(Protocol):
    def __call__(self, cfg: ModelConfig, remat: str, tensor: int) -> float: ...


Rotate = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]  # (q, k) -> q, k with the layer's rotary


class Attend(Protocol):
    def __call__(self, q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array) -> jax.Array:
        """The attention itself, which the runner of a Block supplies for the layer's spec: over whole sequences
        (the training stack, through the hooks) or over a paged pool (the paged decode, which writes k and v)."""


@dataclasses.dataclass(frozen=True)
class Block:
    """One transformer layer as a family lends it, once: the training stack (models/stack.py) and the paged decode
    (models/paged.py) both run it as x += attention(p, x, rotate, attend); x += mlp_output(p, MLP(mlp_input(p, x))),
    where MLP is `mlp` for a dense layer and a mixture of `expert_mlp`s for an expert layer. What differs between
    layers (models/layer_spec.py) is the runner's: `rotate(q, k)` applies the layer's rotary embedding at the
    tokens' positions, `attend(q, k, v)` its kind of attention, so the family's code is the same for every layer.

    attention(p, x_BxLxD, rotate, attend) -> what the attention half adds to the residual stream: the family's
        norms and projections, `rotate` where the rotary embedding goes, and `attend` between them;
    mlp_input(p, x) -> the MLP half's normed input h; mlp(p, h) -> the dense MLP's output; mlp_output(p, y) -> what
        the MLP half adds (a post-norm, Gemma's; `y` itself by default);
    expert_mlp(w, x_ExNxD) -> y_ExNxD: one expert's MLP on each expert's rows (models/moe.py), None for a family
        without mixtures."""
    attention: Callable[[Params, jax.Array, Rotate, "Attend"], jax.Array]
    mlp_input: Callable[[Params, jax.Array], jax.Array]
    mlp: Callable[[Params, jax.Array], jax.Array]
    mlp_output: Callable[[Params, jax.Array], jax.Array] = lambda p, y: y
    expert_mlp: Callable[[Params, jax.Array], jax.Array] | None = None


BlockOf = Callable[[ModelConfig, Hooks], Block]  # (cfg, hooks) -> the family's Block on that layout


def query_heads(cfg: TransformerConfig) -> int:
    """Key/value heads when every query head has its own (multi-head attention)."""
    return cfg.n_heads


def no_experts(cfg: ModelConfig) -> ExpertBuffers | None:
    return None


def causal_layers(cfg: ModelConfig) -> tuple[LayerSpec, ...]:
    """The layer specs of a family that declares none: every layer causal with the default rotary embedding."""
    return (LayerSpec(),) * cfg.n_layers


def attention_flops(cfg: TransformerConfig) -> float:
    """Attention scores and values per token, forward and backward: 12 * heads * head_dim * the keys each layer's
    query attends (PaLM, App. B: seq_len for a causal layer, whatever heads * head_dim is; a sliding layer's window,
    models/layer_spec.attended_keys), summed over the layers."""
    specs = family_of(cfg).layer_specs(cfg)
    return 12.0 * cfg.n_heads * cfg.head_dim * sum(attended_keys(s, cfg.seq_len) for s in specs)


@dataclasses.dataclass(frozen=True)
class Forward:
    """The model itself, split where a pipeline cuts it (first chunk, any chunk, last chunk).

    run_layers -> (x_BxLxD, (aux_loss, metrics)): `inputs_BxL` lets a family derive positions or document
        segments per chunk (models/documents.py); `aux_loss` is a float32 scalar added to the objective (0.0 for
        dense layers; a mixture's weighted router losses), `metrics` what the layers log beside the loss.
    head_loss -> (mean loss over the counted targets, metrics); logits -> float32 logits of every position.
    lora_projections(cfg) -> {adapter name: models.lora.Projection}: what each LoRA adapter adds to (None: the
        family takes no adapters)."""
    init_params: InitParams
    abstract_params: AbstractParams
    embed: Embed
    run_layers: RunLayers
    head_loss: HeadLoss
    logits: Logits
    lora_projections: Callable[[ModelConfig], dict[str, lora.Projection]] | None = None


@dataclasses.dataclass(frozen=True)
class Parallel:
    """What layouts need to know of a family without reading its fields.

    lookup_keys(cfg): top keys used only as a lookup (FSDP gathers them in the forward pass only)
    divisibility(cfg): {logical axis: ((setting, size), ...)} that a mesh splitting that axis must divide
    kv_heads(cfg): key/value heads (what context parallelism's ring passes around)
    expert_buffers(cfg) -> ExpertBuffers, or None for dense layers"""
    lookup_keys: Callable[[ModelConfig], tuple[str, ...]]
    divisibility: Divisibility
    kv_heads: Callable[[ModelConfig], int] = query_heads
    expert_buffers: Callable[[ModelConfig], ExpertBuffers | None] = no_experts
    tensor_traffic: TensorTraffic = TensorTraffic()


@dataclasses.dataclass(frozen=True)
class Cost:
    """The planner's model of the family (train/plan).

    flops_per_token, param_count: model FLOPs (6N + attention) and parameters
    attention_flops_per_token: the part of flops_per_token that attention's batched matmuls take
    layer_bytes_per_token(cfg, remat, tensor): bytes one layer keeps for its backward pass per token of a
        microbatch on one device, under remat none | save_dots | full, with `tensor` ways of tensor parallelism
        (None: the planner cannot size the family)"""
    flops_per_token: PerConfig
    param_count: Callable[[ModelConfig], int]
    attention_flops_per_token: PerConfig = attention_flops
    layer_bytes_per_token: LayerBytes | None = None


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its config dataclass (a ModelConfig; `attention`, which train/config/experiment.py resolves per
    platform, `loss_chunk_size` and `document_eos_id` are read where a family has them) and presets, and its
    functions grouped by purpose. Each takes the family's config `cfg` and, inside a layer, the Hooks that
    sharding/ lends it. `layer_specs(cfg)`: one LayerSpec per layer (models/layer_spec.py). `block(cfg, hooks)`:
    the family's layer (Block), which the paged decode runs; None: the family cannot decode (its own run_layers
    trains it). `hf`: its Hugging Face adapter (models/hf.py), config.json and tensors both ways."""
    name: str
    config_cls: type
    presets: Mapping[str, Mapping[str, Any]]
    forward: Forward
    parallel: Parallel
    cost: Cost
    layer_specs: LayerSpecs = causal_layers
    block: BlockOf | None = None
    hf: HFAdapter | None = None  # None: no Hugging Face import or export


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


def family_of(cfg: ModelConfig) -> Family:
    return FAMILIES[cfg.family]


def stack_length(cfg: ModelConfig) -> int:
    """The length of the layer stack's leading `layers` axis, which pipelines split into stages: the layers, or a
    mixture's groups of `moe_every` layers (models/moe.py)."""
    buffers = family_of(cfg).parallel.expert_buffers(cfg)
    return cfg.n_layers if buffers is None else buffers.layers


def layer_specs(cfg: ModelConfig) -> tuple[LayerSpec, ...]:
    return family_of(cfg).layer_specs(cfg)


def uniform_attention(cfg: ModelConfig) -> bool:
    """Whether every layer's attention is of one kind: no reader then needs to know which layer it runs."""
    return len({s.attention_kind for s in layer_specs(cfg)}) == 1


def top_params(params: Params) -> Params:
    """The parameters outside the layer stack."""
    return {k: v for k, v in params.items() if k != LAYERS}


def forward(params: Params, tokens_BxL: jax.Array, cfg: ModelConfig, constrain: Constrain = no_constraint) -> jax.Array:
    """Float32 logits for every position."""
    fam = family_of(cfg)
    order = constrain.context_order(tokens_BxL.shape[1])
    if order is not None:
        tokens_BxL = jnp.take(tokens_BxL, order, axis=1)
    x = fam.forward.embed(top_params(params), tokens_BxL, cfg, constrain)
    x, _ = fam.forward.run_layers(params[LAYERS], x, tokens_BxL, cfg, constrain)
    logits_BxLxV = fam.forward.logits(top_params(params), x, cfg, constrain)
    return logits_BxLxV if order is None else jnp.take(logits_BxLxV, jnp.argsort(order), axis=1)


def loss(params: Params, tokens_BxL1: jax.Array, cfg: ModelConfig, constrain: Constrain = no_constraint) -> jax.Array:
    """The training objective of a batch of `seq_len + 1` tokens per row (inputs and shifted targets): the
    language-model loss, the mean over counted targets (all, or with packed documents those not after an
    end-of-document input), plus any auxiliary loss of the layers."""
    return loss_and_metrics(params, tokens_BxL1, cfg, constrain)[0]


def loss_and_metrics(params: Params, tokens_BxL1: jax.Array, cfg: ModelConfig,
                     constrain: Constrain = no_constraint) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(objective, metrics): `metrics["loss"]` is the language-model loss alone; the layers' and the head's
    metrics (a mixture's router statistics) join it as their own scalars."""
    fam = family_of(cfg)
    tokens_BxL1 = constrain(tokens_BxL1, ("batch", None))  # the shift is local: every device has whole rows
    inputs, targets, counted = documents.split_row(tokens_BxL1, cfg)
    order = constrain.context_order(inputs.shape[1])
    if order is not None:  # the loss is a mean over tokens: once permuted, the sequence never goes back
        inputs, targets = jnp.take(inputs, order, axis=1), jnp.take(targets, order, axis=1)
        counted = None if counted is None else jnp.take(counted, order, axis=1)
    top = top_params(params)
    x = fam.forward.embed(top, inputs, cfg, constrain)
    x, (aux_loss, layer_metrics) = fam.forward.run_layers(params[LAYERS], x, inputs, cfg, constrain)
    lm, head_metrics = fam.forward.head_loss(top, x, targets, cfg, constrain, counted)
    objective = lm + aux_loss
    # Layers that log nothing add nothing (aux_loss is 0): their objective is the loss, reported as such.
    return objective, {"loss": lm if layer_metrics else objective, **scalars(head_metrics), **scalars(layer_metrics)}


def scalars(metrics: Metrics) -> Metrics:
    """Each vector metric [n] as n scalars named by its index (a mixture's `moe_load_e` [E] -> moe_load_e0, ...)."""
    out = {}
    for name, value in metrics.items():
        if jnp.ndim(value):
            out.update({f"{name}{i}": value[i] for i in range(value.shape[0])})
        else:
            out[name] = value
    return out


def init_params(cfg: ModelConfig, seed: int) -> Params:
    return family_of(cfg).forward.init_params(cfg, seed)


def abstract_params(cfg: ModelConfig) -> tuple[Params, dict]:
    return family_of(cfg).forward.abstract_params(cfg)


def flops_per_token(cfg: ModelConfig) -> float:
    return family_of(cfg).cost.flops_per_token(cfg)


def param_count(cfg: ModelConfig) -> int:
    return family_of(cfg).cost.param_count(cfg)
