"""Continuous batching on the host: each step takes one token of every decoding sequence and chunks of prompts
(at most `prefill_chunk` each) within the token budget, admits waiting requests while slots and pages allow,
and, when pages run out, preempts the newest running sequence (its pages returned, recomputed on readmission).

Pages come from one allocator per cache group (models/paged.py): a causal group's sequence holds a page for every
`page_size` positions; a sliding group's holds only the pages its window still reaches, giving back each page that
falls out of it (a sequence's page list keeps page 0, the scratch page, at the positions given back)."""
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
    pages: list[list[int]] = dataclasses.field(default_factory=list)  # per cache group, by position // page_size
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
    def __init__(self, pages: list[Pages], windows: list[int], settings: ServeSection):
        """`pages`: one allocator per cache group, whose layers' `windows` (0: causal) it serves."""
        self.pages, self.windows, self.page_size = pages, windows, settings.page_size
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

    def first_needed(self, window: int, position: int) -> int:
        """The first page a token at `position` (or any later) reads in a group of `window` (0: every page)."""
        return max(0, position - window + 1) // self.page_size if window else 0

    def _grow(self, seq: Sequence, upto: int) -> bool:
        """Pages for positions seq.computed..upto-1 (and, in a causal group, every one before), without preempting
        anyone; False (nothing taken) if a group is short."""
        if not seq.pages:
            seq.pages = [[] for _ in self.pages]
        last = ceil_div(upto, self.page_size)
        missing = []
        for pages, window, held in zip(self.pages, self.windows, seq.pages):
            held += [0] * (last - len(held))
            missing.append([i for i in range(self.first_needed(window, seq.computed), last) if not held[i]])
            if len(missing[-1]) > pages.available():
                return False
        for pages, held, indices in zip(self.pages, seq.pages, missing):
            for i in indices:
                held[i] = pages.allocate()
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
        for pages, held in zip(self.pages, seq.pages):
            for page in held:
                if page:
                    pages.release(page)
        seq.pages, seq.keys, seq.computed = [], [], 0

    def _release_behind(self, seq: Sequence) -> None:
        """A sliding group's pages before the window of the sequence's next token go back (to the prefix cache's
        idle pages when registered)."""
        for pages, window, held in zip(self.pages, self.windows, seq.pages):
            for i in range(self.first_needed(window, seq.computed)):
                if held[i]:
                    pages.release(held[i])
                    held[i] = 0

    def held_pages(self, seq: Sequence) -> list[int]:
        """The pages `seq` holds in each cache group."""
        return [sum(1 for page in held if page) for held in seq.pages] if seq.pages else [0] * len(self.pages)

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Take the cached pages of the prompt's leading full pages (at least one token is left to compute, whose
        logits choose the next token): the most pages n for which every causal group has pages 0..n-1 cached and
        every sliding group those its window reaches from position n * page_size."""
        if not self.prefix_cache or seq.pages:
            return
        tokens, key, keys = seq.tokens, None, []
        for i in range((len(tokens) - 1) // self.page_size):
            key = (key, tuple(tokens[i * self.page_size:(i + 1) * self.page_size]))
            keys.append(key)
        n = self._reusable(keys)
        self.prefix_queries += min(n + 1, len(keys))
        self.prefix_hits += n
        seq.pages = [[] for _ in self.pages]
        for pages, window, held in zip(self.pages, self.windows, seq.pages):
            first = self.first_needed(window, n * self.page_size)
            held += [0] * first + [pages.lookup(k) for k in keys[first:n]]
        seq.keys, seq.computed = keys[:n], n * self.page_size

    def _reusable(self, keys: list) -> int:
        """The most leading pages of `keys` the groups hold cached, as `_reuse_prefix` needs them."""
        hit = [[k in pages.cached for k in keys] for pages in self.pages]
        n = len(keys)
        for window, cached in zip(self.windows, hit):
            if not window:
                n = min(n, cached.index(False) if False in cached else len(cached))
        while n and not all(all(cached[self.first_needed(w, n * self.page_size):n])
                            for w, cached in zip(self.windows, hit) if w):
            n -= 1
        return n

    def computed(self, chunk: Chunk) -> None:
        """After the step: the chunk's keys and values are in place; its new full pages join the prefix cache, and
        the pages a sliding window has passed go back."""
        seq = chunk.seq
        seq.computed = chunk.start + chunk.count
        if self.prefix_cache:
            while len(seq.keys) < seq.computed // self.page_size:
                i = len(seq.keys)
                key = (seq.keys[-1] if seq.keys else None, tuple(seq.token_slice(i * self.page_size, self.page_size)))
                for pages, held in zip(self.pages, seq.pages):
                    pages.register(key, held[i])
                seq.keys.append(key)
        self._release_behind(seq)
