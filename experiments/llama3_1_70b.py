"""Llama-3.1-70B on several hosts of 8 GPUs each, started by SLURM (the planner lays it out over all of them):

    sbatch --nodes=4 experiments/slurm/train.sbatch experiments/llama3_1_70b.py /shared/runs/llama70b

From Meta's weights with `--config.checkpoint.restore_from=hf:DIR`, else from scratch; the corpus is prepared with
the Llama 3 tokenizer into data/llama3 (a path every host sees)."""
from train.config.experiment import base_config


def get_config(variant: str = ""):
    if variant:
        raise ValueError(f"experiments/llama3_1_70b.py:{variant}: this experiment has no variants")
    c = base_config()
    c.model.preset = "llama3.1-70b"
    c.plan.auto = True
    c.data.update(source="tokens", path="data/llama3", document_mask=True)
    # Llama 2's peak learning rate at 70B (1.5e-4, Touvron et al. 2023), cosine to 10%; 256 x 2048 tokens a step
    c.optimizer.update(lr=1.5e-4, min_lr_ratio=0.1, warmup_steps=500, weight_decay=0.1)
    c.train.update(steps=20000, global_batch_size=256, log_every=10, eval_every=500, eval_batches=10)
    c.checkpoint.update(every_steps=250, every_minutes=20.0, mtbf_hours=24.0)
    return c
