"""Data: the corpus readers (`sources`, `corpus`, `chat`) and tokenizers (`tokenizer`) that train.prepare
(train/prepare/) writes token files with, a run's `data.*` settings resolved to token files (`datadir`), the
stateless epoch order (`order`) and the batches a step reads (`loader`)."""
