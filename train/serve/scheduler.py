"""Continuous batching on the host: each step takes one token of every decoding sequence and chunks of prompts
(at most `prefill_chunk` each) within the token budget, admits waiting requests while slots and pages allow,
and, when pages run out, preempts the newest running sequence (its pages returned, recomputed on readmission).
Which pages a sequence holds is the KV-cache manager's (train/serve/pages.py): the scheduler asks it only whether
tokens fit and how many of a prompt's tokens its prefix cache holds."""
from __future__ import annotations

import collections
import dataclasses
from typing import Any

from train.config.sections import ServeSection
from train.serve.pages import KVCacheManager
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
    computed: int = 0      # tokens whose keys and values are in the pages
    detokenizer: Any = None  # the engine's: its new tokens' text (train/serve/detokenize.py), with a tokenizer
    spec: Any = None       # the speculator's: what it knows of this sequence (train/serve/speculative.py)
    # With params.prompt_logprobs: each prompt token's top log-probabilities and its own, by position (None first).
    prompt_logprobs: list[dict[int, float] | None] | None = None

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
    """The sequence's tokens start..start+count-1 in one step, then the `draft` tokens proposed after them
    (speculative decoding: train/serve/speculative.py), whose logits verify them."""
    seq: Sequence
    start: int
    count: int
    draft: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """The chunk ends at the sequence's last token: its logits choose the next one."""
        return self.start + self.count == self.seq.length()

    @property
    def tokens(self) -> int:
        return self.count + len(self.draft)

    @property
    def rows(self) -> int:
        """The chunk's last tokens whose logits the step samples: the last token's and each draft token's."""
        return 1 + len(self.draft) if self.samples else 0

    @property
    def prompt_rows(self) -> int:
        """The chunk's first tokens whose logits score the prompt token after them (a request that asks for the
        prompt's log-probabilities)."""
        if self.seq.params.prompt_logprobs is None:
            return 0
        return max(0, min(self.start + self.count, len(self.seq.prompt) - 1) - self.start)

    def token_ids(self) -> list[int]:
        return self.seq.token_slice(self.start, self.count) + list(self.draft)


def _extra_rows(chunk: Chunk) -> int:
    """The logits rows `chunk` takes beyond its sequence's own one."""
    return max(0, chunk.prompt_rows + chunk.rows - 1)


class Scheduler:
    def __init__(self, kv: KVCacheManager, settings: ServeSection):
        """`kv`: the pages of every cache group, and who holds them."""
        self.kv = kv
        self.max_num_seqs, self.max_batch_tokens = settings.max_num_seqs, settings.max_batch_tokens
        self.prefill_chunk = settings.prefill_chunk
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order
        self.free_slots = list(range(self.max_num_seqs))
        self.prefill_tokens = self.preemptions = 0

    def plan(self) -> list[Chunk]:
        """This step's chunks: the running sequences' (oldest first), then newly admitted ones'. Each sequence keeps
        one logits row for its own next token; the rows of the free slots (`spare`) go to prompts scored token by
        token, so a step never samples more rows than it has slots."""
        chunks, budget, spare = [], self.max_batch_tokens, len(self.free_slots)
        for seq in list(self.running):
            if seq not in self.running or budget == 0:
                continue
            count = self._count(seq, budget, spare)
            if self._reserve(seq, seq.computed + count):
                chunks.append(Chunk(seq, seq.computed, count))
                budget, spare = budget - count, spare - _extra_rows(chunks[-1])
        while self.waiting and self.free_slots and budget > 0 and spare > 0:
            seq = self.waiting[0]
            if not seq.computed and seq.params.prompt_logprobs is None:  # a scored prompt is computed whole
                seq.computed = self.kv.cached_prefix(seq.request_id, seq.token_slice, seq.length())
            count = self._count(seq, budget, spare - 1)
            if not self.kv.allocate(seq.request_id, seq.computed, seq.computed + count):
                self.kv.free(seq.request_id)
                seq.computed = 0
                break
            self.waiting.popleft()
            seq.slot = self.free_slots.pop(0)
            self.running.append(seq)
            chunks.append(Chunk(seq, seq.computed, count))
            budget, spare = budget - count, spare - 1 - _extra_rows(chunks[-1])
        self.prefill_tokens += sum(c.count for c in chunks if not (c.count == 1 and c.seq.output and c.samples))
        return chunks

    def _count(self, seq: Sequence, budget: int, spare: int) -> int:
        """The tokens of `seq` this step: one when decoding, else a prompt chunk (a scored one within its row and
        the `spare` rows)."""
        pending = seq.length() - seq.computed
        if pending == 1:
            return 1
        scored = seq.params.prompt_logprobs is not None
        return min(pending, self.prefill_chunk, budget, 1 + spare if scored else pending)

    def _reserve(self, seq: Sequence, upto: int) -> bool:
        """Pages for `seq`, preempting the newest other running sequences while short; False when `seq` is the
        newest itself, which is then preempted."""
        while not self.kv.allocate(seq.request_id, seq.computed, upto):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        self.retire(seq)
        later = [s for s in self.waiting if s.arrival > seq.arrival]
        index = len(self.waiting) - len(later)
        self.waiting.insert(index, seq)

    def retire(self, seq: Sequence) -> None:
        """Take `seq` out of the running set, its pages and slot returned."""
        self.running.remove(seq)
        self.kv.free(seq.request_id)
        self.free_slots.append(seq.slot)
        seq.slot, seq.computed = -1, 0

    def computed(self, chunk: Chunk, accepted: int = 0) -> None:
        """After the step: the chunk's keys and values are in place, its first `accepted` draft tokens' too (now
        the sequence's own); the KV-cache manager registers the new full pages, gives back what a sliding window
        has passed and, after a rejected draft token, the pages past the sequence's length."""
        seq = chunk.seq
        seq.computed = chunk.start + chunk.count + accepted
        self.kv.commit(seq.request_id, seq.computed, seq.token_slice)
        if chunk.draft:
            self.kv.truncate(seq.request_id, seq.length())
