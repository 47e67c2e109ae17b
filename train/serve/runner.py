"""The engine's model runner: a placed model's weights split per layer once, one KV pool per layer sized per cache
group, and one jitted step over a flat batch of tokens (models/paged.py) compiled at build time for a few bucketed
token counts, never per request. It turns the scheduler's chunks into the step's arrays and runs it; it knows
nothing of requests. Its weights can be replaced in place (same shapes and shardings: nothing recompiles)."""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
from mesh.numbers import ceil_div
from models import paged
from models.layer_spec import window_pages
from sharding import experts as experts_lib
from sharding import specs as sharding_specs
from train.config.sections import ServeSection
from train.exit_codes import ConfigError
from train.placed import Placed
from train.serve.sampling import sample
from train.serve.scheduler import Chunk

MAX_LOGPROBS = 8  # the most top-N log-probabilities a request may ask for (compiled into the step)
CPU_SEQS_OF_PAGES = 1  # on CPU (no memory statistics) the pool holds every slot's longest sequence this many times


def buckets(s: ServeSection, ways: int = 1) -> list[int]:
    """The token counts the step compiles for: powers of two from serve.min_step_tokens (by default 1: a step of
    one decoding sequence runs one token, not eight), and the most one step can take (the token budget, or every
    slot's prompt chunk when that is fewer), each rounded up to a multiple of `ways` (the mesh's split of a
    mixture's rows: models/paged.py)."""
    most = min(s.max_batch_tokens, s.max_num_seqs * seq_step_tokens(s))
    least = min(s.min_step_tokens, most)
    counts = [n for n in (least * 2 ** i for i in range(32)) if n < most] + [most]
    return sorted({ceil_div(n, ways) * ways for n in counts})


def speculative_tokens(s: ServeSection) -> int:
    """The most draft tokens a step verifies per sequence (0: no speculation)."""
    return 0 if s.speculative == "off" else s.num_speculative_tokens


def seq_step_tokens(s: ServeSection) -> int:
    """The most tokens of one sequence in one step: a prompt chunk, or a token and its draft tokens."""
    return max(s.prefill_chunk, 1 + speculative_tokens(s))


def page_bytes(cfg: models.ModelConfig, kv_heads: int, page_size: int, layers: int | None = None) -> int:
    """A page of keys and values over `layers` layers (default every one)."""
    n = cfg.n_layers if layers is None else layers
    return 2 * n * page_size * kv_heads * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize


def group_pages_per_seq(group: paged.CacheGroup, s: ServeSection, pages_per_seq: int) -> int:
    """The most pages one sequence holds in `group`: every one of its longest sequence in a causal group; in a
    sliding group its window's, plus the pages a prompt chunk adds while it runs (models/layer_spec.window_pages)."""
    if not group.window:
        return pages_per_seq
    return min(pages_per_seq, window_pages(group.window - 1 + seq_step_tokens(s), s.page_size))


def check_pool(cfg: models.ModelConfig, s: ServeSection, context: int) -> None:
    """A set serve.kv_pages holds one sequence of `context` positions in every cache group (the scratch page
    aside): a one-line error otherwise, before anything loads."""
    if not s.kv_pages:
        return
    for group in paged.cache_groups(cfg):
        need = group_pages_per_seq(group, s, ceil_div(context, s.page_size)) + 1
        if s.kv_pages < need:
            where = f" in its {group.kind} layers" if group.window else ""
            raise ConfigError(f"serve.kv_pages={s.kv_pages}: too few for one sequence of {context} positions, the "
                              f"model's context ({need} pages of serve.page_size={s.page_size} tokens{where}, the "
                              f"scratch page included); raise it, or leave it 0 to size the pool from memory")


def pool_pages(placed: Placed, s: ServeSection, kv_heads: int, pages_per_seq: int) -> list[int]:
    """Pages of each cache group (models/paged.cache_groups): `kv_pages` each, or from what kv_memory_fraction of the
    free memory of the first device holds (the pool is split over `tensor` by heads): the sliding groups first,
    enough for every slot (each sequence holds a few pages there), then the causal groups the rest, in the same
    number; on CPU, enough for every slot's longest sequence, within that fraction of the host's available memory."""
    groups = paged.cache_groups(placed.model)
    if s.kv_pages:
        return [s.kv_pages] * len(groups)
    tensor = placed.mesh.shape.get("tensor", 1)
    each = [page_bytes(placed.model, kv_heads, s.page_size, len(g.layers)) // tensor for g in groups]
    wanted = [CPU_SEQS_OF_PAGES * s.max_num_seqs * group_pages_per_seq(g, s, pages_per_seq) + 1 for g in groups]
    device = placed.mesh.devices.flat[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        budget = s.kv_memory_fraction * host_available_bytes()
    else:
        budget = s.kv_memory_fraction * (stats["bytes_limit"] - stats.get("bytes_in_use", 0))
        wanted = [w if g.window else math.inf for g, w in zip(groups, wanted)]  # the causal groups: all there is
    sliding = sum(w * b for g, w, b in zip(groups, wanted, each) if g.window)
    scale = min(1.0, budget / sliding) if sliding else 1.0  # the sliding groups' share, shrunk if it is all
    left = budget - scale * sliding
    causal = sum(b for g, b in zip(groups, each) if not g.window)
    return [max(2, int(min(w, scale * w if g.window else left // causal))) for g, w in zip(groups, wanted)]


def host_available_bytes() -> int:
    """The host's free memory (what a CPU device allocates from)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # a platform without these names: no cap
        return 1 << 62


class ModelRunner:
    def __init__(self, placed: Placed, settings: ServeSection, max_context: int | None = None, rows_per_seq: int = 1):
        """`rows_per_seq`: the most tokens of one sequence a step samples (1, or 1 + the speculative tokens)."""
        cfg, family = placed.model, models.family_of(placed.model)
        if family.block is None:
            raise models.ModelConfigError(f"model.family={cfg.family!r} lends no Block: it has no paged decoding "
                                          f"(models/paged.py)")
        assert placed.layer_order is None, "decoding folds pipelines into data (train/placed.py)"
        # The stacked params stay the caller's: the runner decodes on its own per-layer copy (self.weights).
        self.placed, self.settings, self.cfg = dataclasses.replace(placed, params=None), settings, cfg
        kv_heads = family.parallel.kv_heads(cfg)
        ps = settings.page_size
        context = max_context or paged.max_context(cfg)
        check_pool(cfg, settings, context)
        self.pages_per_seq = ceil_div(context, ps)
        self.table_width = paged.table_width(self.pages_per_seq, ps)
        self.weights = self._unstacked(placed)  # before the pool is sized from the memory left
        self.groups = paged.cache_groups(cfg)
        self.group_pages = pool_pages(placed, settings, kv_heads, self.pages_per_seq)
        self.max_context = min([context] + [(n - 1) * ps for g, n in zip(self.groups, self.group_pages)
                                            if not g.window])
        sizes = dict(placed.mesh.shape)
        rows_split = math.prod(sizes[a] for a in experts_lib.batch_axes(placed.layout.rules, sizes))
        self.buckets = buckets(settings, rows_split)
        self.pool = self._empty_pool(kv_heads)
        self.max_rows = settings.max_num_seqs * rows_per_seq
        self._step = self._compile(placed.layout.constrain())
        self.step_seconds: dict[int, float] = {}

    @property
    def windows(self) -> list[int]:
        return [g.window for g in self.groups]

    def _empty_pool(self, kv_heads: int) -> dict[str, list[jax.Array]]:
        """One K and one V pool per layer (models/paged.py), its group's pages, split over `tensor` by KV heads."""
        pages = {layer: n for g, n in zip(self.groups, self.group_pages) for layer in g.layers}
        shapes = [paged.pool_shape(self.cfg, kv_heads, pages[layer], self.settings.page_size)
                  for layer in range(self.cfg.n_layers)]
        mesh = self.placed.mesh
        spec = sharding_specs.mesh_spec(P(*paged.POOL_AXES), self.placed.layout.rules, shapes[0], dict(mesh.shape))
        dtype = jnp.dtype(self.cfg.compute_dtype)
        zeros = jax.jit(lambda: {n: [jnp.zeros(shape, dtype) for shape in shapes] for n in ("k", "v")},
                        out_shardings=NamedSharding(mesh, spec))
        return zeros()

    def weight_shardings(self):
        """The per-layer weights' shardings (models/paged.unstacked_shardings): what `update_weights` takes."""
        return paged.unstacked_shardings(self.placed.layout.params, self.cfg)

    def _unstacked(self, placed: Placed):
        """The params split per layer in their shardings (models/paged.unstack), what every step reads."""
        return jax.jit(lambda p: paged.unstack(p, self.cfg), out_shardings=self.weight_shardings())(placed.params)

    def update_weights(self, weights) -> None:
        """Decode on `weights` from now on: per-layer weights as `models.paged.unstack` lays them out, in
        `weight_shardings()`, so the compiled steps run them as they are."""
        old = jax.tree.structure(self.weights)
        assert jax.tree.structure(weights) == old, "update_weights: another tree than the engine's weights"
        for new, have in zip(jax.tree.leaves(weights), jax.tree.leaves(self.weights)):
            assert new.shape == have.shape and new.dtype == have.dtype and new.sharding == have.sharding, \
                (new.shape, new.dtype, new.sharding, have.shape, have.dtype, have.sharding)
        self.weights = weights

    def _compile(self, constrain):
        cfg = self.cfg

        def run(weights, pool, tokens, positions, slots, tables, select, blocks, temperature, top_k, top_p, seeds,
                counters, with_logprobs, targets):
            batch = paged.Batch(tokens, positions, slots, tables, select, blocks)
            logits, pool = paged.decode(weights, batch, pool, cfg, constrain)
            return pool, sample(logits, temperature, top_k, top_p, seeds, counters, MAX_LOGPROBS, with_logprobs,
                                targets)
        return jax.jit(run, donate_argnums=(1,))

    def warmup(self, timed: bool = False) -> None:
        """Compile (and run once on padding alone) the step of every bucket, so no request ever compiles; `timed`:
        then the fastest of three more runs of each is its cost (`step_seconds`, what speculation plans by), no
        more than a larger step's (timings on a busy machine are noisy)."""
        for n in self.buckets:
            inputs = self.inputs([], lambda rid: [], n)
            jax.block_until_ready(self.run(inputs))
            for _ in range(3 if timed else 0):
                start = time.perf_counter()
                jax.block_until_ready(self.run(inputs))
                took = time.perf_counter() - start
                self.step_seconds[n] = min(took, self.step_seconds.get(n, took))
        for smaller, larger in zip(self.buckets[-2::-1], self.buckets[::-1]):  # a larger step is never cheaper
            if smaller in self.step_seconds:
                self.step_seconds[smaller] = min(self.step_seconds[smaller], self.step_seconds[larger])

    def bucket(self, tokens: int) -> int:
        return next(b for b in self.buckets if b >= tokens)

    def rows_for(self, n: int) -> int:
        """The logits rows a step of `n` tokens samples: one per slot, and with speculation one per guessed token
        too, within half the step's tokens (a large step is mostly prompt chunks: its head stays small)."""
        return min(n, self.max_rows, max(self.settings.max_num_seqs, n // 2))

    def run(self, inputs):
        """Dispatch the step (asynchronously); its (token, log-probability, top ids, top log-probabilities) rows."""
        self.pool, out = self._step(self.weights, self.pool, *inputs)
        return out

    def inputs(self, chunks: list[Chunk], tables_of: Callable[[str], list[list[int]]], n: int):
        """The step's arrays for `chunks` padded to `n` tokens (`tables_of(request id)`: its pages per cache group),
        and the logits rows it reads, in order, at most `rows_for(n)`: for a scored prompt each token's row first
        (greedy, its target the prompt's next token), then for a sampling chunk its last token's and its draft
        tokens' rows, each drawing with the sequence's key folded with its new token's index, as without a draft."""
        S, R = self.settings.max_num_seqs, self.rows_for(n)
        tokens, positions, slots = np.zeros(n, np.int32), np.zeros(n, np.int32), np.full(n, -1, np.int32)
        tables = np.zeros((len(self.groups), S, self.table_width), np.int32)
        select, counters, targets = np.zeros(R, np.int32), np.zeros(R, np.int32), np.full(R, -1, np.int32)
        temperature, top_p = np.zeros(R, np.float32), np.ones(R, np.float32)
        top_k, seeds = np.zeros(R, np.int32), np.zeros(R, np.int32)
        at = row = 0
        for c in chunks:
            seq, slot, count = c.seq, c.seq.slot, c.tokens
            tokens[at:at + count] = c.token_ids()
            positions[at:at + count] = np.arange(c.start, c.start + count)
            slots[at:at + count] = slot
            for g, held in enumerate(tables_of(seq.request_id)):
                tables[g, slot, :len(held)] = held
            if c.prompt_rows:
                scored = slice(row, row + c.prompt_rows)
                select[scored] = np.arange(at, at + c.prompt_rows)
                targets[scored] = seq.prompt[c.start + 1:c.start + 1 + c.prompt_rows]
                row += c.prompt_rows
            at += count
            rows, p = slice(row, row + c.rows), seq.params
            select[rows], counters[rows] = np.arange(at - c.rows, at), len(seq.output) + np.arange(c.rows)
            temperature[rows], top_k[rows], top_p[rows], seeds[rows] = p.temperature, p.top_k, p.top_p, p.seed
            row += c.rows
        longest = max((c.start + c.tokens for c in chunks), default=1)
        blocks = np.int32(paged.blocks_for(longest, self.settings.page_size))
        with_logprobs = np.bool_(any(c.seq.params.logprobs and c.samples or c.prompt_rows for c in chunks))
        return tokens, positions, slots, tables, select, blocks, temperature, top_k, top_p, seeds, counters, \
            with_logprobs, targets
