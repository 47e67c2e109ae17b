"""`python -m train.prepare`: a corpus tokenized into a DATADIR (`command`: the flags, the checks, the files written),
its documents encoded in worker processes (`encode`); the readers, tokenizers and the DATADIR format are
train/data/'s, which a run reads them with."""
