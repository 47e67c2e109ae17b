"""The OpenAI request bodies the server takes, checked field by field into (prompt token ids, SamplingParams), and
the response objects it writes back. A bad field is a RequestError naming it (the 400 body's `param`); the values
are checked by the engine's own check (train/serve/requests.py)."""
from __future__ import annotations

import random
import time
import uuid
from typing import Any

from train.serve import fields
from train.serve.engine import MAX_LOGPROBS, Output, SamplingParams
from train.serve.requests import INT32, RequestError, check_sampling


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_KINDS = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string"}


def get(body: dict, name: str, kind: str, default: Any = None, ok=None, rule: str = "") -> Any:
    """body[name] (default when absent or null) checked to be of `kind` (int, number, bool, str) and `ok`."""
    value = body.get(name)
    if value is None:
        return default
    typed = {"int": _is_int, "number": _is_number, "bool": lambda v: isinstance(v, bool),
             "str": lambda v: isinstance(v, str)}[kind](value)
    if not typed:
        raise RequestError(f"{name}: expected {_KINDS[kind]}, got {type(value).__name__} {value!r}", name)
    if ok is not None and not ok(value):
        raise RequestError(f"{name}={value!r}: must be {rule}", name)
    return value


def _int_list(value, name: str, vocab: int) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise RequestError(f"{name}: expected a list of integer token ids", name)
    if any(not 0 <= t < vocab for t in value):
        raise RequestError(f"{name}: token ids must be in [0, {vocab})", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop: expected a non-empty string or a list of them", "stop")
    return tuple(stop)


def sampling(body: dict, vocab: int, max_tokens: int, eos_id: int | None, logprobs: int,
             extra_stop: tuple[str, ...] = ()) -> SamplingParams:
    """The sampling fields common to both endpoints."""
    if get(body, "n", "int", 1) != 1:
        raise RequestError("n: only n=1 is supported; send one request per completion", "n")
    temperature = get(body, "temperature", "number", 1.0)
    top_p = get(body, "top_p", "number", 1.0)
    top_k = get(body, "top_k", "int", 0, lambda v: v >= -1, ">= -1 (0 or -1: off)")
    seed = get(body, "seed", "int", None)
    stop_ids = tuple(_int_list(body["stop_token_ids"], "stop_token_ids", vocab)) if body.get("stop_token_ids") else ()
    if not get(body, "ignore_eos", "bool", False) and eos_id is not None and eos_id < vocab:
        stop_ids += (eos_id,)
    params = SamplingParams(temperature=float(temperature), top_k=max(top_k, 0), top_p=float(top_p),
                            seed=random.randrange(INT32) if seed is None else seed, max_tokens=max_tokens,
                            stop_token_ids=stop_ids, stop=_stop(body) + extra_stop, logprobs=logprobs)
    check_sampling(params, vocab, MAX_LOGPROBS)
    return params


def check_model(body: dict, served: str) -> None:
    model = get(body, "model", "str", served)
    if model != served:
        raise RequestError(f"model {model!r}: no such model; this server serves {served!r} (GET /v1/models)", "model")


def max_tokens_of(body: dict, names: tuple[str, ...], default: int) -> int:
    for name in names:
        if body.get(name) is not None:
            return get(body, name, "int", None, lambda v: v >= 1, ">= 1")
    return default


def completion_prompt(body: dict, codec, vocab: int) -> list[int]:
    """`prompt`: text, token ids, or a list holding one of those."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = codec.encode(prompt)
    elif isinstance(prompt, list) and prompt:
        ids = _int_list(prompt, "prompt", vocab)
    else:
        raise RequestError("prompt: expected a string or a list of token ids (one prompt per request)", "prompt")
    if not ids:
        raise RequestError("prompt: empty; give at least one token", "prompt")
    return ids


def chat_messages(body: dict) -> list[dict]:
    """`messages` with each content as one string (a list of text parts joined), as the chat template takes;
    `developer` read as `system`."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: expected a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(messages):
        fields.check_message(i, m)
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"messages[{i}].content: only text content parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content: must be a string or a list of text parts", "messages")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


def completion_logprobs(body: dict) -> int:
    return get(body, "logprobs", "int", 0, lambda v: 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]")


def chat_logprobs(body: dict) -> tuple[bool, int]:
    wanted = get(body, "logprobs", "bool", False)
    top = get(body, "top_logprobs", "int", 0, lambda v: 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]")
    if top and not wanted:
        raise RequestError("top_logprobs: needs logprobs=true", "top_logprobs")
    return wanted, top


def stream_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise RequestError("stream_options: expected an object", "stream_options")
    return bool(get(options, "include_usage", "bool", False))


# ------------------------------------------------------------------------------------------------ responses

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(out: Output) -> dict:
    n = len(out.token_ids)
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": n, "total_tokens": out.prompt_tokens + n}


def finish(out: Output) -> str | None:
    return out.finish_reason if out.finished else None


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of `text` to hold back while streaming: a partial UTF-8 character, or the
    start of a stop string that may yet complete (and be cut)."""
    hold = 1 if text.endswith("\ufffd") else 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


def completion_logprobs_body(codec, tokens: list[int], rows: list[dict[int, float] | None], top: int,
                             offset: int = 0) -> dict:
    """The legacy completions `logprobs` object; a row None (an echoed prompt's first token) has none. `offset`:
    the text before the first token (what a stream already sent)."""
    text = [codec.decode([t]) for t in tokens]
    offsets, at = [], offset
    for piece in text:
        offsets.append(at)
        at += len(piece)
    return {"tokens": text, "token_logprobs": [None if row is None else row[t] for t, row in zip(tokens, rows)],
            "top_logprobs": [None if row is None else {codec.decode([i]): lp for i, lp in list(row.items())[:top]}
                             for row in rows],
            "text_offset": offsets}


def chat_logprobs_body(codec, tokens: list[int], rows: list[dict[int, float]], top: int) -> dict:
    def entry(t, lp):
        piece = codec.decode([t])
        return {"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8"))}
    return {"content": [{**entry(t, row[t]), "top_logprobs": [entry(i, lp) for i, lp in list(row.items())[:top]]}
                        for t, row in zip(tokens, rows)]}


def envelope(kind: str, rid: str, model: str, choices: list, extra: dict | None = None) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices,
            **(extra or {})}
