"""Fine-tune Meta's Llama-3.2-1B from its Hugging Face weights on a corpus prepared with its own tokenizer, on
one GPU (or whatever the planner finds); then sample from it and export it back to Hugging Face.

    python -m train.prepare --input=my_texts/ --out=data/llama3-ft --tokenizer=hf:checkpoints/Llama-3.2-1B
    python -m train --config=experiments/llama3_2_1b.py --workdir=runs/llama1b-ft
"""
from train.config.experiment import base_config


def get_config(variant: str = ""):
    if variant:
        raise ValueError(f"experiments/llama3_2_1b.py:{variant}: this experiment has no variants")
    c = base_config()
    c.model.preset = "llama3.2-1b"
    c.plan.auto = True
    c.checkpoint.update(restore_from="hf:checkpoints/Llama-3.2-1B", every_steps=200, every_minutes=30.0)
    # each conversation or document its own: attention, positions and the loss stop at every end-of-text token
    c.data.update(source="tokens", path="data/llama3-ft", document_mask=True)
    c.optimizer.update(lr=2e-5, min_lr_ratio=0.1, warmup_steps=50, weight_decay=0.0)
    c.train.update(steps=1000, global_batch_size=16, log_every=10, eval_every=200, eval_batches=10)
    return c
