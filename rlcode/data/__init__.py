"""Pretraining data: a corpus of real Python source (`corpus`) and the BPE tokenizer trained on it
(`bpe`)."""
