"""One GPU's speed on the reference workloads: step time, tokens/s, MFU and peak memory of gpt2-125m (16 x 1024),
gpt3-1.3b (16 x 2048) and 7b (4 x 2048) with checkpoints off, then the loop's blocked and total seconds for
one save of the 125m and 1.3B states, and cuDNN's attention against XLA's in bf16 (outputs and gradients).

    python -m experiments.bench_gpu [--json=FILE] [--steps=10] [--save_dir=/tmp/bench_gpu]
    python -m experiments.bench_gpu --smoke    # tiny shapes on CPU: proves the script runs
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

import checkpoint
import models
from checkpoint import format as ckpt_format
from checkpoint import manager as ckpt_manager
from models import attention
from train import exit_codes
from train.config.experiment import base_config
from train.loop import runner as loop
from train.loop.saver import describe_run
from train.plan import compile_report as report
from train.runtime import hardware, xla_env
from train.trainer import Trainer

# (name, model settings, global batch, save one checkpoint of its state)
WORKLOADS = (("gpt2-125m", dict(preset="gpt2-125m", seq_len=1024), 16, True),
             ("gpt3-1.3b", dict(preset="gpt3-1.3b", seq_len=2048), 16, True),
             ("7b", dict(preset="7b", seq_len=2048), 4, False))
SMOKE = (("tiny", dict(preset="tiny", seq_len=32, n_layers=2), 8, True),)


def _config(model: dict, batch: int, steps: int):
    c = base_config()
    c.data.source = "synthetic"
    c.model.update(model)
    c.mesh.data = 1
    c.train.update(steps=steps, global_batch_size=batch, eval_every=0, eval_batches=0)
    c.optimizer.warmup_steps = 1  # the schedule's shape does not change the step's cost
    c.checkpoint.enabled = False
    return c


def _peak_bytes(compiled) -> int:
    """The allocator's high-water mark on a GPU (process-wide: a later workload's is at least an earlier
    one's, so the rows also carry the compiled step's own `compiled_peak_gib`); that estimate elsewhere."""
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("peak_bytes_in_use") or report.memory_per_device(compiled)["peak_bytes"])


def run_workload(name: str, model: dict, batch: int, steps: int) -> tuple[dict, object, object]:
    """(row, trainer, final state): `steps` timed steps after two warm-up ones, on one device."""
    trainer = Trainer.build(_config(model, batch, steps + 2), num_devices=1)
    model = trainer.plan.model  # the resolved model: its compute dtype sets the peak
    seq = model.seq_len
    t0 = time.perf_counter()
    compiled = trainer.compile()
    row = {"workload": name, "batch": batch, "seq_len": seq, "compute_dtype": model.compute_dtype,
           "attention": model.attention, "remat": model.remat, "loss_chunk_size": model.loss_chunk_size,
           "compile_s": round(time.perf_counter() - t0, 1)}
    try:
        loop.check_memory(report.memory_per_device(compiled))
    except Exception as e:  # noqa: BLE001  (a refusal is a result: the row says why)
        return row | {"refused": str(e)}, None, None
    state = trainer.init_state()
    for i in range(2):
        state, metrics = compiled(state, trainer.batch(i))
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for i in range(2, steps + 2):
        state, metrics = compiled(state, trainer.batch(i))
    jax.block_until_ready((state, metrics))
    step_s = (time.perf_counter() - t0) / steps
    tokens = batch * seq
    peak = hardware.peak_flops_per_device(model.compute_dtype)
    mfu = tokens * models.flops_per_token(model) / step_s / peak if peak else 0.0
    row |= {"step_ms": round(1e3 * step_s, 2), "tokens_per_s": round(tokens / step_s), "mfu": round(mfu, 4),
            "peak_gib_per_device": round(_peak_bytes(compiled) / 2**30, 2), "loss": float(metrics["loss"]),
            "compiled_peak_gib": round(report.memory_per_device(compiled)["peak_bytes"] / 2**30, 2)}
    return row, trainer, state


def time_save(trainer, state, directory: str, pinned_host_copy: bool | None = None) -> dict:
    """One save through the loop's own path (checksums, tree, async Orbax save): blocked and total seconds.
    `pinned_host_copy` None: the loop's choice (checkpoint/manager.py); False: Orbax's own transfer."""
    ckpts = checkpoint.Checkpoints(directory, keep=1, pinned_host_copy=pinned_host_copy)
    rng = ckpt_format.rng_of(0, trainer.mesh)
    tree, sums = ckpt_format.to_tree_with_checksums(trainer, state, rng)
    jax.block_until_ready((tree, sums))  # the step's own work is not the save's
    t0 = time.perf_counter()
    blocked = ckpts.save(1, tree, describe_run(trainer), checksums=sums)
    records = ckpts.wait()
    total = time.perf_counter() - t0
    ckpts.close()
    shutil.rmtree(directory, ignore_errors=True)
    gib = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)) / 2**30
    return {"state_gib": round(gib, 2), "save_blocked_s": round(blocked, 3), "save_total_s": round(total, 3),
            "orbax_save_s": round(records[-1].save_s, 3) if records else None}


def compare_attention(shape=(4, 1024, 12, 64), kv_heads: int = 12) -> list[dict]:
    """Each bf16 kernel this platform runs (XLA's; cuDNN's on a GPU), with and without segment ids, against
    XLA's in float32: the largest absolute difference of the output and of the gradients of q, k and v."""
    B, L, H, K = shape
    kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, shape)
    k, v = (jax.random.normal(x, (B, L, kv_heads, K)) for x in (kk, kv))
    cotangent = jax.random.normal(kc, shape)
    segments = jnp.broadcast_to((jnp.arange(L) >= L // 3) + (jnp.arange(L) >= 2 * L // 3), (B, L)).astype(jnp.int32)
    kernels = ["xla"] + (["cudnn"] if jax.devices()[0].platform == "gpu" else [])

    def out_and_grads(kernel, dtype, seg):
        f = lambda q, k, v: attention.attend(q, k, v, kernel, seg)  # noqa: E731
        out, pull = jax.vjp(f, *(x.astype(dtype) for x in (q, k, v)))
        return [x.astype(jnp.float32) for x in (out, *pull(cotangent.astype(dtype)))]

    rows = []
    for seg in (None, segments):
        reference = out_and_grads("xla", jnp.float32, seg)
        for kernel in kernels:
            got = out_and_grads(kernel, jnp.bfloat16, seg)
            diffs = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, reference)]
            rows.append({"kernel": kernel, "segments": seg is not None, "shape": list(shape),
                         **dict(zip(("out_max_abs", "dq_max_abs", "dk_max_abs", "dv_max_abs"), diffs))})
    return rows


def _print_rows(rows: list[dict]) -> None:
    print(f"{'workload':<12} {'batch':>9} {'step ms':>9} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9} "
          f"{'blocked s':>9} {'save s':>7} {'Orbax-copy blocked s':>20}")
    for r in rows:
        if "refused" in r:
            print(f"{r['workload']:<12} refused: {r['refused']}")
            continue
        print(f"{r['workload']:<12} {r['batch']:>4}x{r['seq_len']:<4} {r['step_ms']:>9.1f} {r['tokens_per_s']:>10,} "
              f"{100 * r['mfu']:>6.1f}% {r['peak_gib_per_device']:>9.2f} {r.get('save_blocked_s', '-'):>9} "
              f"{r.get('save_total_s', '-'):>7} {r.get('orbax_copy_blocked_s', '-'):>20}")


def run(smoke: bool, steps: int, save_dir: str) -> dict:
    rows = []
    for name, model, batch, save in (SMOKE if smoke else WORKLOADS):
        row, trainer, state = run_workload(name, model, batch, steps)
        if save and state is not None:
            row |= time_save(trainer, state, f"{save_dir}/{name}")
            orbax_only = time_save(trainer, state, f"{save_dir}/{name}", pinned_host_copy=False)
            row |= {"orbax_copy_blocked_s": orbax_only["save_blocked_s"],
                    "pinned_host_copy": ckpt_manager.pinned_host_copy_applies(state)}
        rows.append(row)
        del trainer, state
        gc.collect()
        jax.clear_caches()
    device = jax.devices()[0]
    return {"device_kind": device.device_kind, "platform": device.platform, "jax": jax.__version__,
            "date": datetime.date.today().isoformat(), "runtime_defaults": dict(xla_env.APPLIED), "rows": rows,
            "attention": compare_attention((2, 64, 4, 16), 2) if smoke else compare_attention()}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_gpu", description=__doc__.splitlines()[0])
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    p.add_argument("--steps", type=int, default=10, help="timed steps per workload (after 2 warm-up steps)")
    p.add_argument("--save_dir", default="", help="where the timed saves go (default: a temporary directory)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, any platform: checks that the script runs")
    args = p.parse_args(argv)
    if args.steps < 1:
        print(f"error: --steps={args.steps}: time at least one step", file=sys.stderr)
        return exit_codes.USER_ERROR
    if not args.smoke:
        xla_env.apply()  # before the backend starts, as python -m train does
    platform = jax.devices()[0].platform
    if platform != "gpu" and not args.smoke:
        print(f"error: experiments.bench_gpu needs an NVIDIA GPU (JAX's platform here is {platform}); "
              f"run it on a GPU machine, or pass --smoke for tiny shapes on any platform", file=sys.stderr)
        return exit_codes.USER_ERROR
    save_dir = args.save_dir or tempfile.mkdtemp(prefix="bench_gpu_")
    result = run(args.smoke, args.steps, save_dir)
    _print_rows(result["rows"])
    for r in result["attention"]:
        print(f"attention {r['kernel']:<5} bf16 vs XLA float32{' (segments)' if r['segments'] else ''}: out "
              f"{r['out_max_abs']:.2e}, dq {r['dq_max_abs']:.2e}, dk {r['dk_max_abs']:.2e}, dv {r['dv_max_abs']:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
