"""DeepSeek-V3 (671B, 37B active) on several hosts of 8 GPUs each, started by SLURM (the planner lays it out over all
of them, `python -m train.plan --config=experiments/deepseek_v3_671b.py --hosts=N` shows how):

    sbatch --nodes=N experiments/slurm/train.sbatch experiments/deepseek_v3_671b.py /shared/runs/deepseek-v3

From DeepSeek's weights with `--config.checkpoint.restore_from=hf:DIR` (converted to bfloat16 first), else from
scratch; the corpus is prepared with DeepSeek-V3's tokenizer into data/deepseek (a path every host sees)."""
from train.config.experiment import base_config


def get_config(variant: str = ""):
    if variant:
        raise ValueError(f"experiments/deepseek_v3_671b.py:{variant}: this experiment has no variants")
    c = base_config()
    c.model.preset = "deepseek-v3-671b"
    c.plan.auto = True
    # The preset is dropless (capacity_factor 0), whose buffers hold seq_len slots per expert: with fine-grained
    # experts that is n_experts / experts_per_token times the routed tokens, in the experts' matmuls and their
    # all-to-alls; 1.25 (tokens past it dropped) is the planner's choice:
    # on 64 dgx-h100 hosts 813.7 s a step dropless against 79.2 s at 1.25 (train.plan, 2026-12-05).
    c.model.capacity_factor = 1.25
    c.data.update(source="tokens", path="data/deepseek")
    # DeepSeek-V3's pre-training (section 4.2): AdamW (0.9, 0.95), weight decay 0.1, peak 2.2e-4 after 2K warmup
    # steps; gradient clipping 1.0; 4K tokens a row. Its batch grew to 15,360 rows; 1,920 here, its starting batch.
    c.optimizer.update(lr=2.2e-4, b1=0.9, b2=0.95, weight_decay=0.1, warmup_steps=2000, clip_norm=1.0)
    c.train.update(steps=100000, global_batch_size=1920, log_every=10, eval_every=1000, eval_batches=10)
    c.checkpoint.update(every_steps=250, every_minutes=30.0, mtbf_hours=24.0)
    return c
