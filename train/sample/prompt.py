"""Prompts and samples as text for train.sample: encoded and decoded with the run's codec (its DATADIR's
tokenizer, or bytes), kept apart from the command's flags so they are plain functions."""
from __future__ import annotations

import json

from train.config.experiment import ConfigError


def prompt_tokens(vocab_size: int, codec, text: str | None, ids_text: str | None) -> list[int]:
    """The prompt's ids: `text` (--prompt) through the run's codec (train.tokenizer.Codec), or `ids_text`
    (--prompt_tokens)."""
    if (text is None) == (ids_text is None):
        raise ConfigError("give exactly one of --prompt=TEXT and --prompt_tokens=1,2,3 (or --eval_batches=N)")
    if text is not None:
        tokens = codec.encode(text)
    else:
        try:
            tokens = [int(t) for t in ids_text.split(",") if t.strip()]
        except ValueError:
            raise ConfigError(f"--prompt_tokens={ids_text!r}: use comma-separated integers") from None
    if not tokens or not all(0 <= t < vocab_size for t in tokens):
        setting = "--prompt" if text is not None else "--prompt_tokens"
        raise ConfigError(f"{setting}: need at least one token, each in 0..{vocab_size - 1} (the model's vocabulary)")
    return tokens


def render(codec, prompt: list[int], tokens: list[int], as_json: bool) -> str:
    """What train.sample prints: the prompt and its continuation as text, or one JSON object."""
    if as_json:
        return json.dumps({"prompt_tokens": prompt, "tokens": tokens, "text": codec.decode(tokens)})
    return codec.decode(prompt + tokens)
