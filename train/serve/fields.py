"""What a request body may hold, checked before any of it is used: JSON of at most MAX_DEPTH levels whose strings
are Unicode text (a lone surrogate such as "\\ud800" is not), and only the fields of its endpoint this server
honours. A field it does not know (a misspelt `max_tokenz`) or does not implement (`best_of`, `logit_bias`,
`suffix`, `tools`, `response_format`, penalties...) is a 400 naming it, unless it holds the value that asks for
nothing (`best_of: 1`, `logit_bias: {}`...): none is ever ignored."""
from __future__ import annotations

import difflib
import json
from typing import Any

from train.serve.requests import RequestError

MAX_DEPTH = 32  # nesting levels of a body (a chat's text parts need 5)

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "logprobs", "stop",
           "seed", "user", "ignore_eos", "stop_token_ids", "presence_penalty", "frequency_penalty", "logit_bias"}
COMPLETION = frozenset(_COMMON | {"prompt", "echo", "best_of", "suffix"})
CHAT = frozenset(_COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                            "tool_choice", "parallel_tool_calls", "functions", "function_call"})
# Fields known but not implemented: the one value (besides null) that asks for nothing.
NOTHING = {"best_of": 1, "logit_bias": {}, "suffix": "", "tools": [], "functions": [], "tool_choice": "none",
           "function_call": "none", "response_format": {"type": "text"}, "presence_penalty": 0,
           "frequency_penalty": 0}
ROLES = ("system", "developer", "user", "assistant")  # developer: OpenAI's newer name of system
MESSAGE_FIELDS = ("role", "content")


def parse(raw: bytes) -> dict:
    """The body as a JSON object, its depth and text checked."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError(f"the body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError:
        raise RequestError("the body is not valid JSON (UTF-8)") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    _check_tree(body)
    return body


def _check_tree(body: dict) -> None:
    """Every string (keys too) encodes as UTF-8 and no value nests deeper than MAX_DEPTH; the error names the
    top-level field it is in."""
    stack: list[tuple[Any, int, str | None]] = [(body, 1, None)]
    while stack:
        value, depth, field = stack.pop()
        if depth > MAX_DEPTH:
            raise RequestError(f"{field}: nests deeper than {MAX_DEPTH} levels", field)
        if isinstance(value, dict):
            for key, item in value.items():
                top = field if field is not None else key
                _text(key, top)
                stack.append((item, depth + 1, top))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, field) for item in value)
        elif isinstance(value, str):
            _text(value, field)


def _text(value: str, field: str | None) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{field}: not valid Unicode text (a lone surrogate such as \\ud800); send UTF-8 text",
                           field) from None


def check(body: dict, known: frozenset[str], endpoint: str) -> None:
    """Every field of `body` is one this endpoint honours, and an unimplemented one asks for nothing."""
    for name, value in body.items():
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean {close[0]}?" if close else "; docs/serving.md lists the fields it takes"
            raise RequestError(f"{name}: not a field of {endpoint}{hint}", name)
        if name in NOTHING and value is not None and value != NOTHING[name]:
            raise RequestError(f"{name}={value!r}: not supported by this server; leave it out", name)


def check_message(i: int, message: Any) -> None:
    """A chat message: {role, content} alone, with a role the chat templates know."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"messages[{i}]: each message needs a string `role`", "messages")
    if message["role"] not in ROLES:
        raise RequestError(f"messages[{i}].role={message['role']!r}: use one of {', '.join(ROLES)}", "messages")
    extra = sorted(set(message) - set(MESSAGE_FIELDS))
    if extra:
        raise RequestError(f"messages[{i}].{extra[0]}: not supported by this server; send role and content",
                           "messages")
