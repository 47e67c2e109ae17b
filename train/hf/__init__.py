"""Hugging Face interop, every part of it: the model a config.json describes (`model`, read when a config resolves),
a run started from Hugging Face weights (`restore`, for `checkpoint.restore_from=hf:DIR`), a run's params written as
a transformers directory (`export`; the `train.export_hf` command drives it), and a directory served as a model
(`serving`, for `train.serve --hf=DIR`)."""
