"""GRPO (python -m train.rl) on a half-size llama3-tiny whose reward is the fraction of digits it writes: a fresh model
raises it from about 0.04 to above 0.9 in 30 steps. Two learning runs, colocated (the trainer fsdp 4 x tensor 2, the
engine two replicas of tensor 4 on the same devices; through the training loop) and split (the engine two replicas
of tensor 2 on 4 devices of its own, the trainer fsdp 2 x tensor 2 on the other 4; step by step, checking the
engine's weights after every sync and that nothing compiles after the first step). The colocated run's metrics are
what a launch of two processes of four devices logs, and, once it is SIGKILLed, the one process that resumes it
until a SIGTERM (exit 75). A reward failing mid-run, the rewards, prompts, objective and bad settings are checked
with no model or a three-step run."""
import json
import os
import signal
import subprocess

import jax
import numpy as np
import pytest

from experiments.rl_tiny import get_config
from models import paged
from tests import helpers
from tests.helpers import ROOT, start_cli, wait_for
from train import exit_codes
from train import placed as placed_lib
from train.config.experiment import ConfigError
from train.loop import runner as loop
from train.rl import objective, prompts, rewards
from train.rl.trainer import RLTrainer

STEPS = 30
# The half-size model and small steps every run here shares (as --config overrides of experiments/rl_tiny.py), so
# the subprocesses load what the in-process run compiled from the tests' compilation cache.
OVERRIDES = {"model.d_model": 64, "model.n_layers": 2, "model.seq_len": 16, "rl.prompts_per_step": 4,
             "rl.max_new_tokens": 8, "serve.page_size": 4, "serve.max_num_seqs": 16, "serve.max_batch_tokens": 64,
             "serve.min_step_tokens": 64, "serve.prefill_chunk": 8, "optimizer.lr": 0.01,
             "optimizer.decay_steps": STEPS, "train.log_every": 1, "checkpoint.every_minutes": 0.0}
METRICS = ("reward_mean", "reward_std", "clip_fraction", "response_len", "rollout_tokens_per_s", "sync_s",
           "logprob_max_diff", "policy_version", "rollout_s", "reward_s", "update_wait_s", "loss", "grad_norm")


def config(variant: str = "", **extra):
    c = get_config(variant)
    for key, value in {**OVERRIDES, **extra}.items():
        section, name = key.split(".")
        c[section][name] = value
    return c


def flags(**extra) -> list[str]:
    return ["--config=experiments/rl_tiny.py", *(f"--config.{k}={v}" for k, v in {**OVERRIDES, **extra}.items())]


def records(workdir) -> dict[int, dict]:
    """{step: the step's metrics record} of a run's metrics.jsonl (each step once)."""
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r["step"] for r in rows if "reward_mean" in r]
    assert len(steps) == len(set(steps)), f"a step is logged twice: {steps}"
    return {r["step"]: r for r in rows if "reward_mean" in r}


def assert_learned(rewards_by_step: list[float]) -> None:
    """The mean reward of the last 5 steps exceeds that of the first 5 by more than 0.5 (a digit fraction)."""
    first, last = np.mean(rewards_by_step[:5]), np.mean(rewards_by_step[-5:])
    assert first < 0.2 and last > first + 0.5, (first, last)


def assert_same_steps(ours: dict[int, dict], reference: dict[int, dict], steps) -> None:
    """The same rollouts (rewards and lengths exactly) and the same updates (to float32 rounding)."""
    for step in steps:
        for key in ("reward_mean", "reward_std", "response_len", "policy_version"):
            assert ours[step][key] == reference[step][key], (step, key)
        np.testing.assert_allclose([ours[step][k] for k in ("loss", "grad_norm")],
                                   [reference[step][k] for k in ("loss", "grad_norm")], rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    """The colocated run, 30 steps through the training loop, a checkpoint at the end."""
    workdir = tmp_path_factory.mktemp("rl") / "colocated"
    summary = loop.run(config(**{"train.steps": STEPS}), str(workdir), build=RLTrainer.build)
    return workdir, summary["state"]


def test_a_colocated_run_learns_and_the_trainer_agrees_with_the_engine(colocated):
    """The reward rises; every step logs the RL metrics, the trainer's log-probabilities of the sampled tokens
    within 1e-5 of the engine's, one policy version per step; sample, eval, serve and export read the run."""
    workdir, state = colocated
    logged = records(workdir)
    assert sorted(logged) == list(range(1, STEPS + 1))
    assert all(key in logged[1] for key in METRICS)
    assert_learned([logged[s]["reward_mean"] for s in sorted(logged)])
    assert max(r["logprob_max_diff"] for r in logged.values()) <= 1e-5
    assert [r["policy_version"] for r in logged.values()] == list(range(STEPS))
    assert all(r["clip_fraction"] == 0.0 for r in logged.values())  # one on-policy update: the ratio is 1
    restored = placed_lib.from_run(workdir, mesh={"data": 1, "tensor": 2, "fsdp": 4})  # what they place and load
    for ours, theirs in zip(jax.tree.leaves(jax.device_get(restored.params)), jax.tree.leaves(jax.device_get(
            state["params"]))):
        np.testing.assert_array_equal(ours, theirs)


def test_a_split_run_learns_with_the_engines_weights_synced_in_place_and_nothing_compiled_again():
    """Split placement, step by step: after each sync every engine weight equals the trainer's (bitwise), the
    group's followers read their prompt's full page through the prefix cache, and after the first step no program
    compiles (the engine's step, the sync, the update: no compile event at all)."""
    trainer = RLTrainer.build(config("split"))
    state, rewards_by_step, compiles = trainer.init_state(), [], []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kwargs.get("fun_name"))
    for step in range(STEPS):
        if step == 1:
            jax.monitoring.register_event_duration_secs_listener(listen)
        before = jax.device_get(state["params"])
        state, metrics = trainer.train_step(state, trainer.batch(step))
        rewards_by_step.append(float(metrics["reward_mean"]))
        assert float(metrics["logprob_max_diff"]) <= 1e-5
        expected = paged.unstack(before, trainer.model)
        for engine in trainer._actor.engines:
            for ours, theirs in zip(jax.tree.leaves(jax.device_get(engine.runner.weights)), jax.tree.leaves(expected)):
                np.testing.assert_array_equal(ours, theirs)
    jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []
    assert_learned(rewards_by_step)
    stats = [e.stats() for e in trainer._actor.engines]
    assert len(stats) == 2 and all(s["prefix_hits"] > 0 for s in stats)
    assert [len(devices) for devices in trainer.replicas.devices] == [2, 2]
    assert not set(trainer.mesh.devices.flat) & {d for ds in trainer.replicas.devices for d in ds}


def test_two_processes_log_what_one_does_and_once_sigkilled_resume_on_one_until_a_sigterm_exits_75(tmp_path,
                                                                                                    colocated):
    """train.launch --module=train.rl, two processes of four devices (each runs its replica of the engine on its own
    devices, the rollouts gathered), is SIGKILLed whole (the launcher and both processes, as when the node goes)
    once it has saved step 2 and logged step 3. One process of eight devices resumes it from step 2; SIGTERM then
    saves and exits 75. Every step logged, by either, equals the uninterrupted one-process run's."""
    workdir = tmp_path / "run"
    launch = start_cli("train.launch", "--module=train.rl", "--num_processes=2", "--num_cpu_devices=4", "--",
                       *flags(**{"checkpoint.every_steps": 2}), f"--workdir={workdir}", "--config.train.steps=30",
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for(lambda: (workdir / "checkpoints" / "2").is_dir() and helpers.last_step(workdir) >= 3, launch,
             timeout=240)
    pids = subprocess.run(["pgrep", "-f", f"workdir={workdir}"], capture_output=True, text=True).stdout.split()
    assert len(pids) == 3, pids  # the launcher and its two processes
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)
    launch.communicate(timeout=60)
    before = records(workdir)
    run = start_cli("train.rl", f"--workdir={workdir}", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for(lambda: helpers.last_step(workdir) >= 5, run, timeout=180)
    run.send_signal(signal.SIGTERM)
    out, _ = run.communicate(timeout=120)
    assert run.returncode == exit_codes.REQUEUE, out[-3000:]
    assert "from step 2 (resumed from" in out and "preempted: saved checkpoint" in out, out[-3000:]
    reference, after = records(colocated[0]), records(workdir)
    assert sorted(after) == list(range(1, max(after) + 1)) and max(after) >= 5
    assert_same_steps(before, reference, sorted(before))  # two processes, steps 1 to 3 (or more)
    assert_same_steps(after, reference, sorted(after))    # and one, from step 3 on, after the resume


def test_a_reward_that_raises_mid_run_names_the_prompt_and_leaves_the_last_checkpoint(tmp_path, monkeypatch):
    """The reward is tried once before any work; one that raises later stops the run with a line naming the
    prompt's file and line, the checkpoint of the step before intact."""
    lines = (ROOT / "experiments/data/arithmetic.jsonl").read_text().splitlines()
    early = set(prompts.step_prompts(len(lines), 4, 0, 0) + prompts.step_prompts(len(lines), 4, 0, 1))
    third = next(i for i in prompts.step_prompts(len(lines), 4, 0, 2) if i not in early)  # first drawn at step 3
    text = json.loads(lines[third])["prompt"]
    (tmp_path / "flaky_reward.py").write_text(f"def reward(prompt, completion, answer):\n"
                                             f"    if completion and prompt == {text!r}:\n"
                                             f"        raise ValueError('no')\n"
                                             f"    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    c = config(**{"rl.reward": "flaky_reward:reward", "checkpoint.every_steps": 1, "train.steps": STEPS})
    with pytest.raises(ConfigError, match=rf"rl.reward='flaky_reward:reward' raised ValueError: no on the prompt of "
                                          rf"{c.rl.prompts}:{third + 1}; fix the reward or that line"):
        loop.run(c, str(tmp_path / "run"), build=RLTrainer.build)
    steps = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and steps[-1] == max(records(tmp_path / "run"))


# ------------------------------------------------------------------------- the pieces, without a model

def test_built_in_rewards():
    assert rewards.exact_answer("", "so 3+4 is 7", "7") == 1.0
    assert rewards.exact_answer("", "7, no: \\boxed{1,000}", "1000") == 1.0
    assert rewards.exact_answer("", "\\boxed{\\frac{1}{2}} then 3", "\\frac{1}{2}") == 1.0
    assert rewards.exact_answer("", "7 then 8", "7") == 0.0 and rewards.exact_answer("", "none", "7") == 0.0
    assert rewards.resolve("regex:^[0-9]+$")("", "123", None) == 1.0
    assert rewards.resolve("regex:^[0-9]+$")("", "12a", None) == 0.0
    assert rewards.resolve("experiments.rl_rewards:digits")("", "1a", None) == 0.5


def test_prompts_are_drawn_by_seed_and_step_each_once_an_epoch():
    order = [prompts.step_prompts(10, 4, seed=3, step=s) for s in range(5)]
    assert order == [prompts.step_prompts(10, 4, seed=3, step=s) for s in range(5)]
    flat = sum(order, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert prompts.step_prompts(10, 4, seed=4, step=0) != order[0]
    assert prompts.sample_seed(0, 1, 2, 3) == prompts.sample_seed(0, 1, 2, 3) != prompts.sample_seed(0, 1, 2, 4)


def test_the_objective_against_numpy():
    """Rows in the loss-mask encoding; advantages normalized per group; the clipped terms and the k3 KL."""
    row = objective.encode_row([5, 6], [7, 8, 9], 7)
    inputs, targets, counted = (np.asarray(a) for a in objective.split_rows(row[None]))
    assert inputs.tolist() == [[5, 6, 7, 8, 9, 0]] and counted.tolist() == [[0, 1, 1, 1, 0, 0]]
    adv = objective.group_advantages(np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]))
    np.testing.assert_allclose(adv, [[1, -1, -1, 1], [0, 0, 0, 0]], atol=1e-5)
    rng = np.random.default_rng(0)
    logp, old, ref = (rng.normal(-2, 0.3, (3, 4)).astype(np.float32) for _ in range(3))
    a, w = np.array([1.0, -0.5, 2.0], np.float32), np.full((3, 4), 1 / 12, np.float32)
    clip = objective.Clip(0.2, 0.28, 0.1, False)
    loss, sums = objective.grpo_terms(logp, old, a, w, clip, ref)
    ratio = np.exp(logp - old)
    terms = np.minimum(ratio * a[:, None], np.clip(ratio, 0.8, 1.28) * a[:, None])
    kl = np.exp(ref - logp) - (ref - logp) - 1
    np.testing.assert_allclose(float(loss), np.sum((-terms + 0.1 * kl) * w), rtol=1e-5)
    np.testing.assert_allclose(float(sums["kl"]), kl.mean(), rtol=1e-5)
    clipped = np.clip(ratio, 0.8, 1.28) * a[:, None] < ratio * a[:, None]
    np.testing.assert_allclose(float(sums["clip_fraction"]), clipped.mean(), rtol=1e-5)


@pytest.mark.parametrize("change, message", [
    ({"rl.group_size": 1}, r"rl.group_size=1: use a whole number >= 2 \(a group of 1 has no advantage.*"),
    ({"rl.reward": "no_such_module:f"}, r"rl.reward='no_such_module:f': does not import \(ModuleNotFoundError.*"),
    ({"rl.reward": "experiments.rl_rewards:nothing"}, r"rl.reward='experiments.rl_rewards:nothing': does not "
                                                      r"import \(AttributeError.*"),
    ({"rl.reward": "bad_rewards:text"}, r"rl.reward='bad_rewards:text' returned '1' on the prompt of "
                                        r"experiments/data/arithmetic.jsonl:1; it must return a finite number"),
    ({"rl.reward": "bad_rewards:nan"}, r"rl.reward='bad_rewards:nan' returned nan on the prompt of .*"),
    ({"rl.reward": "bad_rewards:raises"}, r"rl.reward='bad_rewards:raises' raised ZeroDivisionError: division by "
                                          r"zero on the prompt of experiments/data/arithmetic.jsonl:1; fix the .*"),
    ({"rl.reward": "exact_answer", "rl.prompts": "PROMPTS"}, r"rl.prompts=.*:2: no \"answer\", which .*"),
    ({"rl.prompts": "BAD"}, r"rl.prompts=.*:2: each line must be a JSON object with one of \"prompt\" .*"),
    ({"mesh.pipeline": 2, "mesh.fsdp": 2}, r"mesh.pipeline=2: an RL run's objective needs per-token side inputs .*"),
    ({"rl.placement": "split", "rl.rollout_devices": 8}, r"rl.rollout_devices=8: placement=split needs .*"),
])
def test_bad_settings_are_one_line_before_any_work(tmp_path, monkeypatch, change, message):
    (tmp_path / "bad_rewards.py").write_text("def text(p, c, a):\n    return '1'\n\n\ndef nan(p, c, a):\n"
                                             "    return float('nan')\n\n\ndef raises(p, c, a):\n    return 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2="}\n')
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1="}\n{"text": "2+2="}\n')
    files = {"PROMPTS": str(tmp_path / "p.jsonl"), "BAD": str(tmp_path / "bad.jsonl")}
    c = config(**{k: files.get(v, v) for k, v in change.items()})
    with pytest.raises(ConfigError, match=message):
        RLTrainer.build(c)
