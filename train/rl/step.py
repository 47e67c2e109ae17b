"""One RL step on the host: bring the engine up to the policy (the weight sync), sample the step's groups, score
them, turn them into the update's batch, and run the jitted update (train/rl/update.py). The step's plan (which
prompts, which seeds) is `RLTrainer.batch(step)`; the state the loop passes decides which policy samples them, so
a resumed run's steps are an uninterrupted run's."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from train.rl import objective, rewards, rollout
from train.rl.prompts import Prompt
from train.serve.engine import Engine, SamplingParams


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What a step samples: its index (0-based: the state it is applied to has `step` updates), its prompts (indices
    into the run's prompts) and one seed per completion, [prompts][group_size]."""
    step: int
    prompts: tuple[int, ...]
    seeds: tuple[tuple[int, ...], ...]


@dataclasses.dataclass
class Scored:
    """The step's rollouts as host arrays over every row (after gathering the processes' rows)."""
    tokens: np.ndarray       # int32 [B, L+1], the loss-mask encoding (objective.encode_row)
    logprobs: np.ndarray     # float32 [B, L]: the engine's log-probability of each completion token, at its target
    rewards: np.ndarray      # float32 [B]
    lengths: np.ndarray      # float32 [B]: completion tokens


def requests(trainer, plan: StepPlan, local: list[int], replicas: int) -> list[rollout.Request]:
    """The completions this process samples: prompt i of the step goes to replica i % replicas."""
    rl, eos = trainer.rl, trainer.text.codec.eos_id
    stop = (eos,) if 0 <= eos < trainer.model.vocab_size else ()
    out = []
    for i, (index, seeds) in enumerate(zip(plan.prompts, plan.seeds)):
        if i % replicas not in local:
            continue
        engine = local.index(i % replicas)
        leader = i * rl.group_size
        for g, seed in enumerate(seeds):
            params = SamplingParams(temperature=rl.temperature, top_p=rl.top_p, seed=seed,
                                    max_tokens=rl.max_new_tokens, stop_token_ids=stop, logprobs=1)
            out.append(rollout.Request(leader + g, trainer.prompts[index].ids, params, engine, leader))
    return out


def score(trainer, plan: StepPlan, done: dict[int, rollout.Completion]) -> Scored:
    """This process's rows scored and encoded; other processes' rows are zeros until `gathered`."""
    rl, codec, length = trainer.rl, trainer.text.codec, trainer.model.seq_len + 1
    rows = len(plan.prompts) * rl.group_size
    out = Scored(np.zeros((rows, length), np.int32), np.zeros((rows, length - 1), np.float32),
                 np.zeros(rows, np.float32), np.zeros(rows, np.float32))
    for row, c in done.items():
        prompt: Prompt = trainer.prompts[plan.prompts[row // rl.group_size]]
        text_ids = c.tokens[:-1] if c.finish_reason == "stop" else c.tokens  # the stop token is not text
        out.rewards[row] = rewards.score(trainer.reward, rl.reward, prompt.where, prompt.text,
                                         codec.decode(text_ids), prompt.answer)
        out.tokens[row] = objective.encode_row(list(prompt.ids), c.tokens, length)
        start = len(prompt.ids) - 1  # the first completion token is the target of the prompt's last input
        out.logprobs[row, start:start + len(c.tokens)] = c.logprobs
        out.lengths[row] = len(c.tokens)
    return out


def gathered(scored: Scored) -> Scored:
    """Every process's rows (each row is filled by one process, zeros elsewhere): summed over the processes."""
    if jax.process_count() == 1:
        return scored
    parts = multihost_utils.process_allgather(dataclasses.astuple(scored))
    return Scored(*(np.asarray(p).sum(axis=0).astype(np.asarray(a).dtype)
                    for p, a in zip(parts, dataclasses.astuple(scored))))


def device_batch(trainer, scored: Scored, group_size: int) -> dict[str, jax.Array]:
    """The update's batch as global arrays in the layout's shardings (each process fills its own shards)."""
    advantages = objective.group_advantages(scored.rewards.reshape(-1, group_size)).reshape(-1)
    host = {"tokens": scored.tokens, "sampled_logprobs": scored.logprobs, "advantages": advantages}
    shardings = trainer.batch_shardings
    return {k: jax.make_array_from_callback(v.shape, shardings[k], lambda index, v=v: v[index])
            for k, v in host.items()}


class Actor:
    """The engine side of a run: the local replicas' engines and the weight sync, built at the first step from the
    policy it is given; `version` counts the updates the engines' weights have seen."""

    def __init__(self, trainer, params: Any, version: int):
        self.sync = trainer.weight_sync()
        stacked = self.sync.stacked(params)
        self.engines = [Engine.build(p, trainer.plan.serve, trainer.model.seq_len)
                        for p in trainer.engine_placements(stacked)]
        self.bring_to(params, version)  # compiles the sync now: no step after the first compiles anything

    def bring_to(self, params: Any, version: int) -> float:
        """Sync `params` (the policy after `version` updates) into the engines; the seconds spent waiting for them."""
        t0 = time.perf_counter()
        jax.block_until_ready(params)
        waited = time.perf_counter() - t0
        self.sync(params, self.engines)
        self.version = version
        return waited


class PolicyStep:
    """The step the training loop runs for an RL run: (state, StepPlan) -> (state, metrics), around the jitted (or
    compiled) update; the compile report reads the update's program through it (`memory_analysis`, `as_text`)."""

    def __init__(self, trainer, update):
        self.trainer, self.update = trainer, update

    def memory_analysis(self):
        return self.update.memory_analysis()

    def as_text(self) -> str:
        return self.update.as_text()

    def __call__(self, state: dict[str, Any], plan: StepPlan) -> tuple[dict[str, Any], dict[str, Any]]:
        t, n = self.trainer, plan.step
        state = t.with_reference(state)
        actor = t.actor(state["params"], n)
        phases = {"update_wait_s": 0.0, "sync_s": 0.0}
        if n - actor.version > t.rl.max_staleness:  # the rollouts may not lag that far: sync the newest policy
            phases["update_wait_s"] = actor.bring_to(state["params"], n)
            phases["sync_s"] = actor.sync.seconds
        version = actor.version
        done, phases["rollout_s"] = rollout.run(actor.engines, requests(t, plan, t.replicas.local,
                                                                        len(t.replicas.devices)))
        t0 = time.perf_counter()
        scored = score(t, plan, done)
        phases["reward_s"] = time.perf_counter() - t0
        if t.rl.max_staleness and actor.version < n:  # the update that ran meanwhile reaches the engine now
            phases["update_wait_s"] = actor.bring_to(state["params"], n)
            phases["sync_s"] = actor.sync.seconds
        scored = gathered(scored)
        core, metrics = self.update({k: state[k] for k in ("params", "opt_state", "step")},
                                    state.get("reference"), device_batch(t, scored, t.rl.group_size))
        new = {**core, **({"reference": state["reference"]} if "reference" in state else {})}
        generated = float(scored.lengths.sum())
        host = {"reward_mean": float(scored.rewards.mean()), "reward_std": float(scored.rewards.std()),
                "response_len": float(scored.lengths.mean()), "policy_version": float(version),
                "rollout_tokens_per_s": generated / max(phases["rollout_s"], 1e-9), **phases}
        return new, {**metrics, **host}
