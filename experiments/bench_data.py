"""Data costs on this machine: `train.prepare` throughput (MB/s of text, tokens/s) and peak resident memory
with 1 and 2 workers, and the input pipeline's time per batch as a share of the default experiment's step.
`python -m experiments.bench_data [--mb=100 --workers=1,2 --tokenizers=bytes,train-bpe:8192 --steps=20]`."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from absl import flags

from experiments.default import get_config
from mesh import use_cpu_devices
from train import cli
from train.data.loader import stdlib_files
from train.trainer import Trainer

_MB = flags.DEFINE_float("mb", 100.0, "Text to prepare (MB): the standard library's sources, repeated.")
_WORKERS = flags.DEFINE_list("workers", ["1", "2"], "Worker counts to time train.prepare with.")
_TOKENIZERS = flags.DEFINE_list("tokenizers", ["bytes", "train-bpe:8192"], "Tokenizers to time.")
_STEPS = flags.DEFINE_integer("steps", 20, "Default-experiment steps timed for the input pipeline share.")
_SKIP_PREPARE = flags.DEFINE_boolean("skip_prepare", False, "Only the input pipeline share.")
_SKIP_SHARE = flags.DEFINE_boolean("skip_share", False, "Only train.prepare.")
flags.register_validator("mb", lambda mb: mb > 0, "must be > 0 (MB of text to prepare)")
flags.register_validator("workers", lambda values: all(v.isdigit() and int(v) > 0 for v in values),
                         "each must be a whole number > 0")
flags.register_validator("tokenizers", lambda specs: all(s == "bytes" or s.startswith(("train-bpe:", "hf:"))
                                                         for s in specs),
                         "each must be bytes, train-bpe:VOCAB or hf:PATH (train.prepare's --tokenizer)")


def make_corpus(directory: pathlib.Path, megabytes: float) -> pathlib.Path:
    """A JSONL of standard-library files (one document each, undecodable bytes replaced), repeated to size."""
    path, written = directory / "corpus.jsonl", 0
    with open(path, "w") as f:
        while written < megabytes * 1e6:
            for p in stdlib_files():
                line = json.dumps({"text": p.read_bytes().decode("utf-8", "replace")}) + "\n"
                f.write(line)
                written += len(line)
                if written >= megabytes * 1e6:
                    break
    return path


def _tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants, from /proc."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += int(next(line for line in open(f"/proc/{p}/status") if line.startswith("VmRSS")).split()[1]) << 10
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in open(f"/proc/{p}/task/{task}/children").read().split()]
        except (OSError, StopIteration):
            continue
    return total


def time_prepare(corpus: pathlib.Path, out: pathlib.Path, tokenizer: str, workers: int) -> dict:
    cmd = [sys.executable, "-m", "train.prepare", f"--input={corpus}", f"--out={out}", f"--tokenizer={tokenizer}",
           f"--num_workers={workers}", "--bpe_sample_mb=20"]
    t0, peak = time.perf_counter(), 0
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None:
        peak = max(peak, _tree_rss(proc.pid))
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    _, err = proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    meta = json.loads((out / "meta.json").read_text())
    tokens = meta["train"]["tokens"] + meta["val"]["tokens"]
    text = sum(i["size"] for i in meta["inputs"])
    return {"tokenizer": tokenizer, "workers": workers, "wall_s": wall, "tokenize_s": meta["seconds"],
            "mb_s": text / 1e6 / meta["seconds"], "tokens_s": tokens / meta["seconds"], "peak_rss_mb": peak / 1e6,
            "tokens": tokens}


def input_share(steps: int) -> None:
    """Host time to build one global batch vs the compiled step's time, default experiment, text source."""
    use_cpu_devices(8)
    trainer = Trainer.build(get_config())
    compiled = trainer.compile()
    state = trainer.init_state()
    batch_s, step_s = [], []
    for s in range(steps + 2):
        t0 = time.perf_counter()
        batch = jax.block_until_ready(trainer.batch(s))
        t1 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        if s >= 2:  # warm-up
            batch_s.append(t1 - t0)
            step_s.append(time.perf_counter() - t1)
    b, st = float(np.mean(batch_s)), float(np.mean(step_s))
    print(f"| default experiment ({trainer.plan.global_batch} x {trainer.plan.model.seq_len + 1} tokens, "
          f"data.order={trainer.tokens.order}) | {1e3 * b:.2f} | {1e3 * st:.1f} | {100 * b / st:.2f}% |")


def main(argv):
    del argv
    if not _SKIP_PREPARE.value:
        with tempfile.TemporaryDirectory() as tmp:
            root = pathlib.Path(tmp)
            corpus = make_corpus(root, _MB.value)
            print(f"train.prepare on {corpus.stat().st_size / 1e6:.1f} MB of JSONL text")
            print("| tokenizer | workers | MB/s | tokens/s | tokenize s | wall s | peak RSS MB |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            for tokenizer in _TOKENIZERS.value:
                for workers in map(int, _WORKERS.value):
                    out = root / f"out-{tokenizer.replace(':', '-')}-{workers}"
                    r = time_prepare(corpus, out, tokenizer, workers)
                    print(f"| {tokenizer} | {workers} | {r['mb_s']:.2f} | {r['tokens_s']:,.0f} | {r['tokenize_s']:.1f} "
                          f"| {r['wall_s']:.1f} | {r['peak_rss_mb']:.0f} |", flush=True)
    if not _SKIP_SHARE.value:
        print("| input pipeline | batch ms | step ms | share |")
        print("|---|---:|---:|---:|")
        input_share(_STEPS.value)


if __name__ == "__main__":
    cli.run(main)  # a bad flag or setting: one line, exit 2
