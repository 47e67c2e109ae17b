"""The engine's output processor: from the tokens a step samples to what a client reads. It ends a sequence at a
stop id, a stop string or its length, grows its text with the incremental detokenizer (train/serve/detokenize.py),
keeps the log-probabilities asked for, and shapes each `Output`."""
from __future__ import annotations

import dataclasses
from typing import Literal

from train.serve.detokenize import Detokenizer
from train.serve.scheduler import Sequence

Reason = Literal["stop", "length", "abort"]


@dataclasses.dataclass
class Output:
    request_id: str
    token_ids: list[int]   # every token generated so far
    text: str | None
    finished: bool
    finish_reason: Reason | None
    logprobs: list[dict[int, float]] | None
    prompt_tokens: int
    # With SamplingParams.prompt_logprobs: each prompt token's top log-probabilities and its own (None for the first).
    prompt_logprobs: list[dict[int, float] | None] | None = None


class OutputProcessor:
    def __init__(self, codec, max_context: int):
        """`codec`: the model's tokenizer (train/data/tokenizer.Codec), or None (no text, no stop strings)."""
        self.codec, self.max_context = codec, max_context

    def detokenizer(self) -> Detokenizer | None:
        return None if self.codec is None else Detokenizer(self.codec)

    def take(self, seq: Sequence, token: int, logprob: float, top_ids, top_lp) -> Reason | None:
        """Append one sampled token (its log-probability, and the step's top ids and log-probabilities of its
        row); the reason it ends the sequence, or None."""
        seq.output.append(token)
        n = seq.params.logprobs
        if n:
            seq.logprobs.append({**{int(i): float(lp) for i, lp in zip(top_ids[:n], top_lp[:n])}, token: logprob})
        stopped = token in seq.params.stop_token_ids
        if seq.detokenizer is not None and not stopped:
            seq.detokenizer.add(token)
        if stopped or seq.params.stop and seq.detokenizer is not None and \
                any(s in seq.detokenizer.text for s in seq.params.stop):
            return "stop"
        if len(seq.output) >= seq.params.max_tokens or seq.length() >= self.max_context:
            return "length"
        return None

    def score_prompt(self, chunk, chosen, top_ids, top_lp) -> None:
        """Keep the log-probabilities of the prompt tokens after the chunk's first `prompt_rows` tokens (rows in
        order: the target's own log-probability, the step's top ids and log-probabilities)."""
        seq, n = chunk.seq, chunk.seq.params.prompt_logprobs
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None] * len(seq.prompt)
        for i in range(chunk.prompt_rows):
            target = seq.prompt[chunk.start + 1 + i]
            row = {int(t): float(lp) for t, lp in zip(top_ids[i][:n], top_lp[i][:n])}
            seq.prompt_logprobs[chunk.start + 1 + i] = {**row, target: float(chosen[i])}

    def finish(self, seq: Sequence) -> None:
        """The sequence gets no more tokens: the text of its last ids (a half character as U+FFFD)."""
        if seq.detokenizer is not None:
            seq.detokenizer.flush()

    def text(self, seq: Sequence) -> str | None:
        """The new tokens as text (a stop token left out, a stop string and what follows cut; a half character at
        the end held back until the sequence finishes), or None without a tokenizer."""
        if seq.detokenizer is None:
            return None
        text = seq.detokenizer.text
        for s in seq.params.stop:
            if s in text:
                text = text[:text.index(s)]
        return text

    def output(self, seq: Sequence, reason: Reason | None) -> Output:
        scored = seq.params.prompt_logprobs is not None and seq.prompt_logprobs is not None
        return Output(seq.request_id, list(seq.output), self.text(seq), reason is not None, reason,
                      list(seq.logprobs) if seq.params.logprobs else None, len(seq.prompt),
                      list(seq.prompt_logprobs) if scored else None)
