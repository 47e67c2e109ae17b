"""The run's model scoring and extending token rows on its mesh: log-likelihoods of continuations (one jitted
forward pass per padded batch) and generation through the serving engine (train/serve/)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import models
from train.eval import batching
from train.placed import Placed
from train.runtime.progress import ProgressLine
from train.serve import engine as serve
from train.serve import replicas


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

    def __init__(self, placed: Placed, batch_size: int, pad_id: int, settings: serve.Settings | None = None):
        self.placed, self.cfg, self.params = placed, placed.model, placed.params
        self.batch_size, self.pad_id = batch_size, pad_id
        # lm_eval hands over whole batches, so steps keep many sequences running: none under 8 tokens compiles.
        settings = settings or serve.Settings()
        self.settings = dataclasses.replace(settings, max_num_seqs=batch_size,
                                            min_step_tokens=max(settings.min_step_tokens, min(8, batch_size)))
        self._scores = jax.jit(functools.partial(token_scores, cfg=self.cfg, constrain=placed.layout.constrain()))

    def loglikelihood(self, rows: list[list[int]], continuation: list[int]) -> list[tuple[float, bool]]:
        """For each row of at most seq_len + 1 tokens, (the summed log-probability of its last `continuation[i]`
        tokens given the rest, whether each of them is the greedy choice)."""
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        progress = ProgressLine("eval: scoring", len(rows), "requests")
        for batch in batching.longest_first(rows, self.batch_size):
            length = batching.bucket(max(len(rows[i]) - 1 for i in batch), self.cfg.seq_len)
            tokens = batching.right_padded([rows[i] for i in batch], length + 1, self.batch_size, self.pad_id)
            logp_BxL, greedy_BxL = jax.device_get(self._scores(self.params, tokens))
            for b, i in enumerate(batch):
                end = len(rows[i]) - 1  # targets are the row's tokens 1.. : the continuation ends at column end-1
                span = slice(end - continuation[i], end)
                out[i] = (float(np.sum(logp_BxL[b, span], dtype=np.float64)), bool(np.all(greedy_BxL[b, span])))
            progress.advance(len(batch))
        progress.close()
        return out

    @functools.cached_property
    def engine(self) -> serve.Engine | replicas.Replicas:
        """Built at the first generation: a run scored by log-likelihoods alone compiles no decoding."""
        return replicas.build(self.placed, self.settings)

    def generate(self, prompts: list[list[int]], max_new: int, sampling: serve.SamplingParams,
                 stopped: Callable[[int, list[int]], bool]) -> list[list[int]]:
        """Up to `max_new` new tokens after each prompt; a prompt's request ends once `stopped(i, its new
        tokens)` holds."""
        out: list[list[int]] = [[] for _ in prompts]
        if max_new < 1:
            return out
        engine, params = self.engine, dataclasses.replace(sampling, max_tokens=max_new)
        ids = {f"eval-{id(out)}-{i}": i for i in range(len(prompts))}
        pending, ended = list(ids), set()
        progress = ProgressLine("eval: generating", len(prompts), "requests")
        while pending or engine.has_work():
            while pending and not engine.full():
                rid = pending.pop(0)
                engine.add(rid, prompts[ids[rid]], params)
            for o in engine.step():
                i = ids[o.request_id]
                out[i] = o.token_ids
                if not o.finished and stopped(i, o.token_ids):
                    engine.abort(o.request_id)
                elif not o.finished:
                    continue
                if i not in ended:
                    ended.add(i)
                    progress.advance()
        progress.close()
        return out
