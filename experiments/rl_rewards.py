"""Rewards for the RL examples (rl.reward=experiments.rl_rewards:NAME), each fn(prompt, completion, answer) -> float.
`digits` is a format reward a tiny model learns from scratch in a few dozen steps (the README's worked example);
`answer_or_digits` adds the built-in exact-answer check, for a policy that can add."""
from __future__ import annotations

from train.rl import rewards


def digits(prompt: str, completion: str, answer: str | None) -> float:
    """The fraction of the completion's characters that are digits (0 for an empty completion)."""
    return sum(c.isdigit() for c in completion) / len(completion) if completion else 0.0


def answer_or_digits(prompt: str, completion: str, answer: str | None) -> float:
    """1 for the right answer (its last number equals `answer`), else half the digit fraction."""
    return 1.0 if rewards.exact_answer(prompt, completion, answer) else 0.5 * digits(prompt, completion, answer)
