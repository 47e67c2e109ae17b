"""Continuous batching on the host: each step takes one token of every decoding sequence and chunks of prompts
(at most `prefill_chunk` each) within the token budget, admits waiting requests while slots and pages allow,
and, when pages run out, preempts the newest running sequence (its pages returned, recomputed on readmission)."""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Hashable

from mesh.numbers import ceil_div
from train.config.sections import ServeSection
from train.serve.pages import Pages
from train.serve.sampling import SamplingParams


@dataclasses.dataclass(eq=False)
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: int
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0      # tokens whose keys and values are in the pages
    keys: list[Hashable] = dataclasses.field(default_factory=list)  # prefix keys of its full pages, in order
    detokenizer: Any = None  # the engine's: its new tokens' text (train/serve/detokenize.py), with a tokenizer

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def length(self) -> int:
        """len(tokens), without building the list (read for every sequence in every step)."""
        return len(self.prompt) + len(self.output)

    def token_slice(self, start: int, count: int) -> list[int]:
        """tokens[start:start + count], without building the whole list when it lies in the output."""
        at = start - len(self.prompt)
        return self.output[at:at + count] if at >= 0 else self.tokens[start:start + count]


@dataclasses.dataclass(frozen=True)
class Chunk:
    seq: Sequence
    start: int
    count: int

    @property
    def samples(self) -> bool:
        """The chunk ends at the sequence's last token: its logits choose the next one."""
        return self.start + self.count == self.seq.length()


class Scheduler:
    def __init__(self, pages: Pages, settings: ServeSection):
        self.pages, self.page_size = pages, settings.page_size
        self.max_num_seqs, self.max_batch_tokens = settings.max_num_seqs, settings.max_batch_tokens
        self.prefill_chunk, self.prefix_cache = settings.prefill_chunk, settings.prefix_cache
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order
        self.free_slots = list(range(self.max_num_seqs))
        self.prefix_hits = self.prefix_queries = self.prefill_tokens = self.preemptions = 0

    def plan(self) -> list[Chunk]:
        """This step's chunks: the running sequences' (oldest first), then newly admitted ones'."""
        chunks, budget = [], self.max_batch_tokens
        for seq in list(self.running):
            if seq not in self.running or budget == 0:
                continue
            count = self._count(seq, budget)
            if self._reserve(seq, seq.computed + count):
                chunks.append(Chunk(seq, seq.computed, count))
                budget -= count
        while self.waiting and self.free_slots and budget > 0:
            seq = self.waiting[0]
            self._reuse_prefix(seq)
            count = self._count(seq, budget)
            if not self._grow(seq, seq.computed + count):
                self._drop_pages(seq)
                break
            self.waiting.popleft()
            seq.slot = self.free_slots.pop(0)
            self.running.append(seq)
            chunks.append(Chunk(seq, seq.computed, count))
            budget -= count
        self.prefill_tokens += sum(c.count for c in chunks if not (c.count == 1 and c.seq.output and c.samples))
        return chunks

    def _count(self, seq: Sequence, budget: int) -> int:
        pending = seq.length() - seq.computed
        return 1 if pending == 1 else min(pending, self.prefill_chunk, budget)

    def _grow(self, seq: Sequence, upto: int) -> bool:
        """Pages for positions < `upto`, without preempting anyone; False (nothing taken) if short."""
        need = ceil_div(upto, self.page_size) - len(seq.pages)
        if need > self.pages.available():
            return False
        seq.pages += [self.pages.allocate() for _ in range(need)]
        return True

    def _reserve(self, seq: Sequence, upto: int) -> bool:
        """Pages for `seq`, preempting the newest other running sequences while short; False when `seq` is the
        newest itself, which is then preempted."""
        while not self._grow(seq, upto):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        self.retire(seq)
        seq.computed = 0
        later = [s for s in self.waiting if s.arrival > seq.arrival]
        index = len(self.waiting) - len(later)
        self.waiting.insert(index, seq)

    def retire(self, seq: Sequence) -> None:
        """Take `seq` out of the running set, its pages and slot returned."""
        self.running.remove(seq)
        self._drop_pages(seq)
        self.free_slots.append(seq.slot)
        seq.slot = -1

    def _drop_pages(self, seq: Sequence) -> None:
        for page in seq.pages:
            self.pages.release(page)
        seq.pages, seq.keys, seq.computed = [], [], 0

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Take the cached pages of the prompt's leading full pages (at least one token is left to compute, whose
        logits choose the next token)."""
        if not self.prefix_cache or seq.pages:
            return
        tokens = seq.tokens
        key = None
        for i in range((len(tokens) - 1) // self.page_size):
            key = (key, tuple(tokens[i * self.page_size:(i + 1) * self.page_size]))
            self.prefix_queries += 1
            page = self.pages.lookup(key)
            if page is None:
                break
            self.prefix_hits += 1
            seq.pages.append(page)
            seq.keys.append(key)
        seq.computed = len(seq.pages) * self.page_size

    def computed(self, chunk: Chunk) -> None:
        """After the step: the chunk's keys and values are in place; its new full pages join the prefix cache."""
        seq = chunk.seq
        seq.computed = chunk.start + chunk.count
        if not self.prefix_cache:
            return
        while len(seq.keys) < seq.computed // self.page_size:
            i = len(seq.keys)
            key = (seq.keys[-1] if seq.keys else None, tuple(seq.token_slice(i * self.page_size, self.page_size)))
            self.pages.register(key, seq.pages[i])
            seq.keys.append(key)
