"""Llama-3.1-8B on one host of 8 GPUs (the planner lays it out; from Meta's weights with
`--config.checkpoint.restore_from=hf:DIR`, else from scratch), on a corpus prepared with the Llama 3 tokenizer.

    python -m train.prepare --input=... --out=data/llama3 --tokenizer=hf:checkpoints/Llama-3.1-8B
    python -m train --config=experiments/llama3_1_8b.py --workdir=runs/llama8b
"""
from train.config.experiment import base_config


def get_config(variant: str = ""):
    if variant:
        raise ValueError(f"experiments/llama3_1_8b.py:{variant}: this experiment has no variants")
    c = base_config()
    c.model.preset = "llama3.1-8b"
    c.plan.auto = True
    c.data.update(source="tokens", path="data/llama3", document_mask=True)
    # Llama 2's peak learning rate at 7B (3e-4, Touvron et al. 2023), cosine to 10%; 64 x 2048 tokens a step
    c.optimizer.update(lr=3e-4, min_lr_ratio=0.1, warmup_steps=200, weight_decay=0.1)
    c.train.update(steps=10000, global_batch_size=64, log_every=10, eval_every=500, eval_batches=10)
    c.checkpoint.update(every_steps=500, every_minutes=20.0)
    return c
