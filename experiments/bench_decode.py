"""Decoding speed of the serving engine (train/serve/, the project's one decoding path) on one device: tokens/s
per sequence (batch 1) and batched, `batch` prompts decoded together to the end, after a warm-up run (the engine
compiles every step shape when it is built). Weights are random: speed does not depend on their values.

    python -m experiments.bench_decode --preset=llama3-tiny --batches=1,8,32 --new_tokens=128
    python -m experiments.bench_decode --preset=llama3.2-1b --batches=1,16 (on a GPU)
"""
from __future__ import annotations

import dataclasses
import json
import time

import jax
import numpy as np
from absl import flags

import models
from train import cli
from train import placed as placed_lib
from train.serve.engine import Engine, SamplingParams, Settings

_PRESET = flags.DEFINE_string("preset", "llama3-tiny", "Model preset (a family with KV-cache decoding).")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32"], "Sequences decoded together.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Prompt tokens per sequence.")
_NEW = flags.DEFINE_integer("new_tokens", 128, "Generated tokens per sequence.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per batch size (the median is reported).")
_JSON = flags.DEFINE_string("json", "", "Also write the rows to this JSON file.")


def measure(cfg, params, batch: int) -> dict:
    placed = placed_lib.on_one_device(cfg)
    placed = dataclasses.replace(placed, params=jax.device_put(params, placed.layout.params))
    settings = Settings(max_num_seqs=batch, prefill_chunk=_PROMPT_LEN.value,
                        max_batch_tokens=max(batch, _PROMPT_LEN.value) * batch, prefix_cache=False)
    engine = Engine.build(placed, settings, max_context=_PROMPT_LEN.value + _NEW.value)
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, _PROMPT_LEN.value)).tolist()
    request = SamplingParams(max_tokens=_NEW.value)
    engine.generate(prompts, request)  # warm: every shape already compiled; this runs them once
    times = []
    for _ in range(_REPEATS.value):
        t = time.perf_counter()
        engine.generate(prompts, request)
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
