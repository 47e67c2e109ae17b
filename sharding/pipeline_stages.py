"""The work of one pipeline cell: a model chunk's forward, or its backward by `jax.vjp` (recomputing the
chunk's forward from its kept input), with the embedding on the first chunk and the head and loss on the last,
all through the model contract (models/contract.py), so any family pipelines.

The executor picks one of these branches per time slot with `lax.switch`, so all of them share one signature.
"""
from __future__ import annotations

from typing import Any, Callable, Union

import jax
import jax.numpy as jnp

import models
from models.contract import Constrain

# Branch indices: the action kind crossed with the chunk's place in the model (first, middle, last).
IDLE, FWD_FIRST, FWD_MID, FWD_LAST, BWD_FIRST, BWD_MID, BWD_LAST = range(7)
NUM_BRANCHES = BWD_LAST + 1

# One cell's inputs: (chunk layers [Lc, ...], top params (all outside the layer stack), tokens [b, seq+1],
# x_in [b, seq, D], g_in [b, seq, D]).
# Its outputs: (activation to send on, input gradient to send back, chunk grads, top grads, loss).
Operands = tuple[Any, Any, jax.Array, jax.Array, jax.Array]
Outputs = tuple[jax.Array, jax.Array, Any, Any, jax.Array]


def varying_axes(x: jax.Array) -> frozenset:
    """The manual mesh axes along which `x` may differ (its varying-manual-axes type)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # newer jax
    return frozenset(vma if vma is not None else aval.mat.varying)


def make_varying(tree: Any, axes: tuple[str, ...]) -> Any:
    """Cast every leaf to vary over all `axes`. Branch outputs of `lax.switch` and scan carries must have
    one type; and a parameter left invariant over a batch axis makes the transpose of its implicit
    broadcast a psum inside every backward, which would reduce the gradients once per microbatch."""
    def cast(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(cast, tree)


LossScale = Union[float, Callable[[jax.Array], jax.Array]]  # 1/m, or a microbatch's tokens -> its weight


def branches(cfg: Any, constrain: Constrain, manual: tuple[str, ...],
             loss_scale: LossScale) -> list[Callable[[Operands], Outputs]]:
    """The seven cell programs, indexed by the constants above.

    Forward cells of PipeDream-Flush / GPipe run the chunk and keep nothing: the executor keeps the chunk's
    input, and the backward cell recomputes the forward inside `jax.vjp` (GPipe's re-materialization,
    Huang et al. 2019, section 2.3), so a stage holds one input per microbatch in flight rather than all of
    its activations; `cfg.remat` still applies per layer within that recomputation. `loss_scale` (1/m, or with
    packed documents a function of the microbatch's tokens: its share of the counted targets) seeds the last
    chunk's backward, so the microbatch gradients add up to the gradient of the mean loss.

    The first and last cells differentiate with respect to all top parameters, so a head tied to the
    embedding gets its gradient from both ends; a chunk's auxiliary loss (mixture of experts) is added to
    the loss of the cell that runs it, and its backward seeded like the main loss.
    """
    cdt = jnp.dtype(cfg.compute_dtype)
    family = models.family_of(cfg)

    def zeros(tree):
        return make_varying(jax.tree.map(jnp.zeros_like, tree), manual)

    def layers(chunk, x, tokens):  # (x, aux loss varying like the loss, so its seed has its type)
        y, (aux, _) = family.run_layers(chunk, x, tokens[:, :-1], cfg, constrain)
        return y, make_varying(aux, manual)

    def first(chunk, top, tokens):
        return layers(chunk, family.embed(top, tokens[:, :-1], cfg, constrain), tokens)

    def mid(chunk, x, tokens):
        return layers(chunk, x, tokens)

    def last(chunk, top, x, tokens):
        y, aux = layers(chunk, x, tokens)
        loss, _ = family.head_loss(top, y, tokens[:, 1:], cfg, constrain, models.loss_mask(tokens[:, :-1], cfg))
        return loss + aux

    def idle(ops: Operands) -> Outputs:
        chunk, top, _, x_in, _ = ops
        return zeros(x_in), zeros(x_in), zeros(chunk), zeros(top), zeros(jnp.zeros((), jnp.float32))

    def fwd_first(ops):
        chunk, top, tokens, x_in, _ = ops
        y, aux = first(chunk, top, tokens)
        return y.astype(cdt), zeros(x_in), zeros(chunk), zeros(top), make_varying(aux, manual)

    def fwd_mid(ops):
        chunk, top, tokens, x_in, _ = ops
        y, aux = mid(chunk, x_in, tokens)
        return y, zeros(x_in), zeros(chunk), zeros(top), make_varying(aux, manual)

    def fwd_last(ops):  # the loss is read here; the backward recomputes it
        chunk, top, tokens, x_in, _ = ops
        loss = last(chunk, top, x_in, tokens)
        return zeros(x_in), zeros(x_in), zeros(chunk), zeros(top), make_varying(loss, manual)

    def seed(tokens):
        scale = loss_scale(tokens) if callable(loss_scale) else loss_scale
        return make_varying(jnp.asarray(scale, jnp.float32), manual)

    def bwd_first(ops):
        chunk, top, tokens, x_in, g_in = ops
        _, pullback = jax.vjp(lambda c, t: first(c, t, tokens), chunk, top)
        g_chunk, g_top = pullback((g_in, seed(tokens)))
        return zeros(x_in), zeros(x_in), g_chunk, g_top, zeros(jnp.zeros((), jnp.float32))

    def bwd_mid(ops):
        chunk, top, tokens, x_in, g_in = ops
        _, pullback = jax.vjp(lambda c, x: mid(c, x, tokens), chunk, x_in)
        g_chunk, g_x = pullback((g_in, seed(tokens)))
        return zeros(x_in), g_x, g_chunk, zeros(top), zeros(jnp.zeros((), jnp.float32))

    def bwd_last(ops):
        chunk, top, tokens, x_in, _ = ops
        _, pullback = jax.vjp(lambda c, t, x: last(c, t, x, tokens), chunk, top, x_in)
        g_chunk, g_top, g_x = pullback(seed(tokens))
        return zeros(x_in), g_x, g_chunk, g_top, zeros(jnp.zeros((), jnp.float32))

    return [idle, fwd_first, fwd_mid, fwd_last, bwd_first, bwd_mid, bwd_last]
