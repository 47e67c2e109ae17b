"""The work of one pipeline cell: a model chunk's forward, or its backward by `jax.vjp` (recomputing the
chunk's forward from its kept input), whole or split into B and W, with the embedding on the first chunk and the
head and loss on the last, all through the model contract (models/contract.py), so any family pipelines.
"""
from __future__ import annotations

from typing import Any, Callable, Union

import jax
import jax.numpy as jnp

import models
from models.contract import Constrain

# Branch indices: the action kind crossed with the chunk's place in the model (first, middle, last). The split
# backward's cells (B: input gradient, W: weight gradient) follow; the first chunk's B is IDLE (its input is the
# embedding's output, whose gradient only W needs) and its W is BWD_FIRST (every gradient but the input's).
IDLE, FWD_FIRST, FWD_MID, FWD_LAST, BWD_FIRST, BWD_MID, BWD_LAST = range(7)
INPUT_MID, INPUT_LAST, WEIGHT_MID, WEIGHT_LAST = range(7, 11)
NUM_BRANCHES = BWD_LAST + 1  # without split backwards
NUM_SPLIT_BRANCHES = WEIGHT_LAST + 1


def num_branches(split: bool) -> int:
    """How many `lax.switch` branches the executor compiles: the split cells only when the table has them."""
    return NUM_SPLIT_BRANCHES if split else NUM_BRANCHES

# One cell's inputs: (chunk layers [Lc, ...], top params (all outside the layer stack), tokens [b, seq+1],
# x_in [b, seq, D], g_in [b, seq, D], the chunk's logical layer ids [Lc] or None where no layer needs its id:
# models.contract.RunLayers).
# Its outputs: (activation to send on, input gradient to send back, chunk grads, top grads, what it logs: `loss`,
# the language-model loss of a last chunk's forward, and the chunk's share of the layers' metrics (Cells.layers)).
Operands = tuple[Any, Any, jax.Array, jax.Array, jax.Array, jax.Array | None]
Outputs = tuple[jax.Array, jax.Array, Any, Any, dict[str, jax.Array]]


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


def device_rows(tokens: jax.Array, cfg: models.ModelConfig, constrain: Constrain,
                context: int) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(inputs, targets, loss mask or None) [b, seq / context] of a microbatch's tokens [b, seq+1]: what this
    device computes (the whole rows without context parallelism, else its slice of their zigzag order)."""
    inputs, targets, counted = models.split_row(tokens, cfg)
    if context == 1:
        return inputs, targets, counted
    order = constrain.context_order(inputs.shape[1] // context)
    return tuple(None if a is None else jnp.take(a, order, axis=1) for a in (inputs, targets, counted))


LossScale = Union[float, Callable[[jax.Array], jax.Array]]  # 1/m, or a microbatch's tokens -> its weight


def branches(cfg: models.ModelConfig, constrain: Constrain, manual: tuple[str, ...], loss_scale: LossScale, chunks: int,
             split: bool = False, context: int = 1) -> list[Callable[[Operands], Outputs]]:
    """The cell programs, indexed by the constants above (see Cells): seven, or eleven with the split backward's.
    The executor picks one per time slot with `lax.switch`, so all of them share one signature."""
    cells = Cells(cfg, constrain, manual, loss_scale, chunks, context)
    whole = [cells.idle, cells.fwd_first, cells.fwd_mid, cells.fwd_last, cells.bwd_first, cells.bwd_mid,
             cells.bwd_last]
    return whole + ([cells.input_mid, cells.input_last, cells.weight_mid, cells.weight_last] if split else [])


class Cells:
    """The cell programs of one model inside the pipeline region: every branch takes Operands, returns Outputs.

    Forward cells of PipeDream-Flush / GPipe run the chunk and keep nothing: the executor keeps the chunk's
    input, and the backward cell recomputes the forward inside `jax.vjp` (GPipe's re-materialization,
    Huang et al. 2019, section 2.3), so a stage holds one input per microbatch in flight rather than all of
    its activations; `cfg.remat` still applies per layer within that recomputation. `loss_scale` (1/m, or with
    packed documents a function of the microbatch's tokens: its share of the counted targets) seeds the last
    chunk's backward, so the microbatch gradients add up to the gradient of the mean loss.

    The first and last cells differentiate with respect to all top parameters, so a head tied to the
    embedding gets its gradient from both ends. A chunk's auxiliary loss (mixture of experts: the mean over its
    own layers of their router losses on this microbatch) joins the objective divided by the `chunks` of the
    model, so the chunks add up to the mean over all layers, as on one device; its backward is seeded like the
    language-model loss, so the objective is the mean over microbatches of (loss + auxiliary loss). The forward
    cells log the language-model loss alone, and the layers' metrics (router statistics) in the same shares.

    With `context` > 1 ways (manual in the region), every device holds whole rows of tokens and runs its slice of
    their zigzag order (`constrain.context_order`): x_in and the messages are [b, seq / context, D], the loss
    the mean over the slice's targets.
    """

    def __init__(self, cfg: models.ModelConfig, constrain: Constrain, manual: tuple[str, ...], loss_scale: LossScale,
                 chunks: int, context: int = 1):
        self.cfg, self.constrain, self.manual, self.loss_scale = cfg, constrain, manual, loss_scale
        self.context = context
        self.cdt = jnp.dtype(cfg.compute_dtype)
        self.family = models.family_of(cfg)
        self.chunks = chunks

    # --------------------------------------------------------------------- the model's pieces, per chunk place

    def zeros(self, tree: Any) -> Any:
        return make_varying(jax.tree.map(jnp.zeros_like, tree), self.manual)

    def rows(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        return device_rows(tokens, self.cfg, self.constrain, self.context)

    def layers(self, chunk: Any, x: jax.Array, tokens: jax.Array,
               ids: jax.Array | None) -> tuple[jax.Array, jax.Array, dict]:
        """(x, this chunk's share of the aux loss, varying like the loss so its seed has its type, and of the
        layers' metrics)."""
        # The whole rows' inputs in order: under context parallelism packed documents are found along them
        # (models/documents.py).
        by_id = {} if ids is None else {"layer_ids": ids}  # a family whose layers are alike never reads them
        y, (aux, metrics) = self.family.forward.run_layers(chunk, x, models.split_row(tokens, self.cfg)[0], self.cfg,
                                                           self.constrain, **by_id)
        share = jax.tree.map(lambda a: a / self.chunks, (aux, metrics))
        return y, make_varying(share[0], self.manual), share[1]

    def first(self, chunk: Any, top: Any, tokens: jax.Array,
              ids: jax.Array | None) -> tuple[jax.Array, jax.Array, dict]:
        x = self.family.forward.embed(top, self.rows(tokens)[0], self.cfg, self.constrain)
        return self.layers(chunk, x, tokens, ids)

    def mid(self, chunk: Any, x: jax.Array, tokens: jax.Array,
            ids: jax.Array | None) -> tuple[jax.Array, jax.Array, dict]:
        return self.layers(chunk, x, tokens, ids)

    def last(self, chunk: Any, top: Any, x: jax.Array, tokens: jax.Array,
             ids: jax.Array | None) -> tuple[jax.Array, jax.Array, dict]:
        """(objective: what the head adds (the loss, or more: models.contract.HeadLoss) + the chunk's aux loss, the
        language-model loss, the chunk's metrics and the head's beside its loss)."""
        y, aux, metrics = self.layers(chunk, x, tokens, ids)
        _, targets, mask = self.rows(tokens)
        objective, head = self.family.forward.head_loss(top, y, targets, self.cfg, self.constrain, mask)
        loss = head.get("loss", objective)
        return objective + aux, loss, {**metrics, **{k: v for k, v in head.items() if k != "loss"}}

    def head_zeros(self, top: Any, x: jax.Array, tokens: jax.Array) -> dict[str, jax.Array]:
        """Zeros shaped as what the head logs beside its loss (DeepSeek's mtp_loss; usually nothing), which every
        cell's log carries (the switch's branches share one output type); traced abstractly, nothing runs."""
        def head(t, x, tok):
            _, targets, mask = self.rows(tok)
            return self.family.forward.head_loss(t, x, targets, self.cfg, self.constrain, mask)[1]
        shapes = jax.eval_shape(head, top, x, tokens)
        return {k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items() if k != "loss"}

    def logged(self, loss: jax.Array, metrics: dict, top: Any = None, x: jax.Array | None = None,
               tokens: jax.Array | None = None) -> dict[str, jax.Array]:
        """What a forward cell logs; `top`, `x` and `tokens` given, the head's metrics are added as zeros (a cell
        other than the last's forward)."""
        head = {} if top is None else self.head_zeros(top, x, tokens)
        return make_varying({"loss": jnp.asarray(loss, jnp.float32), **metrics, **head}, self.manual)

    def seed(self, tokens: jax.Array) -> jax.Array:
        """The cotangent of a cell's loss: this microbatch's share of the mean loss."""
        scale = self.loss_scale(tokens) if callable(self.loss_scale) else self.loss_scale
        return make_varying(jnp.asarray(scale, jnp.float32), self.manual)

    # --------------------------------------------------------------------- the branches

    def idle(self, ops: Operands) -> Outputs:
        chunk, top, tokens, x_in, _, ids = ops
        zeros = self.zeros(x_in), self.zeros(x_in), self.zeros(chunk), self.zeros(top)
        return *zeros, self._no_log(chunk, top, x_in, tokens, ids)

    def fwd_first(self, ops: Operands) -> Outputs:
        chunk, top, tokens, x_in, _, ids = ops
        y, _, metrics = self.first(chunk, top, tokens, ids)
        return (y.astype(self.cdt), self.zeros(x_in), self.zeros(chunk), self.zeros(top),
                self.logged(0.0, metrics, top, x_in, tokens))

    def fwd_mid(self, ops: Operands) -> Outputs:
        chunk, top, tokens, x_in, _, ids = ops
        y, _, metrics = self.mid(chunk, x_in, tokens, ids)
        return y, self.zeros(x_in), self.zeros(chunk), self.zeros(top), self.logged(0.0, metrics, top, x_in, tokens)

    def fwd_last(self, ops: Operands) -> Outputs:
        """The loss is read here; the backward recomputes it."""
        chunk, top, tokens, x_in, _, ids = ops
        _, loss, metrics = self.last(chunk, top, x_in, tokens, ids)
        return self.zeros(x_in), self.zeros(x_in), self.zeros(chunk), self.zeros(top), self.logged(loss, metrics)

    def bwd_first(self, ops: Operands) -> Outputs:
        chunk, top, tokens, x_in, g_in, ids = ops
        _, pullback = jax.vjp(lambda c, t: self.first(c, t, tokens, ids)[:2], chunk, top)
        g_chunk, g_top = pullback((g_in, self.seed(tokens)))
        return self.zeros(x_in), self.zeros(x_in), g_chunk, g_top, self._no_log(chunk, top, x_in, tokens, ids)

    def bwd_mid(self, ops: Operands) -> Outputs:
        chunk, top, tokens, x_in, g_in, ids = ops
        _, pullback = jax.vjp(lambda c, x: self.mid(c, x, tokens, ids)[:2], chunk, x_in)
        g_chunk, g_x = pullback((g_in, self.seed(tokens)))
        return self.zeros(x_in), g_x, g_chunk, self.zeros(top), self._no_log(chunk, top, x_in, tokens, ids)

    def bwd_last(self, ops: Operands) -> Outputs:
        chunk, top, tokens, x_in, _, ids = ops
        _, pullback = jax.vjp(lambda c, t, x: self.last(c, t, x, tokens, ids)[0], chunk, top, x_in)
        g_chunk, g_top, g_x = pullback(self.seed(tokens))
        return self.zeros(x_in), g_x, g_chunk, g_top, self._no_log(chunk, top, x_in, tokens, ids)

    # --------------------------------------------------------------------- the split backward (zero-bubble)
    # Qi et al. 2023: B differentiates with respect to the chunk's input only, so the previous stage gets its
    # gradient without waiting for the weight gradient; W (any later slot) differentiates with respect to the
    # weights only. Each recomputes the chunk's forward from the kept input, as the whole backward does, and
    # keeps nothing between them: the split costs one more forward per microbatch and chunk, and W, to reach
    # the weights of the chunk's earlier layers, backpropagates through its later ones again (the paper's W
    # reuses the per-layer output gradients its B stored; here only the chunk's input and output gradient
    # are kept, so W is a whole backward minus the input gradient of the chunk's first layer).

    def input_mid(self, ops: Operands) -> Outputs:
        chunk, top, tokens, x_in, g_in, ids = ops
        _, pullback = jax.vjp(lambda x: self.mid(chunk, x, tokens, ids)[:2], x_in)
        (g_x,) = pullback((g_in, self.seed(tokens)))
        return self.zeros(x_in), g_x, self.zeros(chunk), self.zeros(top), self._no_log(chunk, top, x_in, tokens, ids)

    def input_last(self, ops: Operands) -> Outputs:
        chunk, top, tokens, x_in, _, ids = ops
        _, pullback = jax.vjp(lambda x: self.last(chunk, top, x, tokens, ids)[0], x_in)
        (g_x,) = pullback(self.seed(tokens))
        return self.zeros(x_in), g_x, self.zeros(chunk), self.zeros(top), self._no_log(chunk, top, x_in, tokens, ids)

    def weight_mid(self, ops: Operands) -> Outputs:
        chunk, top, tokens, x_in, g_in, ids = ops
        _, pullback = jax.vjp(lambda c: self.mid(c, x_in, tokens, ids)[:2], chunk)
        (g_chunk,) = pullback((g_in, self.seed(tokens)))
        return self.zeros(x_in), self.zeros(x_in), g_chunk, self.zeros(top), self._no_log(chunk, top, x_in, tokens, ids)

    def weight_last(self, ops: Operands) -> Outputs:
        chunk, top, tokens, x_in, _, ids = ops
        _, pullback = jax.vjp(lambda c, t: self.last(c, t, x_in, tokens, ids)[0], chunk, top)
        g_chunk, g_top = pullback(self.seed(tokens))
        return self.zeros(x_in), self.zeros(x_in), g_chunk, g_top, self._no_log(chunk, top, x_in, tokens, ids)

    def _no_log(self, chunk: Any, top: Any, x_in: jax.Array, tokens: jax.Array,
                ids: jax.Array | None) -> dict[str, jax.Array]:
        """What a cell that logs nothing logs: zeros shaped as a forward cell's log (the switch's branches share
        one output type), the layers traced abstractly, so nothing of them runs."""
        shapes = jax.eval_shape(lambda c, top, x, t, i: self.logged(0.0, self.mid(c, x, t, i)[2], top, x, t), chunk,
                                top, x_in, tokens, ids)
        return self.zeros(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
