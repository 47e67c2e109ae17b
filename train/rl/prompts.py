"""The prompts of a run (rl.prompts, JSONL): each line's prompt as text and token ids, with its answer; and the order
they are drawn in, a function of (train.seed, step) alone, so a resumed run draws what an uninterrupted one does."""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Callable

import numpy as np

from train.exit_codes import ConfigError


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str            # what the reward reads (a conversation rendered by the chat template)
    ids: tuple[int, ...]  # what the engine reads
    answer: str | None
    where: str           # FILE:LINE, for messages


def _answer(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"rl.prompts={where}: \"answer\" must be a string or a number, not {type(value).__name__}")


def _text(record: Any, where: str, render: Callable[[list], str]) -> str:
    """The prompt text of one parsed line: "prompt", or "messages" through the chat template."""
    if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
        raise ConfigError(f"rl.prompts={where}: each line must be a JSON object with one of \"prompt\" (text) or "
                          f"\"messages\" (a conversation)")
    if "prompt" in record:
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            raise ConfigError(f"rl.prompts={where}: \"prompt\" must be a non-empty string")
        return record["prompt"]
    messages = record["messages"]
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ConfigError(f"rl.prompts={where}: \"messages\" must be a list of {{\"role\": ..., \"content\": ...}}")
    try:
        return render(messages)
    except Exception as e:  # noqa: BLE001  (a chat template may raise anything)
        raise ConfigError(f"rl.prompts={where}: the chat template cannot render these messages ({e})") from None


def load(path: str, encode: Callable[[str], list[int]], render: Callable[[list], str],
         longest: int) -> list[Prompt]:
    """Every line of `path` as a Prompt; a line that is not a prompt, or whose tokens exceed `longest`, is a one-line
    error naming it. `render(messages)` is the chat template's text of a conversation with the generation prompt."""
    file = pathlib.Path(path).expanduser()
    if not path or not file.is_file():
        raise ConfigError(f"rl.prompts={path!r}: no such file; give a JSONL file of prompts")
    out = []
    with open(file, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                raise ConfigError(f"rl.prompts={where}: not a line of UTF-8 JSON; fix or remove it") from None
            text = _text(record, where, render)
            ids = tuple(encode(text))
            if not 0 < len(ids) <= longest:
                raise ConfigError(f"rl.prompts={where}: the prompt is {len(ids)} tokens; it must be 1 to {longest} "
                                  f"(model.seq_len less rl.max_new_tokens); shorten it or raise model.seq_len")
            out.append(Prompt(text, ids, _answer(record.get("answer"), where) if isinstance(record, dict) else None,
                              where))
    if not out:
        raise ConfigError(f"rl.prompts={path!r}: the file holds no prompt")
    return out


def step_prompts(count: int, per_step: int, seed: int, step: int) -> list[int]:
    """The prompt indices of `step` (0-based): epochs of seeded permutations of the `count` prompts, read `per_step`
    at a time; each epoch's permutation depends on (seed, epoch) alone."""
    first = step * per_step
    out = []
    while len(out) < per_step:
        epoch, offset = divmod(first + len(out), count)
        order = np.random.default_rng([seed, epoch]).permutation(count)
        out += [int(i) for i in order[offset:offset + per_step - len(out)]]
    return out


def sample_seed(seed: int, step: int, prompt: int, member: int) -> int:
    """The sampling seed of one completion (a group's `member` of the step's `prompt`-th prompt): a function of
    these alone, so a step's rollouts are reproducible."""
    return int(np.random.SeedSequence([seed, step, prompt, member]).generate_state(1)[0] & 0x7FFFFFFF)
