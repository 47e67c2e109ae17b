"""Speculative decoding: a proposer guesses a decoding sequence's next tokens cheaply (prompt lookup in its own
tokens, or a smaller draft model: train/serve/draft.py), and the target verifies every guess of every sequence in
the one flat step it runs anyway, keeping the guesses that equal what it samples itself and its own next token.

Verification: row j of a sequence's chunk samples the target's token t_j with the key it would use without
speculation (the request's seed folded with the token's index); draft token j+1 is accepted while it equals t_j.
Each proposal is a point mass (ngram's lookup; the draft model's greedy choice), and for a point mass rejection
sampling (Leviathan et al. 2023, Chen et al. 2023: accept d with probability min(1, p(d)/q(d)) = p(d), else draw
from p without d) is exactly this: t_j ~ p, accept iff t_j = d. So outputs follow the target's distribution, and
are the tokens speculation off gives, greedy or seeded, whatever runs beside them.

How many tokens a step verifies: each proposal's j-th token adds alpha^j expected tokens (alpha: the sequence's
acceptance so far, starting from the engine's recent one); the step keeps the most valuable guesses while the
expected tokens per second, by the step's cost measured per token count at warmup, still grow. A full batch gains
little from guesses that cost a larger step, so proposals shrink as the batch fills."""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Callable

from train.config.sections import ServeSection
from train.exit_codes import ConfigError
from train.serve.pages import KVCacheManager
from train.serve.runner import ModelRunner
from train.serve.scheduler import Chunk, Sequence


def check_settings(s: ServeSection, cfg, draft_given: bool = False) -> None:
    """One-line errors for speculation settings that cannot work, before anything loads (`draft_given`: the
    draft model is at hand, serve.draft is not read)."""
    if s.speculative == "mtp":
        raise ConfigError(f"serve.speculative=mtp: needs a model with multi-token-prediction modules, which "
                          f"model.family={cfg.family} has none of; use serve.speculative=ngram or draft")
    if s.ngram_min > s.ngram_max:
        raise ConfigError(f"serve.ngram_min={s.ngram_min}: must be <= serve.ngram_max={s.ngram_max}")
    if s.speculative == "draft" and not draft_given:
        spec = s.draft
        path = pathlib.Path(spec[len("hf:"):] if spec.startswith("hf:") else spec).expanduser()
        if not spec or not (path / "config.json").is_file():
            raise ConfigError(f"serve.draft={spec!r}: give the draft model of serve.speculative=draft, a training "
                              f"run's directory or hf:DIR (a Hugging Face model directory)")


PRIOR_GUESSES = 2   # how many guesses the engine's recent acceptance counts for in a new sequence's
RECENT = 0.99       # the engine's record forgets this much per verified sequence-step
OPTIMISM = (4, 5)   # its record before any guess: 4 accepted of 5 (a first guess is worth trying)


@dataclasses.dataclass
class SpecState:
    """What the speculator knows of one sequence: its guesses' record and, for ngram, its n-gram index."""
    tried: int = 0      # guesses verified while every one before them was accepted
    accepted: int = 0
    index: "NgramIndex | None" = None

    def alpha(self, prior: float) -> float:
        """The chance the next guess is accepted: the sequence's record over two guesses accepted at `prior`."""
        return (self.accepted + PRIOR_GUESSES * prior) / (self.tried + PRIOR_GUESSES)


class NgramIndex:
    """Prompt lookup: every n-gram (n in [low, high]) of a sequence's tokens mapped to where its latest earlier
    occurrence ends, grown as tokens come; the guess continues the longest suffix's match."""

    def __init__(self, low: int, high: int):
        self.low, self.high = low, high
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(low, high + 1)}
        self.indexed = 0  # n-grams ending at or before this position are in `ends`

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to `k` tokens after the sequence's tokens, copied from after its longest suffix's latest earlier
        occurrence (continuing into the guess itself when the copy reaches the end: a loop repeats)."""
        length = seq.length()
        first = max(0, self.indexed - self.high)
        tokens = seq.token_slice(first, length - first)
        for end in range(max(self.indexed + 1, self.low), length):  # an n-gram ending at `end` has a successor
            for n in range(self.low, min(self.high, end) + 1):
                self.ends[n][tuple(tokens[end - n - first:end - first])] = end
        self.indexed = max(self.indexed, length - 1)
        for n in range(min(self.high, length), self.low - 1, -1):
            end = self.ends[n].get(tuple(tokens[length - n - first:]))
            if end is not None:
                guess = seq.token_slice(end, min(k, length - end))
                while len(guess) < k:
                    guess.append(guess[len(guess) - (length - end)])
                return guess
        return []


def plan_guesses(base_tokens: int, base_gain: float, wants: list[tuple[int, float]], most: int,
                 cost: Callable[[int, int], float], room: Callable[[int], int] = lambda tokens: tokens) -> list[int]:
    """How many guessed tokens each sequence gets. `wants[i]`: (the most it may take, its acceptance alpha);
    `cost(tokens, depth)`: a step's seconds with that many tokens when the deepest guess has `depth` tokens;
    `room(tokens)`: the guesses a step of that many tokens has logits rows for; `most`: its most tokens. Guesses
    go in order of value (alpha^j for a sequence's j-th) while expected tokens per second grow."""
    order = sorted(((alpha ** j, i) for i, (most_i, alpha) in enumerate(wants) for j in range(1, most_i + 1)),
                   key=lambda item: -item[0])
    counts, best, best_rate = [0] * len(wants), [0] * len(wants), base_gain / cost(base_tokens, 0)
    tokens, gain, depth = base_tokens, base_gain, 0
    for value, i in order:
        if tokens + 1 > most:
            break
        tokens, gain = tokens + 1, gain + value
        counts[i] += 1
        depth = max(depth, counts[i])
        rate = gain / cost(tokens, depth)
        if rate > best_rate and tokens - base_tokens <= room(tokens):
            best, best_rate = list(counts), rate
    return best


class Speculator:
    """The engine's speculation (serve.speculative ngram or draft): guesses onto the decoding chunks before the
    step, the verification's outcome after it, and the counts /metrics reports."""

    def __init__(self, settings: ServeSection, runner: ModelRunner, kv: KVCacheManager, draft=None):
        self.settings, self.runner, self.kv, self.draft = settings, runner, kv, draft
        self.k = settings.num_speculative_tokens
        self.proposed = self.accepted = self.steps = 0
        self._drafting = 0  # sequences the draft model may guess for in this step
        self._recent = [float(n) for n in OPTIMISM]  # the engine's (accepted, tried) guesses, decayed

    def extend(self, chunks: list[Chunk]) -> list[Chunk]:
        """`chunks` with guesses after the decoding sequences' tokens, as many as pay, each with its pages."""
        decoding = [i for i, c in enumerate(chunks) if c.samples and c.count == 1 and c.seq.output]
        limits = {i: self._limit(chunks[i].seq) for i in decoding}
        decoding = [i for i in decoding if limits[i] > 0]
        if not decoding:
            return chunks
        guesses = {i: self._ngram(chunks[i].seq, limits[i]) for i in decoding} if self.draft is None else {}
        prior = self._recent[0] / self._recent[1]
        wants = [(len(guesses[i]) if self.draft is None else limits[i], self._state(chunks[i].seq).alpha(prior))
                 for i in decoding]
        self._drafting = len(decoding)
        sampling, rows = sum(c.samples for c in chunks), sum(c.prompt_rows + c.rows for c in chunks)
        room = lambda tokens: self.runner.rows_for(self.runner.bucket(tokens)) - rows  # noqa: E731
        counts = plan_guesses(sum(c.tokens for c in chunks), sampling, wants, self.runner.buckets[-1], self.cost,
                              room)
        take = {i: n for i, n in zip(decoding, counts) if n}
        if self.draft is not None and take:
            drafted = self.draft.propose({chunks[i].seq: n for i, n in take.items()})
            guesses = {i: drafted.get(chunks[i].seq.request_id, []) for i in take}
        out = list(chunks)
        for i, n in take.items():
            c, guess = chunks[i], guesses[i][:n]
            if guess and self.kv.allocate(c.seq.request_id, c.seq.computed, c.start + c.count + len(guess)):
                out[i] = dataclasses.replace(c, draft=tuple(guess))
        return out

    def _limit(self, seq: Sequence) -> int:
        """The most guesses `seq` may take: each accepted one is a new token, within max_tokens and the context."""
        p = seq.params
        return max(0, min(self.k, p.max_tokens - len(seq.output) - 1, self.runner.max_context - seq.length() - 1))

    def _state(self, seq: Sequence) -> SpecState:
        if seq.spec is None:
            seq.spec = SpecState()
        return seq.spec

    def _ngram(self, seq: Sequence, limit: int) -> list[int]:
        state = self._state(seq)
        if state.index is None:
            state.index = NgramIndex(self.settings.ngram_min, self.settings.ngram_max)
        return state.index.propose(seq, limit)

    def cost(self, tokens: int, depth: int) -> float:
        """A step's seconds by its token count (the bucket it runs in), and the draft model's `depth` steps."""
        seconds = self.runner.step_seconds[self.runner.bucket(tokens)]
        return seconds + (self.draft.cost(depth, self._drafting) if self.draft is not None and depth else 0.0)

    def verified(self, chunk: Chunk, sampled: list[int]) -> int:
        """The chunk's guesses against the target's sampled tokens (one per row): how many were accepted."""
        accepted = 0
        while accepted < len(chunk.draft) and chunk.draft[accepted] == sampled[accepted]:
            accepted += 1
        if chunk.draft:
            state, tried = self._state(chunk.seq), min(accepted + 1, len(chunk.draft))
            state.tried += tried
            state.accepted += accepted
            self._recent = [RECENT * self._recent[0] + accepted, RECENT * self._recent[1] + tried]
            self.proposed, self.accepted, self.steps = (self.proposed + len(chunk.draft),
                                                        self.accepted + accepted, self.steps + 1)
        return accepted

    def synced(self, seq: Sequence) -> None:
        """After the step (and the sequence's new tokens): the draft model's cache follows."""
        if self.draft is not None:
            self.draft.sync(seq)

    def drop(self, request_id: str) -> None:
        if self.draft is not None:
            self.draft.drop(request_id)

    def stats(self) -> dict[str, float]:
        return with_mean({"spec_proposed_tokens": self.proposed, "spec_accepted_tokens": self.accepted,
                          "spec_verify_steps": self.steps})


def with_mean(stats: dict[str, float]) -> dict[str, float]:
    """`stats` with spec_mean_accepted_length: the tokens a sequence gained per step that verified guesses (its
    accepted guesses and the target's own token, as vLLM's mean acceptance length counts them)."""
    steps = stats["spec_verify_steps"]
    return {**stats, "spec_mean_accepted_length": 1 + stats["spec_accepted_tokens"] / steps if steps else 0.0}

