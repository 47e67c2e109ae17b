"""`python -m train.prepare`: a corpus tokenized into a DATADIR (`command`); the readers, tokenizers and the
DATADIR format it writes are train/data/'s, which a run reads them with."""
