"""The config's sections, one frozen dataclass each and one `setting` per key (train/config/settings.py): the base
config, the generic checks, the typed sections of `Plan` (train/config/experiment.py) that the trainer, resume, the
loop, its actions and the saver read, and docs/configuration.md all come from here. The model.* keys are
train/config/model_settings.py's.

How a new setting joins: declare it here, in the section that owns it (default, help, and what it accepts; a check
across settings is a function in train/config/experiment.py), run `python -m train.config` to regenerate
docs/configuration.md, and read `trainer.plan.<section>.<field>` below __main__, never `config.<section>.<key>`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from sharding import rules as sharding_rules
from sharding import schedules
from train.config.settings import Section, names, setting
from train.data import datadir

_OFF = "must be a positive number"  # the message of settings where 0 is allowed but named as today


@dataclasses.dataclass(frozen=True)
class MeshSection(Section):
    """How many ways each mesh axis splits the devices (mesh/layout.py checks them)."""
    KEY: ClassVar[str] = "mesh"
    data: int = setting(-1, "data-parallel ways; -1: the devices the other axes leave",
                        allowed="a positive int, or -1 on one axis")
    pipeline: int = setting(1, "pipeline stages (pipeline.* says how they are scheduled)")
    fsdp: int = setting(1, "ways the parameters and the batch are split (ZeRO-3 / FSDP)")
    expert: int = setting(1, "ways the experts and the batch of a mixture are split")
    context: int = setting(1, "ways each sequence is split (ring attention over a zigzag layout)")
    tensor: int = setting(1, "ways the heads and MLP widths are split (Megatron tensor parallelism)")


@dataclasses.dataclass(frozen=True)
class ShardingSection(Section):
    """The layout's logical-axis rules (sharding/rules.py)."""
    KEY: ClassVar[str] = "sharding"
    strategy: str = setting(sharding_rules.DEFAULT_STRATEGY, "the built-in rules table the layout starts from",
                            allowed=", ".join(sorted(sharding_rules.STRATEGIES)))
    rules: dict = setting({}, "overrides of the strategy's rules: logical axis -> mesh axes, e.g. {'seq': ()}")
    shard_opt_state: bool = setting(False, "optimizer moments also split over `data` (ZeRO-1)")
    sequence_parallel: bool = setting(False, "Megatron sequence parallelism: the residual stream split over the "
                                      "sequence on `tensor` (needs mesh.tensor > 1)")


@dataclasses.dataclass(frozen=True)
class PipelineSection(Section):
    """The schedule of a run with mesh.pipeline > 1 (sharding/schedules.py checks it)."""
    KEY: ClassVar[str] = "pipeline"
    schedule: str = setting("1f1b", "the pipeline schedule", choices=schedules.NAMES,
                            error="unknown schedule; use one of " + ", ".join(schedules.NAMES))
    microbatches: int = setting(4, "microbatches per data-parallel replica and step")
    virtual_stages: int = setting(1, "model chunks per stage (interleaved, zb_v: 2)")


@dataclasses.dataclass(frozen=True)
class TrainSection(Section):
    """How the loop runs: length, batch, logging and evaluation cadence, the non-finite policy, the watchdog,
    the loggers and actions."""
    KEY: ClassVar[str] = "train"
    steps: int = setting(100, "optimizer steps of the run", above=0)
    global_batch_size: int = setting(16, "rows per optimizer step, over every device", above=0)
    seed: int = setting(0, "the seed of the initial parameters and of the data order", minimum=0, whole=True,
                        error="use a whole number >= 0")
    log_every: int = setting(10, "steps between metric lines", above=0)
    eval_every: int = setting(50, "steps between evaluations; 0: only at the end", minimum=0, error=_OFF)
    eval_batches: int = setting(4, "held-out batches per evaluation; 0: no evaluation", minimum=0, error=_OFF)
    grad_accum_steps: int = setting(1, "microsteps whose gradients one optimizer step sums", above=0)
    profile_steps: str = setting("", "FIRST:LAST: the steps a jax.profiler trace covers; '': none")
    memory_check: bool = setting(True, "compile first and stop when the step does not fit a device's memory")
    loggers: tuple[str, ...] = setting("tensorboard", "comma list of tensorboard, wandb (metrics.jsonl is always "
                                       "written)", parse=names)
    actions: tuple[str, ...] = setting("", "comma list of user actions registered with train.loop.actions.register",
                                       parse=names)
    on_nonfinite: str = setting("stop", "a non-finite loss or gradient: stop the run, or skip the update",
                                choices=("stop", "skip"), error="use 'stop' (default) or 'skip'")
    step_timeout_s: float = setting(1800.0, "the watchdog: seconds without progress before the run stops (exit "
                                    "124); 0: off", minimum=0)


@dataclasses.dataclass(frozen=True)
class OptimizerSection(Section):
    """AdamW with warmup and cosine decay after clipping (train/state.make_optimizer)."""
    KEY: ClassVar[str] = "optimizer"
    lr: float = setting(3e-3, "the peak learning rate", above=0)
    warmup_steps: int = setting(10, "steps of linear warmup from 0", minimum=0, error=_OFF)
    decay_steps: int = setting(0, "the length of the cosine schedule; 0: train.steps", minimum=0, error=_OFF)
    min_lr_ratio: float = setting(0.1, "the learning rate at the end of the decay, as a fraction of lr", minimum=0,
                                  maximum=1, error="use a fraction in [0, 1] of optimizer.lr")
    weight_decay: float = setting(0.1, "AdamW's decoupled weight decay", minimum=0)
    b1: float = setting(0.9, "Adam's first-moment decay", minimum=0, below=1, error="use a decay in [0, 1)")
    b2: float = setting(0.95, "Adam's second-moment decay", minimum=0, below=1, error="use a decay in [0, 1)")
    eps: float = setting(1e-8, "Adam's epsilon", above=0)
    clip_norm: float = setting(1.0, "the global gradient norm clipped to; 0: no clipping", minimum=0, error=_OFF)


@dataclasses.dataclass(frozen=True)
class DataSection(Section):
    """Where the tokens come from (train/data): the data.* settings and, once resolved, the token files they name."""
    KEY: ClassVar[str] = "data"
    source: str = setting("text", "text: bytes of Python's standard library; tokens: prepared token files; "
                          "synthetic: random tokens", choices=("text", "tokens", "synthetic"),
                          error="use text, tokens or synthetic")
    path: str = setting("", "text: a directory of text; tokens: a DATADIR (python -m train.prepare), a mixture "
                        "DIR_A:0.7,DIR_B:0.3, or a flat train.bin")
    token_dtype: str = setting("uint16", "the dtype of a flat train.bin (a DATADIR's meta.json says its own)",
                               choices=datadir.DTYPES, error="use uint16 or uint32")
    eval_percent: int = setting(5, "percent held out for evaluation where the data has no val split", minimum=0,
                                below=100, error="use a percentage in [0, 100) of the data held out for evaluation")
    cache_dir: str = setting("", "where the text source caches its tokens; '': ~/.cache/spmdtrain")
    order: str = setting("epochs", "epochs: each window once per epoch; random: windows drawn with replacement",
                         choices=datadir.ORDERS, error="use epochs (each window once per epoch) or random")
    document_mask: bool = setting(False, "attention, positions and loss stop at each EOS of the DATADIR "
                                  "(models/documents.py)")
    loss_mask: bool = setting(False, "the loss counts only the targets the DATADIR's loss mask keeps (train.prepare "
                              "--format=chat); must match the DATADIR")
    files: Any = None  # the token files of data.source=tokens (datadir.DataSpec), resolved from the settings above


@dataclasses.dataclass(frozen=True)
class CheckpointSection(Section):
    """When checkpoints are written and kept, where a run starts from, the local tier (checkpoint/)."""
    KEY: ClassVar[str] = "checkpoint"
    every_steps: int = setting(0, "save every N steps; 0: off", minimum=0)
    every_minutes: float = setting(10.0, "save every N minutes; 0: off", minimum=0)
    keep: int = setting(3, "the newest checkpoints kept", minimum=1, whole=True, error="keep at least 1 checkpoint")
    keep_period: int = setting(0, "also keep every N-th step; 0: off", minimum=0)
    restore_from: str = setting("", "PATH[:STEP] of a checkpoint, or hf:DIR, to start a new run from")
    local_dir: str = setting("", "the local tier's node-local directory; '': no local tier",
                             error="give a directory path, or '' for no local tier")
    restore_params_only: bool = setting(False, "take only the parameters of checkpoint.restore_from (fresh "
                                        "optimizer and step)")
    mtbf_hours: float = setting(0.0, "the job's mean time between failures: save at the Young/Daly interval, "
                                "capped by every_minutes; 0: off", minimum=0, error=_OFF)
    max_failed_saves: int = setting(3, "this many failed saves in a row stop the run (exit 74); fewer are retried",
                                    minimum=1, whole=True,
                                    error="use a whole number >= 1 (that many failed saves in a row stop the run)")
    local_every_steps: int = setting(0, "the local tier's save interval in steps; 0: off", minimum=0, whole=True,
                                     error="use a whole number of steps >= 0 (0 = off)")
    enabled: bool = setting(True, "False: never write one (benchmarks, smoke runs); a run still resumes from one")

    @property
    def local(self) -> bool:
        return bool(self.enabled and self.local_dir and self.local_every_steps)


@dataclasses.dataclass(frozen=True)
class PlanSection(Section):
    """The planner (train/plan): whether it lays the run out and what it keeps."""
    KEY: ClassVar[str] = "plan"
    auto: bool = setting(False, "take the planner's best layout for the devices at hand (a --config.mesh.* "
                         "override turns it off)")
    fixed: str = setting("", "what the planner keeps, e.g. tensor:8,pipeline:4,schedule:interleaved,remat:full")
    topology: str = setting("", "a topology preset or JSON file; '': local")


@dataclasses.dataclass(frozen=True)
class FaultSection(Section):
    """Faults on purpose, for the tests of the fault handling (0 = off): never set them in a real run."""
    KEY: ClassVar[str] = "fault_injection"
    nan_at_step: int = setting(0, "make the parameters NaN at this step", minimum=0)
    hang_at_step: int = setting(0, "hang for hang_s at this step", minimum=0)
    hang_s: float = setting(0.0, "the seconds of that hang", minimum=0)
    step_delay_s: float = setting(0.0, "sleep this long in every step", minimum=0)

    @property
    def in_loop(self) -> bool:
        """A fault the loop injects: a delay, a hang, or NaN parameters at a step (train/loop/faults.py)."""
        return bool(self.step_delay_s or self.hang_at_step or self.nan_at_step)


@dataclasses.dataclass(frozen=True)
class ServeSection(Section):
    """The serving engine (train/serve/): its paged KV cache and its batches, what train.sample decodes with."""
    KEY: ClassVar[str] = "serve"
    page_size: int = setting(16, "tokens per KV-cache page", above=0, whole=True, error="use a whole number >= 1")
    kv_pages: int = setting(0, "KV-cache pages in the pool; 0: from serve.kv_memory_fraction (on CPU: enough for "
                            "every sequence at its longest, within that fraction of the host's free memory)",
                            minimum=0, whole=True,
                            error="use a whole number of pages >= 0 (0: sized from memory)")
    kv_memory_fraction: float = setting(0.5, "the fraction of a device's free memory the pool takes when "
                                        "serve.kv_pages=0", above=0, maximum=1, error="use a fraction in (0, 1]")
    max_num_seqs: int = setting(64, "sequences decoded together", above=0, whole=True,
                                error="use a whole number >= 1")
    max_batch_tokens: int = setting(256, "tokens one step takes (decodes and prompt chunks together)", above=0,
                                    whole=True, error="use a whole number >= 1")
    prefill_chunk: int = setting(64, "the most prompt tokens of one sequence in one step", above=0, whole=True,
                                 error="use a whole number >= 1")
    min_step_tokens: int = setting(1, "the fewest tokens a step is compiled for (steps of fewer pad up to it): "
                                   "larger compiles fewer step shapes at start-up, at the cost of slower steps when "
                                   "few sequences run", above=0, whole=True, error="use a whole number >= 1")
    prefix_cache: bool = setting(True, "share the cached pages of a prompt's leading full pages")
    max_waiting: int = setting(256, "requests queued before new ones are refused", above=0, whole=True,
                               error="use a whole number >= 1")
    speculative: str = setting("off", "speculative decoding: off, ngram (prompt lookup in the sequence's own "
                               "tokens), draft (serve.draft proposes), mtp (the model's multi-token-prediction "
                               "modules)", choices=("off", "ngram", "draft", "mtp"))
    num_speculative_tokens: int = setting(7, "the most tokens proposed per sequence and step (fewer as the "
                                          "batch fills; 7: a lone sequence's step of 8 tokens)", above=0, whole=True,
                                          error="use a whole number >= 1")
    ngram_max: int = setting(4, "serve.speculative=ngram: the longest suffix of a sequence looked up in its own "
                             "tokens", above=0, whole=True, error="use a whole number >= 1")
    ngram_min: int = setting(2, "serve.speculative=ngram: the shortest such suffix (<= serve.ngram_max)", above=0,
                             whole=True, error="use a whole number >= 1")
    draft: str = setting("", "serve.speculative=draft: the draft model, a run's workdir or hf:DIR (a smaller "
                         "model with the same vocabulary)", allowed="a directory")
    max_body_bytes: int = setting(8 << 20, "the largest request body the server reads (larger: 413)", above=0,
                                  whole=True, error="use a whole number of bytes >= 1")


PLACEMENTS = ("colocated", "split")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean")


@dataclasses.dataclass(frozen=True)
class RLSection(Section):
    """GRPO (python -m train.rl): rollouts on the serving engine, rewards, the clipped objective, the weight sync."""
    KEY: ClassVar[str] = "rl"
    policy: str = setting("", "the model to start from: a training run's workdir, hf:DIR, or '' for a fresh model "
                          "from train.seed")
    prompts: str = setting("", "a JSONL file, each line {\"prompt\": TEXT} or {\"messages\": [...]} (rendered with "
                           "the model's chat template), with an optional \"answer\"")
    reward: str = setting("exact_answer", "module:function called as fn(prompt, completion, answer) -> float, or "
                          "exact_answer (the last number or the final \\boxed{} text equals the answer), or "
                          "regex:PATTERN (1 where the completion matches)")
    group_size: int = setting(8, "completions sampled per prompt (advantages are normalized within the group)",
                              minimum=2, whole=True, error="use a whole number >= 2 (a group of 1 has no "
                              "advantage: each completion is scored against the others of its prompt)")
    prompts_per_step: int = setting(8, "prompts per step; the step's rows are prompts_per_step x group_size",
                                    above=0, whole=True, error="use a whole number >= 1")
    max_new_tokens: int = setting(64, "the longest completion", above=0, whole=True, error="use a whole number >= 1")
    temperature: float = setting(1.0, "the sampling temperature; the objective's log-probabilities are of the "
                                 "logits over it", above=0, error="must be > 0 (a group sampled greedily is one "
                                 "completion G times)")
    top_p: float = setting(1.0, "nucleus sampling's mass", above=0, maximum=1, error="use a fraction in (0, 1]")
    clip_eps: float = setting(0.2, "the ratio's lower clip: 1 - clip_eps", above=0, below=1,
                              error="use a fraction in (0, 1)")
    clip_eps_high: float = setting(0.0, "the ratio's upper clip: 1 + clip_eps_high; 0: clip_eps (DAPO raises it, "
                                   "e.g. 0.28)", minimum=0)
    kl_coef: float = setting(0.0, "the weight of the KL penalty to the reference (the initial policy); 0: no "
                             "reference is kept", minimum=0)
    loss_agg: str = setting("token_mean", "token_mean: the mean over every completion token of the step; seq_mean: "
                            "each completion's token mean, averaged over completions", choices=LOSS_AGGREGATIONS)
    updates_per_rollout: int = setting(1, "optimizer updates on each step's rollouts (the GRPO paper's mu)",
                                       above=0, whole=True, error="use a whole number >= 1")
    placement: str = setting("colocated", "colocated: the engine and the trainer share every device; split: the "
                             "engine on rl.rollout_devices devices, the trainer on the rest", choices=PLACEMENTS)
    rollout_devices: int = setting(0, "with placement=split: the engine's devices (per run, over every process)",
                                   minimum=0, whole=True, error="use a whole number of devices >= 0")
    rollout_tensor: int = setting(1, "tensor-parallel ways of each engine replica; the engine's devices hold "
                                  "devices / rollout_tensor replicas", above=0, whole=True,
                                  error="use a whole number >= 1")
    max_staleness: int = setting(0, "policy versions the rollouts may lag the trainer; 0: strictly on-policy; "
                                 ">= 1: a step's rollouts run while the previous update does", minimum=0, whole=True,
                                 error="use a whole number >= 0")

    @property
    def clip_high(self) -> float:
        return self.clip_eps_high or self.clip_eps


# The sections after model.*, in the order the base config and the reference list them.
SECTIONS: tuple[type[Section], ...] = (MeshSection, ShardingSection, PipelineSection, TrainSection, OptimizerSection,
                                       DataSection, CheckpointSection, PlanSection, FaultSection,
                                       ServeSection, RLSection)
