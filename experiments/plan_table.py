"""The planner's choice and predicted TFLOP/s per GPU for GPT-style models from 1.3B to 1T parameters on 8 to
3,072 A100-80GB and H100 GPUs (`python -m experiments.plan_table`); prints a Markdown table for docs/benchmarks.md.

Arguments: the topologies to plan on (presets or JSON files), dgx-a100 and dgx-h100 by default.

Shapes: GPT-3 (Brown et al. 2020, Table 2.1) for 1.3B-175B, and the 1T shape of Narayanan et al. 2021
(128 layers, d_model 25600, 160 heads); all with 2,048-token sequences and a 50,304-token vocabulary.
Only the shapes are taken from those papers, no throughput figure."""
from __future__ import annotations

import sys
import time

import models
from mesh import topology as T
from train import cli
from train.plan import report, search

SHAPES = {  # name: (d_model, layers, heads)
    "1.3B": (2048, 24, 16), "6.7B": (4096, 32, 32), "13B": (5120, 40, 40), "175B": (12288, 96, 96),
    "1T": (25600, 128, 160),
}
RUNS = [  # (model, GPUs, global batch in sequences)
    ("1.3B", 8, 512), ("6.7B", 64, 1024), ("13B", 512, 1024), ("175B", 1024, 1536), ("1T", 3072, 3072),
]


def main(topologies=("dgx-a100", "dgx-h100")) -> None:
    print("| model | params | GPUs | global batch | topology | layout | pipeline | remat | accum | GB/GPU | "
          "step s | TFLOP/s/GPU | MFU | plan s |")
    print("|---|---:|---:|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|")
    for name, gpus, batch in RUNS:
        d, layers, heads = SHAPES[name]
        cfg = models.from_dict(dict(vocab_size=50304, seq_len=2048, d_model=d, n_layers=layers, n_heads=heads,
                                    compute_dtype="bfloat16"))
        for topo_name in topologies:
            topo = T.get_topology(topo_name, hosts=gpus // 8)
            t0 = time.perf_counter()
            ranked = search.search(cfg, batch, topo, {})
            elapsed = time.perf_counter() - t0
            best = next((p for p in ranked if p.fits), None)
            if best is None:
                size = f"{models.param_count(cfg) / 1e9:,.1f}B"
                print(f"| {name} | {size} | {gpus} | {batch} | {topo_name} | fits nowhere |")
                continue
            c = best.candidate
            pipe = f"{c.schedule} m={c.microbatches} v={c.virtual_stages}" if c.sizes["pipeline"] > 1 else "-"
            print(f"| {name} | {models.param_count(cfg) / 1e9:,.1f}B | {gpus} | {batch} | {topo_name} | "
                  f"{report.mesh_text(c.sizes)} | {pipe} | {c.remat} | {c.grad_accum_steps} | "
                  f"{best.memory['total'] / 1e9:,.1f} | {best.step_time_s:.3g} | {best.tflops_per_device:,.0f} | "
                  f"{100 * best.mfu:.0f}% | {elapsed:.1f} |", flush=True)


def parse(argv: list[str]) -> tuple[str, ...]:
    """The topologies to tabulate (default dgx-a100 and dgx-h100), each checked before the search."""
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("topologies", nargs="*", default=["dgx-a100", "dgx-h100"],
                        help="topology presets or JSON files (default: dgx-a100 dgx-h100)")
    topologies = tuple(parser.parse_args(argv).topologies)
    for name in topologies:
        try:
            T.get_topology(name)
        except T.TopologyError as e:
            cli.fail(str(e))
    return topologies


if __name__ == "__main__":
    main(parse(sys.argv[1:]))
