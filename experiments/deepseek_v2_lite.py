"""DeepSeek-V2-Lite (16B, 2.4B active) on one host of 8 GPUs: the planner lays it out
(`python -m train.plan --config=experiments/deepseek_v2_lite.py --hosts=1`). From scratch on data/deepseek (a
corpus prepared with DeepSeek's tokenizer); its published weights are DeepseekV2ForCausalLM's (softmax routing),
which this project does not import."""
from train.config.experiment import base_config


def get_config(variant: str = ""):
    if variant:
        raise ValueError(f"experiments/deepseek_v2_lite.py:{variant}: this experiment has no variants")
    c = base_config()
    c.model.preset = "deepseek-v2-lite"
    c.plan.auto = True
    # The preset is dropless (capacity_factor 0), whose buffers hold seq_len slots per expert: with fine-grained
    # experts that is n_experts / experts_per_token times the routed tokens, in the experts' matmuls and their
    # all-to-alls; 1.25 (tokens past it dropped) is the planner's choice:
    # on one dgx-h100 host 9.84 s a step dropless against 2.04 s at 1.25 (train.plan, 2026-12-05).
    c.model.capacity_factor = 1.25
    c.data.update(source="tokens", path="data/deepseek")
    # DeepSeek-V2's pre-training (section 3.2.1): AdamW (0.9, 0.95), weight decay 0.1, peak 4.2e-4 after 2K warmup
    # steps, clipping 1.0; 4K tokens a row.
    c.optimizer.update(lr=4.2e-4, b1=0.9, b2=0.95, weight_decay=0.1, warmup_steps=2000, clip_norm=1.0)
    c.train.update(steps=50000, global_batch_size=64, log_every=10, eval_every=1000, eval_batches=10)
    c.checkpoint.update(every_steps=500, every_minutes=30.0)
    return c
