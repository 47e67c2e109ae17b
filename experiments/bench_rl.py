"""The RL step's costs (python -m train.rl's, train/rl): the weight sync's time against the bytes it lands on the
engine and against a plain copy of those bytes timed in the same run (device to device when there are several
devices, else on the device); the rollouts' tokens/s against the same engine serving the same requests alone (every
request added at once, no trainer between steps); and the phases of a step. The policy is a fresh model (speed does
not depend on the weights) on the prompts and digit reward of experiments/rl_tiny.py.

    python -m experiments.bench_rl --preset=llama3-100m --mesh=fsdp=4,tensor=2 --rollout_tensor=4
    python -m experiments.bench_rl --preset=llama3-100m --placement=split --rollout_devices=4 --rollout_tensor=2 \
        --mesh=fsdp=2,tensor=2
    python -m experiments.bench_rl --preset=qwen3-0.6b --dtype=bfloat16 --mesh= --rollout_tensor=1 --sync_only (GPU)
"""
from __future__ import annotations

import json
import statistics
import time

import jax
from absl import flags

from experiments import rl_tiny
from mesh import use_cpu_devices
from train import cli
from train.config.experiment import base_config
from train.rl.step import requests
from train.rl.trainer import RLTrainer
from train.serve.replicas import Replicas

_PRESET = flags.DEFINE_string("preset", "llama3-100m", "Model preset (a family with paged decoding).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "The parameters' and matmuls' dtype.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 64, "model.seq_len: prompt and completion fit in it.")
_MESH = flags.DEFINE_string("mesh", "fsdp=4,tensor=2", "The trainer's mesh, AXIS=N,... ('' : one device each axis).")
_PLACEMENT = flags.DEFINE_enum("placement", "colocated", ["colocated", "split"], "rl.placement.")
_ROLLOUT_DEVICES = flags.DEFINE_integer("rollout_devices", 0, "rl.rollout_devices (split).")
_ROLLOUT_TENSOR = flags.DEFINE_integer("rollout_tensor", 4, "rl.rollout_tensor: tensor ways of each replica.")
_PROMPTS = flags.DEFINE_integer("prompts_per_step", 8, "rl.prompts_per_step.")
_GROUP = flags.DEFINE_integer("group_size", 8, "rl.group_size.")
_NEW = flags.DEFINE_integer("max_new_tokens", 32, "rl.max_new_tokens.")
_STEPS = flags.DEFINE_integer("steps", 4, "RL steps run; the first (compiles) is left out of the phases.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed syncs and copies (the median is reported).")
_SYNC_ONLY = flags.DEFINE_boolean("sync_only", False, "Time the sync and the copy alone (no rollouts, no update).")
_DEVICES = flags.DEFINE_integer("num_cpu_devices", 8, "Virtual devices when the platform is CPU.")
_JSON = flags.DEFINE_string("json", "", "Also write the results to this JSON file.")


def config():
    """experiments/rl_tiny.py's prompts and reward on --preset at --dtype, laid out by the flags."""
    c, tiny = base_config(), rl_tiny.get_config()
    c.model.update(preset=_PRESET.value, seq_len=_SEQ_LEN.value, param_dtype=_DTYPE.value, compute_dtype=_DTYPE.value)
    c.data.source = "synthetic"
    c.train.update(steps=max(_STEPS.value, 1), eval_batches=0, eval_every=0)
    c.optimizer.update(warmup_steps=0, lr=1e-4)
    c.rl.update(prompts=tiny.rl.prompts, reward=tiny.rl.reward, prompts_per_step=_PROMPTS.value,
                group_size=_GROUP.value, max_new_tokens=_NEW.value, placement=_PLACEMENT.value,
                rollout_devices=_ROLLOUT_DEVICES.value, rollout_tensor=_ROLLOUT_TENSOR.value)
    c.mesh.update({"data": 1, **{k: int(v) for k, v in (p.split("=") for p in _MESH.value.split(",") if p)}})
    rows = _PROMPTS.value * _GROUP.value
    c.serve.update(max_num_seqs=rows, max_batch_tokens=max(256, rows), max_waiting=max(256, rows))
    return c


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def plain_copy(weights: list):
    """The engine weights' bytes copied once: every shard to the next device (on one device: a copy on it)."""
    shards = [s.data for w in weights for leaf in jax.tree.leaves(w) for s in leaf.addressable_shards]
    devices = jax.local_devices()
    if len(devices) == 1:
        copy = jax.jit(lambda xs: [x.copy() for x in xs])
        copy(shards)  # compiled before it is timed
        return lambda: copy(shards)
    after = {d: devices[(i + 1) % len(devices)] for i, d in enumerate(devices)}
    return lambda: jax.device_put(shards, [after[next(iter(s.devices()))] for s in shards])


def run_steps(trainer, state):
    """Run --steps RL steps; the metrics and the wall time (the update waited for) of each."""
    out = []
    for step in range(_STEPS.value):
        t0 = time.perf_counter()
        state, metrics = trainer.train_step(state, trainer.batch(step))
        jax.block_until_ready(state)
        out.append({**{k: float(v) for k, v in jax.device_get(metrics).items()}, "step_s": time.perf_counter() - t0})
    return state, out


def serving_alone(trainer, step: int) -> float:
    """Tokens/s of the engine replicas generating a step's completions, every request added at once."""
    plan, actor = trainer.batch(step), trainer._actor
    reqs = requests(trainer, plan, trainer.replicas.local, len(trainer.replicas.devices))
    engines = Replicas(actor.engines) if len(actor.engines) > 1 else actor.engines[0]
    t0 = time.perf_counter()
    outs = engines.generate([list(r.prompt) for r in reqs], [r.params for r in reqs])
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def phases(steps: list[dict]) -> dict[str, float]:
    steady = steps[1:] or steps
    keys = ("rollout_s", "reward_s", "update_wait_s", "sync_s", "step_s", "rollout_tokens_per_s")
    out = {k: statistics.median(s[k] for s in steady) for k in keys}
    out["update_s"] = out["step_s"] - out["rollout_s"] - out["reward_s"] - out["sync_s"] - out["update_wait_s"]
    return out


def main(argv):
    del argv
    use_cpu_devices(_DEVICES.value)
    trainer = RLTrainer.build(config())
    state = trainer.init_state()
    result = {"preset": _PRESET.value, "dtype": _DTYPE.value, "placement": _PLACEMENT.value,
              "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
              "replicas": len(trainer.replicas.devices), "rollout_tensor": _ROLLOUT_TENSOR.value}
    if _SYNC_ONLY.value:
        trainer.actor(state["params"], 0)
    else:
        state, steps = run_steps(trainer, state)
        result.update(phases=phases(steps), serving_alone_tokens_per_s=serving_alone(trainer, _STEPS.value))
    actor = trainer._actor
    result["sync_s"] = median_seconds(lambda: actor.sync(state["params"], actor.engines), _REPEATS.value)
    result["sync_bytes"] = actor.sync.bytes
    result["copy_s"] = median_seconds(plain_copy([e.runner.weights for e in actor.engines]), _REPEATS.value)
    report(result)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(result, f, indent=2)


def report(r: dict) -> None:
    gb = r["sync_bytes"] / 1e9
    print(f"{r['preset']} ({r['dtype']}), {r['placement']}, {r['replicas']} engine replica(s) of tensor "
          f"{r['rollout_tensor']}, {r['devices']}")
    print(f"{'sync s':>9}{'GB':>8}{'GB/s':>8}{'copy s':>9}{'sync/copy':>10}")
    print(f"{r['sync_s']:>9.4f}{gb:>8.3f}{gb / r['sync_s']:>8.2f}{r['copy_s']:>9.4f}{r['sync_s'] / r['copy_s']:>10.2f}")
    if "phases" not in r:
        return
    p = r["phases"]
    print(f"{'rollout tok/s':>14}{'engine alone tok/s':>20}{'ratio':>7}")
    ratio = p["rollout_tokens_per_s"] / r["serving_alone_tokens_per_s"]
    print(f"{p['rollout_tokens_per_s']:>14.0f}{r['serving_alone_tokens_per_s']:>20.0f}{ratio:>7.2f}")
    names = ("rollout_s", "reward_s", "update_wait_s", "sync_s", "update_s", "step_s")
    print("step phases (s, median of the steps after the first): " + ", ".join(f"{n[:-2]} {p[n]:.3f}" for n in names))


if __name__ == "__main__":
    cli.run(main)
