"""LoRA fine-tuning on the training side: the frozen base a run reads again from its source on every start, since
its checkpoints hold the adapters only (the adapters themselves are models/lora.py)."""
