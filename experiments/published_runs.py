"""Published large-scale runs against the planner (`python -m experiments.published_runs`): each run's published
layout pinned through plan.fixed on the topology preset that describes its hardware, and the predicted throughput
set against the published one, in the publication's own FLOP convention.

Source: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
(SC21, arXiv:2104.04473), Table 1: GPT models with sequence length 2,048 and vocabulary 51,200 on Selene, DGX A100
80GB nodes with 8 x 200 Gb/s HDR InfiniBand (the `dgx-a100` preset). Its throughput counts, per iteration,
96 B s l h^2 (1 + s / 6h + V / 16 l h) FLOPs (its Eq. 3, which assumes activation recomputation), so that is the
convention of both columns here, and every run is pinned to full remat. The pins are the published mesh (data
parallelism is what tensor x pipeline leave, without optimizer-state sharding); the planner chooses the schedule and
the microbatches, which the table does not give.
"""
from __future__ import annotations

import models
from mesh import topology as T
from train.plan import fixed as fixed_lib
from train.plan import report, search

SEQ, VOCAB = 2048, 51200
# (name, heads, d_model, layers, tensor, pipeline, GPUs, global batch, published TFLOP/s per GPU), Table 1's rows.
RUNS = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137.0),
    ("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163.0),
]


def paper_flops(batch: int, layers: int, d_model: int) -> float:
    """FLOPs of one iteration by the paper's Eq. 3."""
    return 96.0 * batch * SEQ * layers * d_model ** 2 * (1 + SEQ / (6 * d_model) + VOCAB / (16 * layers * d_model))


def predict(run: tuple) -> tuple[str, object]:
    name, heads, d, layers, t, p, gpus, batch, _ = run
    cfg = models.from_dict(dict(vocab_size=VOCAB, seq_len=SEQ, d_model=d, n_layers=layers, n_heads=heads,
                                compute_dtype="bfloat16"))
    topo = T.get_topology("dgx-a100", hosts=gpus // 8)
    # Megatron's data-parallel size is what the model-parallel sizes leave; its optimizer state was not sharded then
    pins = f"data:{gpus // (t * p)},tensor:{t},pipeline:{p},remat:full,shard_opt_state:false"
    ranked = search.search(cfg, batch, topo, fixed_lib.parse(pins, gpus))
    return pins, next((r for r in ranked if r.fits), None)


def main() -> None:
    print("| run | GPUs | global batch | plan.fixed | planner's layout | GB/GPU | step s | predicted TFLOP/s/GPU | "
          "published TFLOP/s/GPU | error |")
    print("|---|---:|---:|---|---|---:|---:|---:|---:|---:|")
    for run in RUNS:
        name, _, d, layers, _, _, gpus, batch, published = run
        pins, best = predict(run)
        if best is None:
            print(f"| {name} | {gpus} | {batch} | `{pins}` | fits nowhere |||||")
            continue
        tflops = paper_flops(batch, layers, d) / best.step_time_s / gpus / 1e12
        print(f"| {name} | {gpus} | {batch} | `{pins}` | {report.mesh_text(best.candidate.sizes)}, "
              f"{report.knobs(best).replace(' | ', ', ')} | {best.memory['total'] / 1e9:,.1f} | "
              f"{best.step_time_s:.3g} | {tflops:.0f} | {published:.0f} | {100 * (tflops / published - 1):+.0f}% |",
              flush=True)


if __name__ == "__main__":
    main()
