"""A step's rollouts on the engine replicas this process runs: G completions of each of its prompts, the group's
leader first so that its followers, admitted once the leader's prompt is computed, read the prompt's full pages
through the prefix cache instead of computing them again; continuous batching runs them all together. Every
completion has its own seed, so the rollouts are reproducible whatever runs beside them."""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from train.serve.engine import Engine, SamplingParams


@dataclasses.dataclass(frozen=True)
class Request:
    row: int             # the completion's row in the step's batch (prompt-major: prompt p's group is p*G..p*G+G-1)
    prompt: tuple[int, ...]
    params: SamplingParams
    engine: int          # the index of the local engine that runs it
    leader: int          # the row of its group's leader (itself for the leader)


@dataclasses.dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]  # the engine's log-probability of each token (the model's own, at temperature 1)
    finish_reason: str


def _add(engines: list[Engine], request: Request) -> None:
    engines[request.engine].add(f"rl-{request.row}", list(request.prompt), request.params)


def run(engines: list[Engine], requests: list[Request]) -> tuple[dict[int, Completion], float]:
    """Every request to completion on its engine: ({row: Completion}, seconds)."""
    t0 = time.perf_counter()
    followers: dict[int, list[Request]] = {}
    for r in requests:
        if r.leader == r.row:
            _add(engines, r)
        else:
            followers.setdefault(r.leader, []).append(r)
    done: dict[int, Completion] = {}
    while len(done) < len(requests):
        launched = [e.launch() for e in engines]  # every replica's step is dispatched before any is waited for
        for engine, step in zip(engines, launched):
            for out in engine.collect(step):
                row = int(out.request_id.split("-")[1])
                for follower in followers.pop(row, []):  # the leader's prompt is in its pages now
                    _add(engines, follower)
                if out.finished:
                    lp = [row_lp[token] for row_lp, token in zip(out.logprobs, out.token_ids)]
                    done[row] = Completion(list(out.token_ids), lp, out.finish_reason)
    return done, time.perf_counter() - t0


def generated_tokens(done: dict[int, Completion]) -> int:
    return sum(len(c.tokens) for c in done.values())


def lengths(done: dict[int, Completion]) -> np.ndarray:
    return np.array([len(done[r].tokens) for r in sorted(done)], np.float64)
