"""The RL run as a Trainer (train/trainer.py), so the training loop runs it unchanged: `batch(step)` is the step's
plan (prompts drawn by (train.seed, step), a seed per completion), the step is train/rl/step.PolicyStep (rollouts,
rewards, the GRPO update, the weight sync), the state holds the reference policy beside the policy when
rl.kl_coef > 0, and nothing is compiled or allocated until the first step (the engines then) or compile()."""
from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any

import jax
import ml_collections

from mesh import make_mesh
from train import state as state_lib
from train.config.experiment import ConfigError, resolve
from train.config.sections import RLSection
from train.data import chat
from train.placed import Placed
from train.rl import engines, policy, prompts, rewards, sync, update
from train.rl.step import Actor, PolicyStep, StepPlan
from train.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class PromptSource:
    """The run's prompts as the loop's token source: what metrics.jsonl records of the data (`prompt_epoch`)."""
    count: int
    per_step: int

    def progress(self, steps_done: int, batch: int, length: int) -> dict[str, float]:
        return {"prompt_epoch": steps_done * self.per_step / self.count}


def prepared(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of `config` as the RL run trains it: rl.policy as its start, and the step's rows
    (rl.prompts_per_step x rl.group_size) as train.global_batch_size."""
    config = ml_collections.ConfigDict(config.to_dict())
    policy.apply(config)
    config.train.global_batch_size = config.rl.prompts_per_step * config.rl.group_size
    return config


def check(config: ml_collections.ConfigDict, rl: RLSection) -> None:
    """What an RL run cannot take, each a one-line error before any work."""
    if not config.rl.prompts:
        raise ConfigError("rl.prompts='': give a JSONL file of prompts (python -m train.rl trains a policy on them)")
    if config.mesh.pipeline != 1:
        raise ConfigError(f"mesh.pipeline={config.mesh.pipeline}: an RL run's objective needs per-token side inputs "
                          f"the pipeline executor does not carry; lay the trainer out with data, fsdp, expert, "
                          f"context and tensor")
    if config.model.get("lora_rank"):
        raise ConfigError("model.lora_rank > 0: an RL run trains every weight; set it to 0")
    if config.plan.auto:
        raise ConfigError("plan.auto=True: an RL run's trainer takes the layout of mesh.* (the engine's devices are "
                          "its own); set plan.auto=False")
    if config.train.eval_batches:
        raise ConfigError(f"train.eval_batches={config.train.eval_batches}: an RL run has no held-out loss to "
                          f"evaluate; set 0 (the rewards are logged every step)")
    if rl.max_staleness and rl.temperature != 1.0:
        raise ConfigError(f"rl.max_staleness={rl.max_staleness} with rl.temperature={rl.temperature}: stale rollouts "
                          f"take their old log-probabilities from the engine, which reports the model's own "
                          f"(temperature 1); set rl.temperature=1 or rl.max_staleness=0")
    if config.serve.max_waiting < config.train.global_batch_size:
        raise ConfigError(f"serve.max_waiting={config.serve.max_waiting}: the engine queues a step's "
                          f"{config.train.global_batch_size} completions; raise it")


def _checked_reward(rl: RLSection, first: prompts.Prompt) -> rewards.Reward:
    """rl.reward resolved and tried once (on the first prompt and an empty completion) before any work."""
    fn = rewards.resolve(rl.reward)
    rewards.score(fn, rl.reward, first.where, first.text, "", first.answer)
    return fn


def _check_answers(rl: RLSection, loaded: list[prompts.Prompt]) -> None:
    missing = next((p for p in loaded if p.answer is None), None)
    if rl.reward == "exact_answer" and missing is not None:
        raise ConfigError(f"rl.prompts={missing.where}: no \"answer\", which rl.reward=exact_answer compares the "
                          f"completion with; add one to every line or choose another reward")


@dataclasses.dataclass
class RLTrainer(Trainer):
    """A Trainer whose batch is a StepPlan and whose step is a PolicyStep (the fields below are the RL run's)."""
    rl: RLSection | None = None
    text: policy.Text | None = None
    prompts: list[prompts.Prompt] = dataclasses.field(default_factory=list)
    reward: rewards.Reward | None = None
    replicas: engines.Replicas | None = None
    engine_layouts: list[state_lib.ParamLayout] = dataclasses.field(default_factory=list)
    staging: jax.sharding.Mesh | None = None
    _actor: Actor | None = None

    @classmethod
    def build(cls, config: ml_collections.ConfigDict, num_devices: int | None = None) -> "RLTrainer":
        """Validate (one-line user errors: the settings, the prompts file, the reward tried once) and lay out the
        trainer and the engine's replicas; nothing is compiled or allocated yet."""
        config = prepared(config)
        rl = RLSection.from_config(config.rl)
        check(config, rl)
        devices = engines.trainer_devices(rl)
        plan = resolve(config, len(devices))
        mesh = (make_mesh(plan.mesh_sizes) if rl.placement == "colocated"
                else make_mesh(plan.mesh_sizes, devices=devices))
        placed = Placed(plan.model, state_lib.param_layout(plan.model, plan.rules, mesh), None,
                        plan.checkpoint.restore_from, plan.train.seed)
        decay = config.optimizer.decay_steps or plan.steps * rl.updates_per_rollout  # counted in optimizer updates
        tx, schedule = state_lib.make_optimizer(plan.optimizer, decay)
        layout = _with_reference(state_lib.plan_layout(plan, mesh, tx, plan.shard_opt_state, placed.layout),
                                 rl.kl_coef > 0)
        text = policy.text(config.rl.policy)
        renderer = functools.partial(chat.Renderer(text.chat_spec).render, add_generation_prompt=True)
        loaded = prompts.load(rl.prompts, text.codec.encode, renderer, plan.model.seq_len - rl.max_new_tokens)
        _check_answers(rl, loaded)
        replicas = engines.replicas(rl, mesh)
        staging = engines.staging_mesh(mesh, rl.rollout_tensor)
        layouts = [engines.engine_layout(config, rl.rollout_tensor, replicas.devices[r]) for r in replicas.local]
        fn = update.Update(plan.model, layout, tx, schedule, rl, plan.grad_accum,
                           plan.train.on_nonfinite == "skip").jitted(rl.kl_coef > 0)
        trainer = cls(config, plan, mesh, layout, tx, schedule, PromptSource(len(loaded), rl.prompts_per_step),
                      None, None, None, placed, rl=rl, text=text, prompts=loaded,
                      reward=_checked_reward(rl, loaded[0]), replicas=replicas, engine_layouts=layouts,
                      staging=staging)
        trainer.train_step = PolicyStep(trainer, fn)
        return trainer

    @property
    def batch_shardings(self) -> dict[str, jax.sharding.NamedSharding]:
        return update.batch_shardings(self.layout)

    def batch(self, step: int, split: str = "train") -> StepPlan:
        """The plan of step `step` (0-based): its prompts and a sampling seed per completion."""
        assert split == "train", "an RL run has no held-out split"
        seed, rl = self.plan.train.seed, self.rl
        chosen = prompts.step_prompts(len(self.prompts), rl.prompts_per_step, seed, step)
        seeds = tuple(tuple(prompts.sample_seed(seed, step, i, g) for g in range(rl.group_size))
                      for i in range(len(chosen)))
        return StepPlan(step, tuple(chosen), seeds)

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        return update.abstract_batch(self.layout, self.plan.global_batch, self.plan.model.seq_len)

    def compile(self) -> PolicyStep:
        """The step with its update lowered and compiled on abstract inputs (what the compile report reads)."""
        abstract = self.layout.abstract_state
        core = {k: abstract[k] for k in update.CORE}
        compiled = self.train_step.update.lower(core, abstract.get("reference"), self.abstract_batch()).compile()
        return PolicyStep(self, compiled)

    def write_tokenizer(self, workdir: pathlib.Path) -> None:
        self.text.write(workdir)

    def init_state(self) -> dict[str, Any]:
        """A fresh policy from train.seed, its optimizer state, step 0 (and its reference)."""
        core = dataclasses.replace(self.layout, state={k: self.layout.state[k] for k in update.CORE})
        return self.with_reference(state_lib.init_state(self.plan, core, self.tx, self.plan.train.seed))

    def with_reference(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state` with the reference policy (a copy of its params) when the run keeps one and it has none yet: a
        fresh start's (a restored state has its own)."""
        if "reference" not in self.layout.state or "reference" in state:
            return state
        copy = jax.jit(lambda p: jax.tree.map(lambda x: x.copy(), p), out_shardings=self.layout.state["params"])
        return {**state, "reference": copy(state["params"])}

    def actor(self, params: Any, version: int) -> Actor:
        """The engines and the weight sync, built at the first call from `params` (the policy after `version`)."""
        if self._actor is None:
            self._actor = Actor(self, params, version)
        return self._actor

    def weight_sync(self) -> sync.WeightSync:
        return sync.WeightSync(self.model, self.layout, self.staging, self.engine_layouts)

    def engine_placements(self, stacked: list[Any]) -> list[Placed]:
        return [Placed(self.model, layout, params=params, codec=self.text.codec)
                for layout, params in zip(self.engine_layouts, stacked)]


def _with_reference(layout: state_lib.Layout, keep: bool) -> state_lib.Layout:
    """The state's layout with the reference policy beside the params (laid out alike) when kept."""
    if not keep:
        return layout
    return dataclasses.replace(layout, state={**layout.state, "reference": layout.state["params"]},
                               abstract_state={**layout.abstract_state, "reference": layout.abstract_state["params"]})

