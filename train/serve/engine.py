"""The serving engine over a placed model (train/placed.py): requests in, one new token per running sequence per
`step()`, outputs out. The model runs as one jitted program over a flat batch of tokens (models/paged.py),
compiled at build time for a few bucketed token counts, never per request."""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
from models import paged
from sharding import experts as experts_lib
from sharding import specs as sharding_specs
from train.placed import Placed
from train.sections import ServeSection
from train.serve.pages import Pages
from train.serve.sampling import SamplingParams, sample  # noqa: F401  (SamplingParams: the engine's API)
from train.serve.scheduler import Chunk, Scheduler, Sequence

MAX_LOGPROBS = 8  # the most top-N log-probabilities a request may ask for (compiled into the step)
CPU_SEQS_OF_PAGES = 1  # on CPU (no memory statistics) the pool holds every slot's longest sequence this many times


Settings = ServeSection  # serve.* (train/sections.py)


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
    """The token counts the step compiles for: powers of two from 8, and the most one step can take (the token
    budget, or every slot's prompt chunk when that is fewer), each rounded up to a multiple of `ways` (the
    mesh's split of a mixture's rows: models/paged.py)."""
    most = min(s.max_batch_tokens, s.max_num_seqs * s.prefill_chunk)
    counts = [n for n in (2 ** i for i in range(3, 32)) if n < most] + [most]
    return sorted({-(-n // ways) * ways for n in counts})


def page_bytes(cfg: models.ModelConfig, kv_heads: int, page_size: int) -> int:
    return 2 * cfg.n_layers * page_size * kv_heads * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize


def pool_pages(placed: Placed, s: Settings, kv_heads: int, pages_per_seq: int) -> int:
    """`kv_pages`, or what kv_memory_fraction of the free memory of the first device holds (the pool is split
    over `tensor` by heads); on CPU, enough for every slot's longest sequence."""
    if s.kv_pages:
        return s.kv_pages
    device = placed.mesh.devices.flat[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    enough = CPU_SEQS_OF_PAGES * s.max_num_seqs * pages_per_seq + 1
    if not stats or "bytes_limit" not in stats:
        return enough
    tensor = placed.mesh.shape.get("tensor", 1)
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return max(2, int(s.kv_memory_fraction * free // (page_bytes(placed.model, kv_heads, s.page_size) // tensor)))


class Engine:
    replicas = 1  # one batch and pool (train/serve/replicas.py serves several)

    def __init__(self, placed: Placed, settings: Settings, max_context: int | None = None):
        cfg, family = placed.model, models.family_of(placed.model)
        if family.decoding is None or family.decoding.paged is None:
            raise models.ModelConfigError(f"model.family={cfg.family!r} has no paged decoding (models/paged.py)")
        self.placed, self.settings, self.cfg = placed, settings, cfg
        kv_heads = family.parallel.kv_heads(cfg)
        ps = settings.page_size
        context = max_context or paged.max_context(cfg)
        self.pages_per_seq = -(-context // ps)
        self.num_pages = pool_pages(placed, settings, kv_heads, self.pages_per_seq)
        self.max_context = min(context, (self.num_pages - 1) * ps)
        sizes = dict(placed.mesh.shape)
        rows_split = math.prod(sizes[a] for a in experts_lib.batch_axes(placed.layout.rules, sizes))
        self.buckets = buckets(settings, rows_split)
        self.pages = Pages(self.num_pages)
        self.scheduler = Scheduler(self.pages, settings)
        self.pool = self._empty_pool(kv_heads)
        self._step = self._compile(family.decoding.paged, placed.layout.constrain())
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

    def _empty_pool(self, kv_heads: int) -> dict[str, jax.Array]:
        shape = paged.pool_shape(self.cfg, kv_heads, self.num_pages, self.settings.page_size)
        mesh = self.placed.mesh
        spec = sharding_specs.mesh_spec(P(*paged.POOL_AXES), self.placed.layout.rules, shape,
                                        dict(mesh.shape))
        dtype = jnp.dtype(self.cfg.compute_dtype)
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=NamedSharding(mesh, spec))
        return {"k": zeros(), "v": zeros()}

    def _compile(self, paged_decode, constrain):
        cfg = self.cfg

        def run(params, pool, tokens, positions, slots, tables, select, temperature, top_k, top_p, seeds, counters):
            batch = paged.Batch(tokens, positions, slots, tables, select)
            logits, pool = paged_decode(params, batch, pool, cfg, constrain)
            return pool, sample(logits, temperature, top_k, top_p, seeds, counters, MAX_LOGPROBS)
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
        seq = Sequence(request_id, prompt, params, next(self._arrivals))
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
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting), "pages_used": self.pages.used(),
                "pages_free": self.pages.available(), "prefix_hits": s.prefix_hits,
                "prefix_queries": s.prefix_queries, "tokens_generated": self.tokens_generated,
                "prefill_tokens": s.prefill_tokens, "preemptions": s.preemptions}

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
        for chunk in chunks:
            self.scheduler.computed(chunk)
            if chunk.samples:
                outputs.append(self._append(chunk.seq, int(token[chunk.seq.slot]), float(chosen[chunk.seq.slot]),
                                            top_ids[chunk.seq.slot], top_lp[chunk.seq.slot]))
        return outputs

    def _run(self, inputs):
        self.pool, out = self._step(self.placed.params, self.pool, *inputs)
        return out

    def _inputs(self, chunks: list[Chunk], n: int):
        """The step's arrays for `chunks` padded to `n` tokens, one row of sampling settings per slot."""
        S = self.settings.max_num_seqs
        tokens, positions, slots = np.zeros(n, np.int32), np.zeros(n, np.int32), np.full(n, -1, np.int32)
        tables = np.zeros((S, self.pages_per_seq), np.int32)
        select, counters = np.zeros(S, np.int32), np.zeros(S, np.int32)
        temperature, top_p = np.zeros(S, np.float32), np.ones(S, np.float32)
        top_k, seeds = np.zeros(S, np.int32), np.zeros(S, np.int32)
        at = 0
        for c in chunks:
            seq, slot = c.seq, c.seq.slot
            tokens[at:at + c.count] = seq.tokens[c.start:c.start + c.count]
            positions[at:at + c.count] = np.arange(c.start, c.start + c.count)
            slots[at:at + c.count] = slot
            tables[slot, :len(seq.pages)] = seq.pages
            select[slot] = at + c.count - 1
            p = seq.params
            temperature[slot], top_k[slot], top_p[slot] = p.temperature, p.top_k, p.top_p
            seeds[slot], counters[slot] = p.seed, len(seq.output)
            at += c.count
        return tokens, positions, slots, tables, select, temperature, top_k, top_p, seeds, counters

    def _append(self, seq: Sequence, token: int, logprob: float, top_ids, top_lp) -> Output:
        seq.output.append(token)
        self.tokens_generated += 1
        if seq.params.logprobs:
            row = {int(i): float(lp) for i, lp in zip(top_ids[:seq.params.logprobs], top_lp[:seq.params.logprobs])}
            seq.logprobs.append({**row, token: logprob})
        reason = None
        if token in seq.params.stop_token_ids:
            reason = "stop"
        elif seq.params.stop and self.placed.codec is not None and \
                any(s in self.placed.codec.decode(seq.output) for s in seq.params.stop):
            reason = "stop"
        elif len(seq.output) >= seq.params.max_tokens or len(seq.tokens) >= self.max_context:
            reason = "length"
        if reason is not None:
            self.scheduler.retire(seq)
            del self._by_id[seq.request_id]
        return self._output(seq, reason)

    def _text(self, seq: Sequence) -> str | None:
        """The new tokens as text (a stop token left out, a stop string and what follows cut), or None without a
        tokenizer."""
        codec = self.placed.codec
        if codec is None:
            return None
        ids = [t for t in seq.output if t not in seq.params.stop_token_ids]
        text = codec.decode(ids)
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
