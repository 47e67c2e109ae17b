"""Decoding speed with the KV cache (train/generate/decode.py) on one device: tokens/s per sequence (batch 1) and
batched, after a warm-up call that compiles the prefill and the step. Weights are random: speed does not
depend on their values.

    python -m experiments.bench_decode --preset=llama3-tiny --batches=1,8,32 --new_tokens=128
    python -m experiments.bench_decode --preset=llama3.2-1b --batches=1,16 (on a GPU)
"""
from __future__ import annotations

import json
import time

import jax
import numpy as np
from absl import flags

import models
from train import cli
from train.generate import decode as generate

_PRESET = flags.DEFINE_string("preset", "llama3-tiny", "Model preset (a family with KV-cache decoding).")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32"], "Sequences decoded together.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Prompt tokens per sequence.")
_NEW = flags.DEFINE_integer("new_tokens", 128, "Generated tokens per sequence.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per batch size (the median is reported).")
_JSON = flags.DEFINE_string("json", "", "Also write the rows to this JSON file.")


def measure(cfg, params, batch: int) -> dict:
    gen = generate.Generator(cfg, generate.Sampling(temperature=0))
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, _PROMPT_LEN.value))
    gen(params, prompt, _NEW.value)  # compile the prefill and the step
    times = []
    for _ in range(_REPEATS.value):
        t = time.perf_counter()
        jax.block_until_ready(gen(params, prompt, _NEW.value))
        times.append(time.perf_counter() - t)
    seconds = sorted(times)[len(times) // 2]
    return {"preset": _PRESET.value, "batch": batch, "prompt_len": _PROMPT_LEN.value, "new_tokens": _NEW.value,
            "seconds": round(seconds, 4), "ms_per_step": round(1e3 * seconds / _NEW.value, 3),
            "tokens_per_s_per_sequence": round(_NEW.value / seconds, 1),
            "tokens_per_s": round(batch * _NEW.value / seconds, 1), "device": str(jax.devices()[0].platform)}


def main(argv):
    del argv
    cfg = models.from_dict({"preset": _PRESET.value})
    params = jax.jit(lambda: models.init_params(cfg, 0))()
    rows = [measure(cfg, params, int(b)) for b in _BATCHES.value]
    print(f"{'preset':<14}{'batch':>6}{'ms/step':>10}{'tok/s/seq':>11}{'tok/s':>10}")
    for r in rows:
        print(f"{r['preset']:<14}{r['batch']:>6}{r['ms_per_step']:>10.2f}{r['tokens_per_s_per_sequence']:>11.1f}"
              f"{r['tokens_per_s']:>10.1f}")
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    cli.run(main)  # a bad flag or setting: one line, exit 2
