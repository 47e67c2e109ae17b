"""Text generation with a KV cache through the model contract: one jitted prefill of the prompt, then one
jitted decode step per token; greedy at temperature 0, else sampling with top-k and top-p (nucleus) filters."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import models


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0   # 0: greedy
    top_k: int = 0             # 0: off
    top_p: float = 1.0         # 1: off
    seed: int = 0


def choose(logits_BxV: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """int32 [B]: the next token of each row."""
    if s.temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits = logits_BxV / s.temperature
    if s.top_k:
        kth = jax.lax.top_k(logits, s.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if s.top_p < 1.0:
        sorted_desc = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above each one
        cutoff = jnp.min(jnp.where(before < s.top_p, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class Generator:
    """Compiled prefill and step for one model, mesh hook and sampling setting (reused across calls)."""

    def __init__(self, cfg: models.ModelConfig, sampling: Sampling, constrain: Callable = models.contract.no_constraint,
                 mesh: jax.sharding.Mesh | None = None):
        family = models.family_of(cfg)
        if family.decoding is None:
            raise models.ModelConfigError(f"model.family={cfg.family!r} has no KV-cache decoding; "
                                          f"this family implements none (models/contract.py Decoding)")
        buffers = family.parallel.expert_buffers(cfg)
        if buffers is not None:
            raise models.ModelConfigError(f"model.n_experts={buffers.experts}: KV-cache decoding of a mixture of "
                                          f"experts is not implemented; sample from a dense model")
        self.cfg, self.decoding, self.sampling, self.mesh = cfg, family.decoding, sampling, mesh

        def run(params, tokens, cache, length, key):
            logits, cache = family.decoding.decode(params, tokens, cache, length, cfg, constrain)
            return choose(logits, key, sampling), logits, cache
        self._run = jax.jit(run, donate_argnums=(2,))

    def stream(self, params, prompt_BxT: np.ndarray, max_new_tokens: int, start_B: np.ndarray | None = None):
        """Yields each new token [B] (on device) as it is chosen. `start_B`: each row's first real position,
        for prompts left-padded to one length (models/attention.attend_cached)."""
        B, T = prompt_BxT.shape
        cache = self.decoding.init_cache(self.cfg, B, T + max_new_tokens)
        if start_B is not None:
            cache["start"] = jnp.asarray(start_B, jnp.int32)
        if self.mesh is not None:  # next to the sharded params; the step's constraints then place it
            cache = jax.device_put(cache, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
        key = jax.random.key(self.sampling.seed)
        tokens = jnp.asarray(prompt_BxT, jnp.int32)
        length = jnp.zeros((), jnp.int32)
        for i in range(max_new_tokens):
            nxt, logits, cache = self._run(params, tokens, cache, length, jax.random.fold_in(key, i))
            length = length + tokens.shape[1]
            tokens = nxt[:, None]
            yield nxt, logits

    def __call__(self, params, prompt_BxT: np.ndarray, max_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(new tokens [B, N], logits of each choice [B, N, V] as numpy)."""
        out, all_logits = zip(*self.stream(params, prompt_BxT, max_new_tokens))
        return np.asarray(jnp.stack(out, 1)), np.asarray(jnp.stack(all_logits, 1))
