"""Data: corpora to token files (`prepare`, `corpus`, `tokenizer`), a run's `data.*` settings resolved to
token files (`datadir`), the stateless epoch order (`order`) and the batches a step reads (`loader`)."""
