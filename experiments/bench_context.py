"""Activation memory against sequence length: the compiled train step's temporaries per device (compile only,
nothing runs) for context parallelism over 1, 2, 4 and 8 devices, one row of the tiny model per length.

    python -m experiments.bench_context --seq_lens=1024,2048,4096,8192,16384 --contexts=1,2,4,8
"""
from __future__ import annotations

import importlib
import time

import jax
from absl import flags

from mesh import use_cpu_devices
from train import cli
from train.trainer import Trainer

_SEQ_LENS = flags.DEFINE_list("seq_lens", ["1024", "2048", "4096", "8192", "16384"], "Tokens per row.")
_CONTEXTS = flags.DEFINE_list("contexts", ["1", "2", "4", "8"], "mesh.context sizes (devices, nothing else split).")
_CONFIG = flags.DEFINE_string("config", "tiny", "Experiment file in experiments/.")
_BATCH = flags.DEFINE_integer("global_batch", 1, "Rows per step.")
for _name in ("seq_lens", "contexts"):
    flags.register_validator(_name, lambda values: all(v.isdigit() and int(v) > 0 for v in values),
                             "each must be a whole number > 0, e.g. 1024,2048")


def temp_bytes(seq_len: int, context: int) -> int:
    """Per-device temporaries of the compiled train step on `context` devices."""
    config = importlib.import_module(f"experiments.{_CONFIG.value}").get_config()
    config.data.source = "synthetic"
    config.mesh.update(data=1, context=context)
    config.model.seq_len, config.train.global_batch_size = seq_len, _BATCH.value
    return Trainer.build(config, num_devices=context).compile().memory_analysis().temp_size_in_bytes


def main(argv):
    del argv
    contexts = [int(c) for c in _CONTEXTS.value]
    use_cpu_devices(max(contexts))
    device = jax.devices()[0]
    print(f"# {device.platform} x {jax.device_count()}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}, "
          f"{_CONFIG.value}, global batch {_BATCH.value}: compiled temp MiB per device (ratio to context=1)")
    print("| seq_len | " + " | ".join(f"context={c}" for c in contexts) + " |")
    print("|---:|" + "---:|" * len(contexts))
    for seq_len in (int(s) for s in _SEQ_LENS.value):
        temps = [temp_bytes(seq_len, c) for c in contexts]
        cells = [f"{t / 2**20:,.0f}" + (f" ({t / temps[0]:.2f}x)" if i else "") for i, t in enumerate(temps)]
        print(f"| {seq_len} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    cli.run(main)  # a bad flag or setting: one line, exit 2
