"""Generation from a trained run: KV-cache decoding through the model contract (`decode`), prompts and samples
as text (`prompt`), and the `train.sample` command (`sample`)."""
