"""What the engine accepts: the one check of a request's values, shared by the HTTP layer (train/serve/protocol.py)
and `Engine.add`, whose RequestError carries the field it names; and the engine's request table, the sequences it
holds by id."""
from __future__ import annotations

import itertools
import math
from typing import Any

from train.serve.sampling import SamplingParams
from train.serve.scheduler import Sequence

INT32 = 2 ** 31


class RequestError(ValueError):
    """A request the engine cannot take; `param` names the field (the 400 body's `param`), None for the body;
    `status`: the HTTP status the server answers with."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def _finite(value: float, low: float, high: float, low_open: bool) -> bool:
    return math.isfinite(value) and (value > low if low_open else value >= low) and value <= high


def check_sampling(params: SamplingParams, vocab: int, max_logprobs: int) -> None:
    """RequestError (one line naming the field) for a sampling value the engine cannot honour."""
    p = params
    for name, ok, rule in (("temperature", _finite(p.temperature, 0, math.inf, False), "a finite number >= 0"),
                           ("top_p", _finite(p.top_p, 0, 1, True), "a number in (0, 1]"),
                           ("top_k", p.top_k >= 0, ">= 0"),
                           ("seed", -INT32 <= p.seed < INT32, "a 32-bit integer"),
                           ("max_tokens", p.max_tokens >= 1, ">= 1"),
                           ("logprobs", 0 <= p.logprobs <= max_logprobs, f"in [0, {max_logprobs}]"),
                           ("stop", all(isinstance(s, str) and s for s in p.stop), "non-empty strings"),
                           ("stop_token_ids", all(0 <= t < vocab for t in p.stop_token_ids), f"ids in [0, {vocab})")):
        if not ok:
            value = getattr(p, name)
            raise RequestError(f"{name}={value!r}: must be {rule}", name)


def check_length(prompt_len: int, max_tokens: int, max_context: int) -> None:
    """The prompt and its new tokens within the model's context (the engine's max_context)."""
    if prompt_len >= max_context:
        raise RequestError(f"prompt: {prompt_len} tokens leave no room for new ones in the model's context of "
                           f"{max_context} (max_context); shorten it", "prompt")
    if prompt_len + max_tokens > max_context:
        raise RequestError(f"max_tokens={max_tokens}: the prompt ({prompt_len} tokens) and max_tokens exceed the "
                           f"model's context of {max_context} (max_context); lower it to {max_context - prompt_len} "
                           f"or less", "max_tokens")


def check_request(prompt: list[int], params: SamplingParams, vocab: int, max_context: int,
                  max_logprobs: int) -> None:
    """Every value of a request: its prompt's ids, its sampling settings and its length."""
    if not prompt:
        raise RequestError("prompt: empty; give at least one token", "prompt")
    if any(not 0 <= t < vocab for t in prompt):
        raise RequestError(f"prompt: token ids must be in [0, {vocab})", "prompt")
    check_sampling(params, vocab, max_logprobs)
    check_length(len(prompt), params.max_tokens, max_context)


class RequestTable:
    """The engine's requests by id, each a scheduler Sequence, with their arrival order."""

    def __init__(self):
        self._by_id: dict[str, Sequence] = {}
        self._arrivals = itertools.count()

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, detokenizer: Any) -> Sequence:
        if request_id in self._by_id:
            raise RequestError(f"request_id {request_id!r}: already in the engine", "request_id")
        seq = Sequence(request_id, prompt, params, next(self._arrivals), detokenizer=detokenizer)
        self._by_id[request_id] = seq
        return seq

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def pop(self, request_id: str) -> Sequence | None:
        return self._by_id.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def next_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._arrivals)}"
