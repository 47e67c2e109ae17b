"""Hugging Face interop: a run's checkpoint exported as a transformers directory (`export`), and a run started
from Hugging Face weights (`restore`, for `checkpoint.restore_from=hf:DIR`)."""
