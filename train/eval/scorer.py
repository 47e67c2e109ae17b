"""The run's model scoring and extending token rows on its mesh: log-likelihoods of continuations (one jitted
forward pass per padded batch) and generation through train/generate's KV cache, prompts left-padded."""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import models
from train.eval import batching
from train.generate import decode

CHECK_EVERY = 8  # generated tokens between looks at whether every row has stopped (each look waits for the device)


def token_scores(params, tokens_BxL1: jax.Array, cfg: models.ModelConfig,
                 constrain: models.contract.Hooks) -> tuple[jax.Array, jax.Array]:
    """(log-probability of each next token [B, L], whether it is the most likely one [B, L]) in float32."""
    inputs_BxL, targets_BxL = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]
    logits_BxLxV = models.forward(params, inputs_BxL, cfg, constrain).astype(jnp.float32)
    logp_BxLxV = jax.nn.log_softmax(logits_BxLxV, axis=-1)
    picked_BxL = jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    return picked_BxL, jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL


class Scorer:
    """Compiled once per padded shape and reused for every request of every task."""

    def __init__(self, cfg: models.ModelConfig, params: models.contract.Params, constrain: models.contract.Hooks,
                 mesh: jax.sharding.Mesh | None, batch_size: int, pad_id: int):
        self.cfg, self.params, self.constrain, self.mesh = cfg, params, constrain, mesh
        self.batch_size, self.pad_id = batch_size, pad_id
        self._scores = jax.jit(functools.partial(token_scores, cfg=cfg, constrain=constrain))
        self._generators: dict[decode.Sampling, decode.Generator] = {}

    def loglikelihood(self, rows: list[list[int]], continuation: list[int]) -> list[tuple[float, bool]]:
        """For each row of at most seq_len + 1 tokens, (the summed log-probability of its last `continuation[i]`
        tokens given the rest, whether each of them is the greedy choice)."""
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for batch in batching.longest_first(rows, self.batch_size):
            length = batching.bucket(max(len(rows[i]) - 1 for i in batch), self.cfg.seq_len)
            tokens = batching.right_padded([rows[i] for i in batch], length + 1, self.batch_size, self.pad_id)
            logp_BxL, greedy_BxL = jax.device_get(self._scores(self.params, tokens))
            for b, i in enumerate(batch):
                end = len(rows[i]) - 1  # targets are the row's tokens 1.. : the continuation ends at column end-1
                span = slice(end - continuation[i], end)
                out[i] = (float(np.sum(logp_BxL[b, span], dtype=np.float64)), bool(np.all(greedy_BxL[b, span])))
        return out

    def generator(self, sampling: decode.Sampling) -> decode.Generator:
        if sampling not in self._generators:
            self._generators[sampling] = decode.Generator(self.cfg, sampling, self.constrain, self.mesh)
        return self._generators[sampling]

    def generate(self, prompts: list[list[int]], max_new: int, sampling: decode.Sampling,
                 stopped: Callable[[int, list[int]], bool]) -> list[list[int]]:
        """Up to `max_new` new tokens after each prompt; a batch ends early once `stopped(i, new tokens of
        prompt i)` holds for all its rows."""
        out: list[list[int]] = [[] for _ in prompts]
        if max_new < 1:
            return out
        gen = self.generator(sampling)
        for batch in batching.longest_first(prompts, self.batch_size):
            length = batching.bucket(max(len(prompts[i]) for i in batch))
            tokens_BxT, start_B = batching.left_padded([prompts[i] for i in batch], length, self.batch_size,
                                                       self.pad_id)
            chosen = []
            for n, (next_B, _) in enumerate(gen.stream(self.params, tokens_BxT, batching.bucket(max_new), start_B)):
                chosen.append(next_B)
                if n + 1 == max_new or (n + 1) % CHECK_EVERY == 0:
                    new_BxN = np.asarray(jax.device_get(jnp.stack(chosen, 1)))
                    if n + 1 == max_new or all(stopped(i, new_BxN[b].tolist()) for b, i in enumerate(batch)):
                        break
            for b, i in enumerate(batch):
                out[i] = new_BxN[b].tolist()
        return out
