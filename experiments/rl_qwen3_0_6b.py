"""GRPO on one GPU: Qwen3-0.6B from its Hugging Face weights on grade-school arithmetic word problems (GSM8K's
training split as chat prompts, the reward 1 for the right final answer), 16 prompts x 8 completions a step, the
engine and the trainer sharing the GPU.

    huggingface-cli download Qwen/Qwen3-0.6B --local-dir checkpoints/Qwen3-0.6B
    python -m experiments.rl_gsm8k_data --out=data/gsm8k.jsonl      # needs the data extra and the Hub
    python -m train.rl --config=experiments/rl_qwen3_0_6b.py --workdir=runs/rl-qwen3
"""
from train.config.experiment import base_config


def get_config(variant: str = ""):
    if variant:
        raise ValueError(f"experiments/rl_qwen3_0_6b.py:{variant}: this experiment has no variants")
    c = base_config()
    c.model.update(preset="qwen3-0.6b", seq_len=1024, compute_dtype="bfloat16")
    c.data.source = "synthetic"
    c.mesh.update(data=1)
    c.train.update(steps=300, log_every=1, eval_batches=0, eval_every=0)
    c.optimizer.update(lr=1e-6, warmup_steps=10, weight_decay=0.0, clip_norm=1.0)
    c.checkpoint.update(every_steps=50, every_minutes=30.0)
    c.rl.update(policy="hf:checkpoints/Qwen3-0.6B", prompts="data/gsm8k.jsonl", reward="exact_answer",
                prompts_per_step=16, group_size=8, max_new_tokens=768, temperature=1.0, clip_eps_high=0.28)
    # the KV pool takes a quarter of the memory left once the policy and its optimizer are placed; the update the rest
    c.serve.update(page_size=16, max_num_seqs=128, max_batch_tokens=2048, prefill_chunk=256, min_step_tokens=128,
                   kv_memory_fraction=0.25)
    return c
