"""Pretraining a small base model on Python code (rlcode.train.pretrain), sized for a 2-core CPU.

    python -m experiments.prepare_corpus         # once: the corpus and its tokenizer, .cache/corpus
    python -m experiments.pretrain --config=configs/pretrain_code.py

A 3.1M-parameter decoder (width 192, 4 layers, GQA 6/2, SwiGLU 512, tied embeddings) over the
corpus's 8,192-token BPE, trained on rows of 1,024 tokens (8 per step, one segment per file or
piece of a long file) for 1,200 steps: about 3.1 epochs of the 3.1M-token train split (3,049
rows). About 4.7 s a step on 2 cores (1,750 tokens/s), so the run takes about an hour and a half;
`--config.train.max_minutes=60` stops a sitting after an hour of steps with a checkpoint, and
`--config.resume=True` continues it (same data order, same schedule). At the end of every sitting
`experiments.pretrain` exports the latest checkpoint with its tokenizer as a Hugging Face
checkpoint (``<workdir>/base``); `--publish` copies a finished run's to checkpoints/code_base,
which configs/grpo_synth.py:base=code starts from.

The argument after ':' chooses the tokenizer: ``tokenizer=bpe`` (default) or ``tokenizer=byte``
(the same model over bytes, vocabulary 320; bits per byte are comparable across the two).
Fields to override: `--config.train.steps=400` (a smaller budget; the schedule follows),
`--config.model.init_from=<hf dir>` (continued pretraining of a checkpoint),
`--config.data.corpus_dir`, `--config.workdir`, `--config.seed`.
"""

import ml_collections

from rlcode.checks import parse_config_arg
from rlcode.models.attention import attention_config
from rlcode.models.transformer import model_config
from rlcode.sharding import mesh_config
from rlcode.train.step import optim_config

ARGS = ("tokenizer=bpe", "tokenizer=byte")

BASE_SHAPE = dict(d_model=192, num_layers=4, num_heads=6, num_kv_heads=2, head_dim=32, ffw_dim=512)
VOCAB = {"bpe": 8192, "byte": 320}  # the prepared BPE's size; the byte tokenizer's ids fit in 320
CORPUS = ".cache/corpus"


def get_config(arg=None):
    choices = parse_config_arg(arg, {"tokenizer": "bpe"})
    if choices["tokenizer"] not in VOCAB:
        raise ValueError(f"tokenizer={choices['tokenizer']!r}: expected bpe or byte")
    cfg = ml_collections.ConfigDict()
    cfg.job = "pretrain"
    cfg.seed = 0
    cfg.workdir = "runs/pretrain_code" + ("" if choices["tokenizer"] == "bpe" else "_byte")
    cfg.resume = False
    cfg.resume_override = False
    cfg.tokenizer = f"{CORPUS}/tokenizer" if choices["tokenizer"] == "bpe" else "byte"
    cfg.model = model_config(vocab_size=VOCAB[choices["tokenizer"]], **BASE_SHAPE, attention=attention_config("dense"))
    cfg.mesh = mesh_config()
    # rows_per_step rows of seq_len tokens per step; the held-out split is evaluated whole
    # (max_heldout_rows = 0), eval_batch rows at a time.
    # repeat_fraction: that share of each step's rows is one span of up to repeat_span tokens
    # repeated to fill the row (rlcode.train.pretrain.with_repeats: copying from the context,
    # which the agent needs for every file name, is learnt from these); 0 = the corpus only.
    # repeat_tokens: what is repeated: "span" (the row's first tokens), "shuffled" (the row's
    # tokens in a random order: code's own n-grams predict nothing of it) or "uniform" (ids of the
    # corpus drawn uniformly: the repeats are predicted by copying alone).
    cfg.data = ml_collections.ConfigDict({"corpus_dir": CORPUS, "seq_len": 1024, "rows_per_step": 8,
                                          "eval_batch": 8, "max_heldout_rows": 0, "repeat_fraction": 0.0,
                                          "repeat_span": 256, "repeat_tokens": "span"})
    # max_minutes: stop after this many minutes of steps (evaluation excluded); 0 = no limit.
    cfg.train = ml_collections.ConfigDict({"steps": 1200, "microbatches": 1, "max_minutes": 0.0})
    cfg.optim = optim_config(lr=2e-3, warmup_steps=100, min_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0)
    cfg.optim.total_steps = cfg.train.get_ref("steps")
    cfg.eval = ml_collections.ConfigDict({"every": 200, "at_start": True, "at_end": True})
    cfg.checkpoint = ml_collections.ConfigDict({"every": 100, "keep": 2})
    return cfg
