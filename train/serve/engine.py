"""The serving engine over a placed model (train/placed.py): requests in, new tokens per running sequence per
`step()`, outputs out. Its parts, after vLLM v1's: the request table and the one check of a request
(train/serve/requests.py), the scheduler (scheduler.py) over the KV-cache manager (pages.py), the model runner
(runner.py: the compiled step over weights split per layer) and the output processor (output.py). `ServingEngine`
is the interface the server, train.eval and train.sample drive, which data-parallel replicas declare too."""
from __future__ import annotations

import abc
import dataclasses

import numpy as np

from models import paged
from train.config.sections import ServeSection
from train.placed import Placed
from train.serve.output import Output, OutputProcessor
from train.serve.pages import KVCacheManager
from train.serve.requests import RequestError, RequestTable, check_request
from train.serve.runner import MAX_LOGPROBS, ModelRunner, speculative_tokens
from train.serve.sampling import SamplingParams
from train.serve.scheduler import Chunk, Scheduler, Sequence
from train.serve.speculative import Speculator, check_settings, with_mean

Settings = ServeSection  # serve.* (train/config/sections.py)
__all__ = ["MAX_LOGPROBS", "Engine", "Output", "RequestError", "SamplingParams", "ServingEngine", "Settings"]


class ServingEngine(abc.ABC):
    """What drives an engine: requests added and aborted, steps, counts. `settings`, `max_context`, `num_pages` and
    `replicas` describe it."""
    settings: ServeSection
    max_context: int
    num_pages: int
    replicas: int

    @abc.abstractmethod
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        """Queue a request; RequestError (one line, naming the field) for one the engine cannot take."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Drop a request; its last Output (finish_reason "abort") comes from the next step."""

    @abc.abstractmethod
    def step(self) -> list[Output]:
        """One step: the Output of each sequence that got tokens, finished or was aborted."""

    @abc.abstractmethod
    def full(self) -> bool:
        """serve.max_waiting requests wait: add would refuse another."""

    @abc.abstractmethod
    def load(self) -> int:
        """Requests running or waiting."""

    @abc.abstractmethod
    def has_work(self) -> bool:
        """Something runs, waits, or owes its last Output."""

    @abc.abstractmethod
    def stats(self) -> dict[str, float]:
        """The engine's counts (docs/serving.md)."""

    @abc.abstractmethod
    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (after new weights)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Output]:
        """Run every prompt to completion (queued as serve.max_waiting allows); the final Output of each, in order."""
        params = params or SamplingParams()
        many = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self._generate_id() for _ in prompts]
        pending = list(zip(ids, prompts, many))[::-1]
        done: dict[str, Output] = {}
        while len(done) < len(ids):
            while pending and not self.full():
                self.add(*pending.pop())
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]

    @abc.abstractmethod
    def _generate_id(self) -> str:
        """A request id no caller uses (generate's)."""


@dataclasses.dataclass
class Launched:
    """A step dispatched but not yet waited for (Engine.launch)."""
    outputs: list[Output]
    chunks: list[Chunk]
    result: tuple | None  # the step's device arrays; None when nothing ran


class Engine(ServingEngine):
    replicas = 1  # one batch and pool (train/serve/replicas.py serves several)

    def __init__(self, placed: Placed, settings: Settings, max_context: int | None = None,
                 draft: Placed | None = None):
        """`draft`: serve.speculative=draft's model, placed on the same mesh."""
        check_settings(settings, placed.model, draft is not None)
        self.runner = ModelRunner(placed, settings, max_context, 1 + speculative_tokens(settings))
        self.placed, self.settings, self.cfg = self.runner.placed, settings, self.runner.cfg
        self.max_context, self.num_pages = self.runner.max_context, sum(self.runner.group_pages)
        self.kv = KVCacheManager(self.runner.group_pages, self.runner.windows, settings.page_size,
                                 settings.prefix_cache)
        self.scheduler = Scheduler(self.kv, settings)
        self.requests = RequestTable()
        self.outputs = OutputProcessor(placed.codec, self.max_context)
        self.speculator = None
        if speculative_tokens(settings):
            from train.serve import draft as draft_lib
            proposer = None if draft is None else draft_lib.DraftProposer(draft, settings, self.max_context)
            self.speculator = Speculator(settings, self.runner, self.kv, proposer)
        self._aborted: list[Output] = []
        self.tokens_generated = 0

    @classmethod
    def build(cls, placed: Placed, settings: Settings | None = None, max_context: int | None = None,
              draft: Placed | None = None) -> "Engine":
        """An engine over `placed` (params required), its step compiled for every bucket (warmup). `max_context`:
        the longest sequence (prompt and new tokens) it takes; default the model's seq_len (rotary positions go
        further; a learned position table does not). `draft`: serve.speculative=draft's model, read from
        serve.draft when not given."""
        settings = settings or Settings()
        assert placed.params is not None, "place the params first (train/placed.py)"
        limit = paged.position_limit(placed.model)
        assert not (limit and max_context and max_context > limit), (max_context, limit)
        if settings.speculative == "draft" and draft is None:
            from train.serve import draft as draft_lib
            check_settings(settings, placed.model)
            draft = draft_lib.load(settings.draft, placed)
        engine = cls(placed, settings, max_context, draft)
        engine.runner.warmup(timed=engine.speculator is not None)
        if engine.speculator is not None and engine.speculator.draft is not None:
            engine.speculator.draft.runner.warmup(timed=True)
        return engine

    # ------------------------------------------------------------------ requests

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        check_request(prompt, params, self.cfg.vocab_size, self.max_context, MAX_LOGPROBS)
        if self.full():
            raise RequestError(f"the queue is full (serve.max_waiting={self.settings.max_waiting}); retry later")
        seq = self.requests.add(request_id, prompt, params, self.outputs.detokenizer())
        self.scheduler.waiting.append(seq)

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id)
        if seq is None:
            return
        if seq in self.scheduler.running:
            self.scheduler.retire(seq)
        else:
            self.scheduler.waiting.remove(seq)
            self.kv.free(request_id)
        self.outputs.finish(seq)
        if self.speculator is not None:
            self.speculator.drop(request_id)
        self._aborted.append(self.outputs.output(seq, "abort"))

    def full(self) -> bool:
        return len(self.scheduler.waiting) >= self.settings.max_waiting

    def load(self) -> int:
        """Requests running or waiting (where replicas send the next: the least loaded)."""
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self._aborted)

    def stats(self) -> dict[str, float]:
        """The engine's counts; pages over every cache group, and each group's as `pages_used.<kind>` and
        `pages_free.<kind>` (kind `causal` or `sliding_<window>`)."""
        s, kv = self.scheduler, self.kv
        by_kind = {}
        for group, pages in zip(self.runner.groups, kv.groups):
            by_kind[f"pages_used.{group.kind}"] = pages.used()
            by_kind[f"pages_free.{group.kind}"] = pages.available()
        return {"running": len(s.running), "waiting": len(s.waiting), "pages_used": kv.used(),
                "pages_free": kv.available(), **by_kind, "prefix_hits": kv.prefix_hits,
                "prefix_queries": kv.prefix_queries, "tokens_generated": self.tokens_generated,
                "prefill_tokens": s.prefill_tokens, "preemptions": s.preemptions, **self._spec_stats()}

    def _spec_stats(self) -> dict[str, float]:
        if self.speculator is not None:
            return self.speculator.stats()
        return with_mean({"spec_proposed_tokens": 0, "spec_accepted_tokens": 0, "spec_verify_steps": 0})

    def update_weights(self, weights) -> None:
        """Decode on new per-layer weights (in `runner.weight_shardings()`; nothing recompiles) and forget the
        prefix cache, whose keys and values the old weights computed."""
        self.runner.update_weights(weights)
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    def _generate_id(self) -> str:
        return self.requests.next_id("generate")

    # ------------------------------------------------------------------ the step

    def step(self) -> list[Output]:
        return self.collect(self.launch())

    def launch(self) -> Launched:
        """The first half of a step: plan it and dispatch the model (asynchronously, so replicas on other
        devices launch theirs meanwhile: train/serve/replicas.py)."""
        outputs, self._aborted = self._aborted, []
        chunks = self.scheduler.plan()
        if not chunks:
            return Launched(outputs, [], None)
        if self.speculator is not None:
            chunks = self.speculator.extend(chunks)
        n = self.runner.bucket(sum(c.tokens for c in chunks))
        return Launched(outputs, chunks, self.runner.run(self.runner.inputs(chunks, self.kv.tables, n)))

    def collect(self, launched: Launched) -> list[Output]:
        """The second half: wait for the step's tokens and hand them to their sequences."""
        outputs, chunks = launched.outputs, launched.chunks
        if launched.result is None:
            return outputs
        token, chosen, top_ids, top_lp = (np.asarray(a) for a in launched.result)
        row = 0  # the chunks' logits rows, in order (ModelRunner.inputs)
        for chunk in chunks:
            if chunk.prompt_rows:
                self.outputs.score_prompt(chunk, chosen[row:], top_ids[row:], top_lp[row:])
                row += chunk.prompt_rows
            if not chunk.samples:
                self.scheduler.computed(chunk)
                continue
            seq, rows = chunk.seq, chunk.rows  # read before the new tokens make the chunk no longer the last
            sampled = [int(t) for t in token[row:row + rows]]
            accepted = self.speculator.verified(chunk, sampled) if chunk.draft else 0
            kept, reason = 0, None
            while reason is None and kept <= accepted:  # the accepted guesses, then the target's own token
                r = row + kept
                reason = self.outputs.take(seq, sampled[kept], float(chosen[r]), top_ids[r], top_lp[r])
                kept += 1
            self.tokens_generated += kept
            self.scheduler.computed(chunk, kept - 1)
            if reason is not None:
                self._finish(seq)
            elif self.speculator is not None:
                self.speculator.synced(seq)
            outputs.append(self.outputs.output(seq, reason))
            row += rows
        return outputs

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.retire(seq)
        self.requests.pop(seq.request_id)
        self.outputs.finish(seq)
        if self.speculator is not None:
            self.speculator.drop(seq.request_id)
