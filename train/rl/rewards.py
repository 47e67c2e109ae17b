"""The reward: a user's `module:function`, or a built-in (`exact_answer`, `regex:PATTERN`), called as
fn(prompt, completion, answer) -> float. It is tried on the first prompt before any work, so a reward that does not
import, raises or returns a non-number is a one-line error; one that raises mid-run names the prompt it failed on."""
from __future__ import annotations

import importlib
import math
import numbers
import re
from typing import Callable

from train.exit_codes import ConfigError

Reward = Callable[[str, str, "str | None"], float]
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")


def boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in `text` (braces nested), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(completion: str) -> str | None:
    """The completion's answer: its last \\boxed{} text, else its last number; None when it has neither."""
    found = boxed(completion)
    if found is not None:
        return found
    numbers_ = _NUMBER.findall(completion)
    return numbers_[-1] if numbers_ else None


def _same(a: str, b: str) -> bool:
    """Equal as numbers when both read as one (1,000 = 1000.0), else as whitespace-trimmed text."""
    a, b = a.strip(), b.strip()
    try:
        return math.isclose(float(a.replace(",", "")), float(b.replace(",", "")), rel_tol=0, abs_tol=1e-9)
    except ValueError:
        return a == b


def exact_answer(prompt: str, completion: str, answer: str | None) -> float:
    """1.0 when the completion's final answer (`final_answer`) equals `answer`, else 0.0."""
    if answer is None:
        raise ValueError("exact_answer needs an \"answer\" on every prompt line")
    found = final_answer(completion)
    return float(found is not None and _same(found, str(answer)))


def matches(pattern: re.Pattern) -> Reward:
    """regex:PATTERN: 1.0 where the pattern is found in the completion."""
    return lambda prompt, completion, answer: float(pattern.search(completion) is not None)


def resolve(spec: str) -> Reward:
    """The function rl.reward names, or a one-line error naming the setting."""
    if spec == "exact_answer":
        return exact_answer
    if spec.startswith("regex:"):
        try:
            return matches(re.compile(spec[len("regex:"):]))
        except re.error as e:
            raise ConfigError(f"rl.reward={spec!r}: not a regular expression ({e})") from None
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"rl.reward={spec!r}: use module:function, exact_answer or regex:PATTERN")
    try:
        fn = getattr(importlib.import_module(module), name)
    except Exception as e:  # noqa: BLE001  (an import runs the user's code: anything may fail)
        raise ConfigError(f"rl.reward={spec!r}: does not import ({type(e).__name__}: {e}); make {module} importable "
                          f"(run from its directory or install it) and define {name} there") from None
    if not callable(fn):
        raise ConfigError(f"rl.reward={spec!r}: {module}.{name} is not a function")
    return fn


class RewardError(ConfigError):
    """The reward failed on a prompt (raised, or returned no number); one line naming it."""


def score(fn: Reward, spec: str, where: str, prompt: str, completion: str, answer: str | None) -> float:
    """fn's reward as a float, or RewardError naming the setting and `where` (the prompt's file and line)."""
    try:
        value = fn(prompt, completion, answer)
    except Exception as e:  # noqa: BLE001  (the user's function)
        raise RewardError(f"rl.reward={spec!r} raised {type(e).__name__}: {e} on the prompt of {where}; fix the "
                          f"reward or that line") from None
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):  # a bool counts as 0 or 1
        raise RewardError(f"rl.reward={spec!r} returned {value!r} on the prompt of {where}; it must return a finite "
                          f"number")
    return float(value)
