"""Serving-engine throughput (train/serve/) on one device: requests of random prompts, all added at once, run to
completion with continuous batching; tokens/s of new tokens, after the build compiles every step shape. Weights
are random: speed does not depend on their values.

    python -m experiments.bench_serve --preset=llama3-tiny --seqs=1,8,16 --requests=32 --new_tokens=32
"""
from __future__ import annotations

import json
import time

import numpy as np
from absl import app, flags

import models
from train import placed as placed_lib
from train.serve.engine import Engine, Settings
from train.serve.sampling import SamplingParams

_PRESET = flags.DEFINE_string("preset", "llama3-tiny", "Model preset (a family with paged decoding).")
_SEQS = flags.DEFINE_list("seqs", ["1", "8", "16"], "serve.max_num_seqs values to measure.")
_REQUESTS = flags.DEFINE_integer("requests", 32, "Requests per measurement.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Prompt tokens per request.")
_NEW = flags.DEFINE_integer("new_tokens", 32, "Generated tokens per request.")
_JSON = flags.DEFINE_string("json", "", "Also write the rows to this JSON file.")


def measure(placed: placed_lib.Placed, seqs: int) -> dict:
    engine = Engine.build(placed, Settings(max_num_seqs=seqs, prefix_cache=False))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, placed.model.vocab_size, _PROMPT_LEN.value).tolist() for _ in range(_REQUESTS.value)]
    t = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=_NEW.value))
    seconds = time.perf_counter() - t
    new = sum(len(o.token_ids) for o in outs)
    return {"preset": _PRESET.value, "max_num_seqs": seqs, "requests": _REQUESTS.value, "new_tokens": new,
            "seconds": round(seconds, 3), "tokens_per_s": round(new / seconds, 1),
            "device": str(placed.mesh.devices.flat[0].platform)}


def main(argv):
    del argv
    cfg = models.from_dict({"preset": _PRESET.value})
    placed = placed_lib.initialized(placed_lib.on_one_device(cfg))
    rows = [measure(placed, int(s)) for s in _SEQS.value]
    print(f"{'preset':<14}{'seqs':>6}{'requests':>10}{'seconds':>10}{'tok/s':>10}")
    for r in rows:
        print(f"{r['preset']:<14}{r['max_num_seqs']:>6}{r['requests']:>10}{r['seconds']:>10.2f}{r['tokens_per_s']:>10.1f}")
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    app.run(main)
