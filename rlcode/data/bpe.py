"""A byte-level BPE tokenizer trained on a code corpus, in the Hugging Face ``tokenizers`` format.

`train` learns merges over the corpus's texts with the ``tokenizers`` library: byte-level
pre-tokenisation (every byte is in the initial alphabet, so any text encodes and decodes exactly),
GPT-2's split of words, numbers, punctuation and whitespace runs, and the project's special tokens
(`rlcode.tokenizer.SPECIAL_TOKENS`: padding, BOS/EOS and the chat and tool-call tokens) at ids
0..6, so the built-in chat template works unchanged. `save` writes ``tokenizer.json`` and a
``tokenizer_config.json`` naming BOS, EOS and PAD, which `rlcode.tokenizer.load_tokenizer` reads
back as an `HFTokenizer` (built-in template; user text never becomes special ids).

`bytes_per_token` measures compression on held-out text (UTF-8 bytes per token; the byte-level
tokenizer is 1.0).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from rlcode.tokenizer import BOS, EOS, PAD, SPECIAL_TOKENS, HFTokenizer, Tokenizer, load_tokenizer


def train(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> tokenizers.Tokenizer:
    """Byte-level BPE with `vocab_size` tokens in all (the special tokens and the 256 bytes
    included)."""
    floor = len(SPECIAL_TOKENS) + 256
    if vocab_size <= floor:
        raise ValueError(f"vocab_size must exceed {floor} (the special tokens and the 256 bytes), got {vocab_size}")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def save(tok: tokenizers.Tokenizer, directory: str, *, model_max_length: int | None = None) -> HFTokenizer:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into `directory`; returns the
    tokenizer as the project loads it."""
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "tokenizer_class": "PreTrainedTokenizerFast",
              "clean_up_tokenization_spaces": False}
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    loaded = load_tokenizer(directory)
    if not isinstance(loaded, HFTokenizer):
        raise TypeError(f"{directory}: loaded as {type(loaded).__name__}, expected HFTokenizer")
    return loaded


def bytes_per_token(tokenizer: Tokenizer, texts: Sequence[str]) -> float:
    """UTF-8 bytes per token over `texts` (each encoded on its own)."""
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(tokenizer.encode(t)) for t in texts)
    if n_tokens == 0:
        raise ValueError("no text to measure")
    return n_bytes / n_tokens
