"""Pretraining data: a corpus of real Python source (`corpus`), the BPE tokenizer trained on it
(`bpe`), and packed rows with document masking (`packing`)."""
