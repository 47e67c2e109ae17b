"""The serving engine over a placed model (train/placed.py): requests in, one new token per running sequence per
`step()`, outputs out. The model runs as one jitted program over a flat batch of tokens (models/paged.py), on
weights split per layer once at build time, compiled then for a few bucketed token counts, never per request."""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
from typing import Literal

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
from train.placed import Placed
from train.serve.detokenize import Detokenizer
from train.serve.pages import Pages
from train.serve.sampling import SamplingParams, sample  # noqa: F401  (SamplingParams: the engine's API)
from train.serve.scheduler import Chunk, Scheduler, Sequence

MAX_LOGPROBS = 8  # the most top-N log-probabilities a request may ask for (compiled into the step)
CPU_SEQS_OF_PAGES = 1  # on CPU (no memory statistics) the pool holds every slot's longest sequence this many times


Settings = ServeSection  # serve.* (train/config/sections.py)


@dataclasses.dataclass
class Output:
    request_id: str
    token_ids: list[int]   # every token generated so far
    text: str | None
    finished: bool
    finish_reason: Literal["stop", "length", "abort"] | None
    logprobs: list[dict[int, float]] | None
    prompt_tokens: int


@dataclasses.dataclass
class Launched:
    """A step dispatched but not yet waited for (Engine.launch)."""
    outputs: list[Output]
    chunks: list[Chunk]
    result: tuple | None  # the step's device arrays; None when nothing ran


def buckets(s: Settings, ways: int = 1) -> list[int]:
    """The token counts the step compiles for: powers of two from serve.min_step_tokens (by default 1: a step of
    one decoding sequence runs one token, not eight), and the most one step can take (the token budget, or every
    slot's prompt chunk when that is fewer), each rounded up to a multiple of `ways` (the mesh's split of a
    mixture's rows: models/paged.py)."""
    most = min(s.max_batch_tokens, s.max_num_seqs * s.prefill_chunk)
    least = min(s.min_step_tokens, most)
    counts = [n for n in (least * 2 ** i for i in range(32)) if n < most] + [most]
    return sorted({ceil_div(n, ways) * ways for n in counts})


def page_bytes(cfg: models.ModelConfig, kv_heads: int, page_size: int, layers: int | None = None) -> int:
    """A page of keys and values over `layers` layers (default every one)."""
    n = cfg.n_layers if layers is None else layers
    return 2 * n * page_size * kv_heads * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize


def group_pages_per_seq(group: paged.CacheGroup, s: Settings, pages_per_seq: int) -> int:
    """The most pages one sequence holds in `group`: every one of its longest sequence in a causal group; in a
    sliding group its window's, plus the pages a prompt chunk adds while it runs (models/layer_spec.window_pages)."""
    if not group.window:
        return pages_per_seq
    return min(pages_per_seq, window_pages(group.window - 1 + s.prefill_chunk, s.page_size))


def pool_pages(placed: Placed, s: Settings, kv_heads: int, pages_per_seq: int) -> list[int]:
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


class Engine:
    replicas = 1  # one batch and pool (train/serve/replicas.py serves several)

    def __init__(self, placed: Placed, settings: Settings, max_context: int | None = None):
        cfg, family = placed.model, models.family_of(placed.model)
        if family.block is None:
            raise models.ModelConfigError(f"model.family={cfg.family!r} lends no Block: it has no paged decoding "
                                          f"(models/paged.py)")
        assert placed.layer_order is None, "decoding folds pipelines into data (train/placed.py)"
        # The stacked params stay the caller's: the engine decodes on its own per-layer copy (self.weights).
        self.placed, self.settings, self.cfg = dataclasses.replace(placed, params=None), settings, cfg
        kv_heads = family.parallel.kv_heads(cfg)
        ps = settings.page_size
        context = max_context or paged.max_context(cfg)
        self.pages_per_seq = ceil_div(context, ps)
        self.table_width = paged.table_width(self.pages_per_seq, ps)
        self.weights = self._unstacked(placed)  # before the pool is sized from the memory left
        self.groups = paged.cache_groups(cfg)
        self.group_pages = pool_pages(placed, settings, kv_heads, self.pages_per_seq)
        self.num_pages = sum(self.group_pages)
        self.max_context = min([context] + [(n - 1) * ps for g, n in zip(self.groups, self.group_pages)
                                            if not g.window])
        sizes = dict(placed.mesh.shape)
        rows_split = math.prod(sizes[a] for a in experts_lib.batch_axes(placed.layout.rules, sizes))
        self.buckets = buckets(settings, rows_split)
        self.pages = [Pages(n) for n in self.group_pages]
        self.scheduler = Scheduler(self.pages, [g.window for g in self.groups], settings)
        self.pool = self._empty_pool(kv_heads)
        self._step = self._compile(placed.layout.constrain())
        self._arrivals = itertools.count()
        self._by_id: dict[str, Sequence] = {}
        self._aborted: list[Output] = []
        self.tokens_generated = 0

    @classmethod
    def build(cls, placed: Placed, settings: Settings | None = None, max_context: int | None = None) -> "Engine":
        """An engine over `placed` (params required), its step compiled for every bucket (warmup). `max_context`:
        the longest sequence (prompt and new tokens) it takes; default the model's seq_len (rotary positions go
        further; a learned position table does not)."""
        settings = settings or Settings()
        assert placed.params is not None, "place the params first (train/placed.py)"
        limit = paged.position_limit(placed.model)
        assert not (limit and max_context and max_context > limit), (max_context, limit)
        engine = cls(placed, settings, max_context)
        engine.warmup()
        return engine

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

    def load_weights(self, weights) -> None:
        """Swap in new per-layer weights (`unstack`'s layout, in this engine's shardings: what `_unstacked` made),
        e.g. a trainer's newest policy; the step reads them from the next launch on, nothing is compiled again.
        Cached prefixes were computed with the old weights: `reset_prefix_cache` before the next requests."""
        old = jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding), self.weights)
        new = jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding), weights)
        assert old == new, "load_weights takes the engine's own layout (shapes, dtypes, shardings)"
        self.weights = weights

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (their keys and values came from weights since replaced); the engine must be
        idle. Its pages and slots start over as a new engine's, so what follows does not depend on what ran before."""
        assert not self.has_work(), "reset_prefix_cache needs an idle engine"
        counts = {k: getattr(self.scheduler, k) for k in ("prefix_hits", "prefix_queries", "prefill_tokens",
                                                          "preemptions")}
        self.pages = [Pages(n) for n in self.group_pages]
        self.scheduler = Scheduler(self.pages, [g.window for g in self.groups], self.settings)
        vars(self.scheduler).update(counts)  # stats() keeps counting across resets

    def _unstacked(self, placed: Placed):
        """The params split per layer in their shardings (models/paged.unstack), what every step reads."""
        out = paged.unstacked_shardings(placed.layout.params, self.cfg)
        return jax.jit(lambda p: paged.unstack(p, self.cfg), out_shardings=out)(placed.params)

    def _compile(self, constrain):
        cfg = self.cfg

        def run(weights, pool, tokens, positions, slots, tables, select, blocks, temperature, top_k, top_p, seeds,
                counters, with_logprobs):
            batch = paged.Batch(tokens, positions, slots, tables, select, blocks)
            logits, pool = paged.decode(weights, batch, pool, cfg, constrain)
            return pool, sample(logits, temperature, top_k, top_p, seeds, counters, MAX_LOGPROBS, with_logprobs)
        return jax.jit(run, donate_argnums=(1,))

    def warmup(self) -> None:
        """Compile (and run once on padding alone) the step of every bucket, so no request ever compiles."""
        for n in self.buckets:
            self._run(self._inputs([], n))

    # ------------------------------------------------------------------ requests

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        """Queue a request; ValueError (one line) for one the engine cannot take."""
        params = params or SamplingParams()
        params.check(MAX_LOGPROBS)
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("prompt_token_ids: empty; give at least one token")
        if len(prompt) + params.max_tokens > self.max_context:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"engine's max_context {self.max_context}; shorten the prompt or lower max_tokens")
        if any(not 0 <= t < self.cfg.vocab_size for t in prompt):
            raise ValueError(f"prompt_token_ids: ids must be in [0, {self.cfg.vocab_size})")
        if request_id in self._by_id:
            raise ValueError(f"request_id {request_id!r}: already in the engine")
        if self.full():
            raise ValueError(f"the queue is full (serve.max_waiting={self.settings.max_waiting}); retry later")
        codec = self.placed.codec
        seq = Sequence(request_id, prompt, params, next(self._arrivals),
                       detokenizer=None if codec is None else Detokenizer(codec))
        self._by_id[request_id] = seq
        self.scheduler.waiting.append(seq)

    def abort(self, request_id: str) -> None:
        """Drop a request; its last Output (finish_reason "abort") comes from the next step."""
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return
        if seq in self.scheduler.running:
            self.scheduler.retire(seq)
        else:
            self.scheduler.waiting.remove(seq)
        if seq.detokenizer is not None:
            seq.detokenizer.flush()
        self._aborted.append(self._output(seq, "abort"))

    def full(self) -> bool:
        """serve.max_waiting requests wait: add would refuse another."""
        return len(self.scheduler.waiting) >= self.settings.max_waiting

    def load(self) -> int:
        """Requests running or waiting (where replicas send the next: the least loaded)."""
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self._aborted)

    def stats(self) -> dict[str, int]:
        """The engine's counts; pages over every cache group, and each group's as `pages_used.<kind>` and
        `pages_free.<kind>` (kind `causal` or `sliding_<window>`)."""
        s = self.scheduler
        by_kind = {}
        for group, pages in zip(self.groups, self.pages):
            by_kind[f"pages_used.{group.kind}"] = pages.used()
            by_kind[f"pages_free.{group.kind}"] = pages.available()
        return {"running": len(s.running), "waiting": len(s.waiting),
                "pages_used": sum(p.used() for p in self.pages), "pages_free": sum(p.available() for p in self.pages),
                **by_kind, "prefix_hits": s.prefix_hits, "prefix_queries": s.prefix_queries,
                "tokens_generated": self.tokens_generated, "prefill_tokens": s.prefill_tokens,
                "preemptions": s.preemptions}

    # ------------------------------------------------------------------ the step

    def step(self) -> list[Output]:
        """One step: every running sequence gets one token (or a prompt chunk); returns the Output of each
        sequence that got a token, finished or aborted."""
        return self.collect(self.launch())

    def launch(self) -> "Launched":
        """The first half of a step: plan it and dispatch the model (asynchronously, so replicas on other
        devices launch theirs meanwhile: train/serve/replicas.py)."""
        outputs, self._aborted = self._aborted, []
        chunks = self.scheduler.plan()
        if not chunks:
            return Launched(outputs, [], None)
        total = sum(c.count for c in chunks)
        n = next(b for b in self.buckets if b >= total)
        return Launched(outputs, chunks, self._run(self._inputs(chunks, n)))

    def collect(self, launched: "Launched") -> list[Output]:
        """The second half: wait for the step's tokens and hand them to their sequences."""
        outputs, chunks = launched.outputs, launched.chunks
        if launched.result is None:
            return outputs
        token, chosen, top_ids, top_lp = (np.asarray(a) for a in launched.result)
        row = 0  # the sampling chunks' rows, in order (_inputs)
        for chunk in chunks:
            self.scheduler.computed(chunk)
            if chunk.samples:
                outputs.append(self._append(chunk.seq, int(token[row]), float(chosen[row]), top_ids[row],
                                            top_lp[row]))
                row += 1
        return outputs

    def _run(self, inputs):
        self.pool, out = self._step(self.weights, self.pool, *inputs)
        return out

    def _inputs(self, chunks: list[Chunk], n: int):
        """The step's arrays for `chunks` padded to `n` tokens, and one row of sampling settings for each chunk that
        ends its sequence's tokens (in order; at most n rows, nor more than the slots)."""
        S, R = self.settings.max_num_seqs, min(n, self.settings.max_num_seqs)
        tokens, positions, slots = np.zeros(n, np.int32), np.zeros(n, np.int32), np.full(n, -1, np.int32)
        tables = np.zeros((len(self.groups), S, self.table_width), np.int32)
        select, counters = np.zeros(R, np.int32), np.zeros(R, np.int32)
        temperature, top_p = np.zeros(R, np.float32), np.ones(R, np.float32)
        top_k, seeds = np.zeros(R, np.int32), np.zeros(R, np.int32)
        at = row = 0
        for c in chunks:
            seq, slot = c.seq, c.seq.slot
            tokens[at:at + c.count] = seq.token_slice(c.start, c.count)
            positions[at:at + c.count] = np.arange(c.start, c.start + c.count)
            slots[at:at + c.count] = slot
            for g, held in enumerate(seq.pages):
                tables[g, slot, :len(held)] = held
            at += c.count
            if c.samples:
                p = seq.params
                select[row], counters[row] = at - 1, len(seq.output)
                temperature[row], top_k[row], top_p[row], seeds[row] = p.temperature, p.top_k, p.top_p, p.seed
                row += 1
        longest = max((c.start + c.count for c in chunks), default=1)
        blocks = np.int32(paged.blocks_for(longest, self.settings.page_size))
        with_logprobs = np.bool_(any(c.seq.params.logprobs for c in chunks if c.samples))
        return tokens, positions, slots, tables, select, blocks, temperature, top_k, top_p, seeds, counters, \
            with_logprobs

    def _append(self, seq: Sequence, token: int, logprob: float, top_ids, top_lp) -> Output:
        seq.output.append(token)
        self.tokens_generated += 1
        if seq.params.logprobs:
            row = {int(i): float(lp) for i, lp in zip(top_ids[:seq.params.logprobs], top_lp[:seq.params.logprobs])}
            seq.logprobs.append({**row, token: logprob})
        stopped = token in seq.params.stop_token_ids
        if seq.detokenizer is not None and not stopped:
            seq.detokenizer.add(token)
        reason = None
        if stopped or seq.params.stop and seq.detokenizer is not None and \
                any(s in seq.detokenizer.text for s in seq.params.stop):
            reason = "stop"
        elif len(seq.output) >= seq.params.max_tokens or seq.length() >= self.max_context:
            reason = "length"
        if reason is not None:
            self.scheduler.retire(seq)
            del self._by_id[seq.request_id]
            if seq.detokenizer is not None:
                seq.detokenizer.flush()
        return self._output(seq, reason)

    def _text(self, seq: Sequence) -> str | None:
        """The new tokens as text (a stop token left out, a stop string and what follows cut; a half character at
        the end held back until the sequence finishes), or None without a tokenizer."""
        if seq.detokenizer is None:
            return None
        text = seq.detokenizer.text
        for s in seq.params.stop:
            if s in text:
                text = text[:text.index(s)]
        return text

    def _output(self, seq: Sequence, reason: str | None) -> Output:
        return Output(seq.request_id, list(seq.output), self._text(seq), reason is not None, reason,
                      list(seq.logprobs) if seq.params.logprobs else None, len(seq.prompt))

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Output]:
        """Run every prompt to completion; the final Output of each, in order."""
        params = params or SamplingParams()
        many = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{next(self._arrivals)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, many):
            self.add(rid, prompt, p)
        done: dict[str, Output] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]
