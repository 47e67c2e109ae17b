"""GPT-2 small (the `gpt2-125m` preset: 12 layers, d_model 768, GPT-2's tokenizer) pre-trained on a prepared
corpus at nanoGPT's shape, 16 x 1024 tokens a step, on one GPU (or whatever the planner finds: any device count).

    python -m train.prepare --input=hf:Skylion007/openwebtext --out=data/openwebtext --tokenizer=hf:tokenizers/gpt2
    python -m train --config=experiments/gpt2_124m.py --workdir=runs/gpt2
"""
from train.config.experiment import base_config


def get_config(variant: str = ""):
    if variant:
        raise ValueError(f"experiments/gpt2_124m.py:{variant}: this experiment has no variants")
    c = base_config()
    c.model.preset = "gpt2-125m"
    c.plan.auto = True
    c.data.update(source="tokens", path="data/openwebtext")
    # nanoGPT's optimizer for this model (lr 6e-4 to 6e-5, betas 0.9/0.95, weight decay 0.1, clip 1.0)
    c.optimizer.update(lr=6e-4, min_lr_ratio=0.1, warmup_steps=700, weight_decay=0.1)
    c.train.update(steps=20000, global_batch_size=16, log_every=50, eval_every=1000, eval_batches=20)
    c.checkpoint.update(every_steps=1000, every_minutes=30.0)
    return c
