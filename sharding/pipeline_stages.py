"""The work of one pipeline cell: a model chunk's forward, or its backward by `jax.vjp` (recomputing the
chunk's forward from its kept input), with the embedding on the first chunk and the head and loss on the last.

The executor picks one of these branches per time slot with `lax.switch`, so all of them share one signature.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

import models
from models import gpt

# Branch indices: the action kind crossed with the chunk's place in the model (first, middle, last).
IDLE, FWD_FIRST, FWD_MID, FWD_LAST, BWD_FIRST, BWD_MID, BWD_LAST = range(7)
NUM_BRANCHES = BWD_LAST + 1
TOP_KEYS = ("embed", "final_norm", "head")  # the parameters outside the layer stack

# One cell's inputs: (chunk layers [Lc, ...], top params, tokens [b, seq+1], x_in [b, seq, D], g_in [b, seq, D]).
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


def branches(cfg: models.GPTConfig, constrain: gpt.Constrain, manual: tuple[str, ...],
             loss_scale: float) -> list[Callable[[Operands], Outputs]]:
    """The seven cell programs, indexed by the constants above.

    Forward cells of PipeDream-Flush / GPipe run the chunk and keep nothing: the executor keeps the chunk's
    input, and the backward cell recomputes the forward inside `jax.vjp` (GPipe's re-materialization,
    Huang et al. 2019, section 2.3), so a stage holds one input per microbatch in flight rather than all of
    its activations; `cfg.remat` still applies per layer within that recomputation. `loss_scale` (1/m)
    seeds the last chunk's backward, so the microbatch gradients add up to the gradient of the mean loss.
    """
    cdt = jnp.dtype(cfg.compute_dtype)

    def zeros(tree):
        return make_varying(jax.tree.map(jnp.zeros_like, tree), manual)

    def layers(chunk, x):
        return gpt.run_layers(chunk, x, cfg, constrain)

    def first(chunk, table, tokens):
        return layers(chunk, gpt.embed({"embed": table}, tokens[:, :-1], cfg, constrain))

    def last(chunk, top_head, x, tokens):
        logits = gpt.logits(top_head, layers(chunk, x), cfg, constrain)
        return gpt.cross_entropy(logits, tokens[:, 1:])

    def head_of(top):
        return {"final_norm": top["final_norm"], "head": top["head"]}

    def idle(ops: Operands) -> Outputs:
        chunk, top, _, x_in, _ = ops
        return zeros(x_in), zeros(x_in), zeros(chunk), zeros(top), zeros(jnp.zeros((), jnp.float32))

    def fwd_first(ops):
        chunk, top, tokens, x_in, _ = ops
        y = first(chunk, top["embed"], tokens).astype(cdt)
        return y, zeros(x_in), zeros(chunk), zeros(top), zeros(jnp.zeros((), jnp.float32))

    def fwd_mid(ops):
        chunk, top, _, x_in, _ = ops
        return layers(chunk, x_in), zeros(x_in), zeros(chunk), zeros(top), zeros(jnp.zeros((), jnp.float32))

    def fwd_last(ops):  # the loss is read here; the backward recomputes it
        chunk, top, tokens, x_in, _ = ops
        loss = last(chunk, head_of(top), x_in, tokens)
        return zeros(x_in), zeros(x_in), zeros(chunk), zeros(top), make_varying(loss, manual)

    def bwd_first(ops):
        chunk, top, tokens, x_in, g_in = ops
        _, pullback = jax.vjp(lambda c, t: first(c, t, tokens), chunk, top["embed"])
        g_chunk, g_table = pullback(g_in)
        g_top = {**zeros(top), "embed": g_table}
        return zeros(x_in), zeros(x_in), g_chunk, g_top, zeros(jnp.zeros((), jnp.float32))

    def bwd_mid(ops):
        chunk, top, _, x_in, g_in = ops
        _, pullback = jax.vjp(layers, chunk, x_in)
        g_chunk, g_x = pullback(g_in)
        return zeros(x_in), g_x, g_chunk, zeros(top), zeros(jnp.zeros((), jnp.float32))

    def bwd_last(ops):
        chunk, top, tokens, x_in, _ = ops
        _, pullback = jax.vjp(lambda c, h, x: last(c, h, x, tokens), chunk, head_of(top), x_in)
        seed = make_varying(jnp.asarray(loss_scale, jnp.float32), manual)
        g_chunk, g_head, g_x = pullback(seed)
        g_top = {**zeros(top), **g_head}
        return zeros(x_in), g_x, g_chunk, g_top, zeros(jnp.zeros((), jnp.float32))

    return [idle, fwd_first, fwd_mid, fwd_last, bwd_first, bwd_mid, bwd_last]
