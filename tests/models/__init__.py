"""The model families, attention, MoE, packed documents, and Hugging Face both ways (judged by transformers)."""
