"""GRPO on CPU in a few minutes (the README's worked example): a fresh llama3-tiny on the byte vocabulary (264 ids:
the bytes, end-of-text, and padding that tensor 8 divides) learns to answer arithmetic prompts
(experiments/data/arithmetic.jsonl) in digits, the reward being the fraction of digits in the completion
(experiments/rl_rewards.py); 8 prompts x 8 completions a step.

Variant `split`: the engine on 4 devices of its own (2 replicas of tensor 2), the trainer on the other 4 (fsdp 2 x
tensor 2); the default shares the 8 virtual devices (fsdp 4 x tensor 2), the engine as 2 replicas of tensor 4."""
from train.config.experiment import base_config

VARIANTS = ("", "split")


def get_config(variant: str = ""):
    if variant not in VARIANTS:
        raise ValueError(f"experiments/rl_tiny.py:{variant}: unknown variant; use split or none")
    c = base_config()
    c.model.update(preset="llama3-tiny", vocab_size=264, seq_len=32, compute_dtype="float32")
    c.data.source = "synthetic"
    c.train.update(steps=40, log_every=1, eval_batches=0, eval_every=0)
    c.optimizer.update(lr=3e-3, warmup_steps=2, weight_decay=0.0)
    c.checkpoint.every_steps = 20
    c.rl.update(prompts="experiments/data/arithmetic.jsonl", reward="experiments.rl_rewards:digits", group_size=8,
                prompts_per_step=8, max_new_tokens=12, rollout_tensor=4)
    c.mesh.update(data=1, fsdp=4, tensor=2)
    c.serve.update(page_size=8, max_num_seqs=32, max_batch_tokens=64, prefill_chunk=16, min_step_tokens=32)
    if variant == "split":
        c.rl.update(placement="split", rollout_devices=4, rollout_tensor=2)
        c.mesh.update(fsdp=2, tensor=2)
    return c
