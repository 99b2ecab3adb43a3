"""Pretraining on code: next-token prediction on a corpus of Python files, on the RL engine.

`run(config)` is the job behind ``python -m experiments.pretrain`` (configs/pretrain_code.py
documents the sections). The corpus is one written by ``experiments.prepare_corpus``
(`rlcode.data.corpus`): its train split is tokenized with the job's tokenizer, each file between
BOS and EOS (the RL jobs' prompts start with BOS, their completions end with EOS), and packed into
rows of ``data.seq_len`` tokens (`rlcode.data.packing.pack`, best fit): one segment per file or
piece of a long file, positions restarting in each, the attention mask keeping every token inside
its segment, so packing changes no prediction. The held-out split is packed the same way and
evaluated whole.

The loss is the mean negative log-likelihood of the packed targets,

    L = -sum_{r,t} m_rt log p(x_r,t+1 | x_r,<=t) / sum_{r,t} m_rt,

which is the ``reinforce`` policy loss with advantage 1 and ``token-mean`` aggregation (the SFT
objective, `rlcode.train.sft.SFT_OBJECTIVE`), so pretraining runs through the same jitted,
sharded train step as RL and SFT. Everything else (run directory, TensorBoard, checkpoints,
resume, signals, ``train.max_minutes``, the progress bar, the non-finite check) is the
engine's (`rlcode.train.engine`). ``model.init_from`` continues the pretraining of a Hugging
Face checkpoint instead of starting from a fresh model.

Data order: step c trains on rows c*B .. (c+1)*B - 1 of an endless sequence of epochs, epoch e
being a permutation of all rows drawn from (seed, e) (`batch_rows`), so a resumed run sees
exactly the rows an uninterrupted one would.

Reported (TensorBoard under ``<workdir>/tb``): ``train/bpb`` (the step's loss in bits per
UTF-8 byte of its targets), ``heldout/bpb`` and ``heldout/nll`` (nats per token) at every
evaluation, ``data/epoch`` and ``data/tokens`` (targets trained on so far) and the engine's
``throughput/train_tokens_per_s``. Bits per byte: sum of the NLLs (EOS included) / ln 2 / the
targets' bytes (`rlcode.data.packing.token_bytes`); after BOS every byte of a file is a target, so
this is the code's bits per byte, a measure that does not depend on the tokenizer
(docs/reference.md §6).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlcode.checks import ConfigError, check_fields, config_errors, flag, integer, real, text
from rlcode.data import corpus, packing
from rlcode.train import memory
from rlcode.train.engine import Context, Job, Plan, RunResult, train
from rlcode.train.schema import common_schema, mesh_sizes
from rlcode.train.sft import SFT_OBJECTIVE
from rlcode.train.step import make_logprob_fn

# What a repeated row repeats (`repeated_rows`).
REPEAT_TOKENS = ("span", "shuffled", "uniform")

# The fields of `schema.common_schema` a pretraining config has (it has no RL sections).
COMMON_FIELDS = ("seed", "workdir", "resume", "resume_override", "tokenizer", "model", "mesh", "optim", "checkpoint")
PRETRAIN_SECTIONS = {
    "job": text(("pretrain",)),
    "data": {"corpus_dir": text(), "seq_len": integer(2), "rows_per_step": integer(1), "eval_batch": integer(1),
             "max_heldout_rows": integer(0), "repeat_fraction": real(0, 1, required=False),
             "repeat_span": integer(2, required=False),
             "repeat_tokens": text(REPEAT_TOKENS, required=False)},
    "train": {"steps": integer(1), "microbatches": integer(1), "max_minutes": real(0, required=False)},
    "eval": {"every": integer(0), "at_start": flag(), "at_end": flag()},
}


def pretrain_schema(cfg: Any) -> dict[str, Any]:
    """The pretraining job's schema: the shared sections it uses and its own."""
    common = common_schema(cfg)
    return {**{k: common[k] for k in COMMON_FIELDS}, **PRETRAIN_SECTIONS}


def validate_config(cfg: Any, num_devices: int | None = None,
                    budget: Sequence[tuple[str, int]] | None = None) -> None:
    """Raise ConfigError naming the field for a config the job cannot run (before anything is
    built): every field known and valid, the tokenizer within the vocabulary, the batch divisible
    by the micro-batches and the mesh's data x fsdp devices, the memory estimate within `budget`."""
    from rlcode.models.transformer import ModelConfig  # noqa: PLC0415
    from rlcode.tokenizer import job_tokenizer  # noqa: PLC0415

    if not hasattr(cfg, "keys"):
        raise ConfigError(f"the config must be a ConfigDict, got {type(cfg).__name__}")
    check_fields(cfg, pretrain_schema(cfg))
    if not cfg.workdir:
        raise ConfigError("workdir='': must name a directory")
    with config_errors("model"):
        ModelConfig.from_config(cfg.model)
    with config_errors("tokenizer"):
        vocab = job_tokenizer(cfg.get("tokenizer", "byte"), cfg.model.get("init_from", "")).vocab_size
    if cfg.model.vocab_size < vocab:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size}: must be >= the tokenizer's {vocab}")
    if cfg.model.value_head:
        raise ConfigError("model.value_head=True: pretraining trains no value head")
    rows, micro = cfg.data.rows_per_step, cfg.train.microbatches
    if rows % micro:
        raise ConfigError(f"data.rows_per_step={rows} is not divisible by train.microbatches={micro}")
    if num_devices is not None:
        sizes = mesh_sizes(cfg.mesh, num_devices)
        shards = sizes["data"] * sizes["fsdp"]
        for name, n in (("data.rows_per_step / train.microbatches", rows // micro), ("data.eval_batch",
                                                                                     cfg.data.eval_batch)):
            if n % shards:
                raise ConfigError(f"{name} = {n} rows is not divisible by the mesh's data x fsdp = {shards} devices")
    memory.check(memory.estimate_pretrain(cfg), memory.limits(jax.devices()) if budget is None else budget)


# ------------------------------------------------------------------------------ data


@dataclasses.dataclass(frozen=True)
class PackedCorpus:
    """A split packed into rows (`packing.Packed`), with its target tokens and bytes per row
    (computed once: the job reads them every step)."""

    packed: packing.Packed
    documents: int

    @property
    def rows(self) -> int:
        return int(self.packed.inputs.shape[0])

    @functools.cached_property
    def row_tokens(self) -> np.ndarray:
        return self.packed.mask.sum(axis=1).astype(np.int64)

    @functools.cached_property
    def row_bytes(self) -> np.ndarray:
        return (self.packed.target_bytes * self.packed.mask).sum(axis=1).astype(np.int64)


def pack_texts(texts: Sequence[str], tokenizer: Any, seq_len: int) -> PackedCorpus:
    """Each text tokenized between BOS (when the tokenizer has one) and EOS, packed into rows of
    `seq_len`, best fit (module docstring)."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    docs = [bos + list(tokenizer.encode(t)) + [tokenizer.eos_id] for t in texts]
    packed = packing.pack(docs, seq_len, packing.token_bytes(tokenizer), pad_id=tokenizer.pad_id, fit="best")
    return PackedCorpus(packed, len(docs))


def batch_rows(count: int, rows_per_step: int, num_rows: int, seed: int) -> np.ndarray:
    """The row ids of step `count`: positions count*B .. (count+1)*B - 1 of the concatenation of
    epoch permutations, epoch e's drawn from (seed, e)."""
    start = count * rows_per_step
    out = []
    while len(out) < rows_per_step:
        epoch, offset = divmod(start + len(out), num_rows)
        perm = np.random.default_rng([seed, epoch]).permutation(num_rows)
        out.extend(perm[offset: offset + rows_per_step - len(out)].tolist())
    return np.asarray(out, np.int64)


def tokens_before(count: int, rows_per_step: int, data: PackedCorpus, seed: int) -> int:
    """Target tokens in steps 0 .. count - 1 (whole epochs, then the part of the current one)."""
    seen = count * rows_per_step
    epochs, rest = divmod(seen, data.rows)
    tokens = data.row_tokens
    partial = np.random.default_rng([seed, epochs]).permutation(data.rows)[:rest]
    return int(epochs * tokens.sum() + tokens[partial].sum())


@dataclasses.dataclass
class RowBatch:
    """One step's rows (what the engine calls a rollout)."""

    rows: np.ndarray
    version: int
    count: int


def train_batch(packed: packing.Packed, rows: np.ndarray) -> dict[str, jax.Array]:
    """The train step's batch of `rows`: the NLL as a reinforce loss with advantage 1 (old
    log-probs are unused by it), each file a segment of its own."""
    take = lambda a: jnp.asarray(a[rows])
    B, T = len(rows), packed.inputs.shape[1]
    return {"inputs": take(packed.inputs), "targets": take(packed.targets), "positions": take(packed.positions),
            "mask": take(packed.mask).astype(bool), "segment_ids": take(packed.segment_ids),
            "kv_lengths": jnp.full((B,), T, jnp.int32), "advantages": jnp.ones((B,), jnp.float32),
            "old_logp": jnp.zeros((B, T), jnp.float32)}


def repeated_rows(packed: packing.Packed, rows: np.ndarray, spans: np.ndarray, tokens: str = "span",
                  rng: np.random.Generator | None = None, vocab: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Rows made of one span repeated: a span of spans[r] tokens, then the same again until the
    row is full, one document (positions 0..T-1). A model that copies from its context predicts
    every repeat after the first exactly; next-token statistics alone do not. The span
    (`tokens`, one of REPEAT_TOKENS) is row r's first spans[r] tokens ("span"), a random sample
    of row r's tokens ("shuffled": the row in a random order, so code's n-grams predict nothing
    of it), or ids drawn uniformly from `vocab` ("uniform": distinct tokens are the rule, so
    every repeated token has one place to copy from); the last two draw from `rng`. Returns the
    `packing.Packed` fields of those rows (numpy) plus ``repeat`` [B, T]: the targets that lie in
    a repeat (not in the first copy)."""
    T = packed.inputs.shape[1]
    if tokens not in REPEAT_TOKENS:
        raise ValueError(f"tokens={tokens!r}: expected one of {REPEAT_TOKENS}")
    if tokens != "span" and rng is None or tokens == "uniform" and vocab is None:
        raise ValueError(f"tokens={tokens!r} needs rng" + (" and vocab" if tokens == "uniform" else ""))
    if tokens == "uniform":
        source = rng.choice(vocab, size=(len(rows), T + 1))
    else:
        source = np.concatenate([packed.inputs[rows], packed.targets[rows][:, -1:]], axis=1)  # T + 1 tokens per row
        if tokens == "shuffled":
            source = rng.permuted(source, axis=1)
    idx = np.arange(T + 1)[None, :] % spans[:, None]
    seq = np.take_along_axis(source, idx, axis=1)
    ones = np.ones((len(rows), T), packed.mask.dtype)
    return {"inputs": seq[:, :-1], "targets": seq[:, 1:], "positions": np.broadcast_to(np.arange(T), (len(rows), T)),
            "mask": ones, "segment_ids": ones.astype(packed.segment_ids.dtype),
            "repeat": np.arange(1, T + 1)[None, :] >= spans[:, None]}


def split_vocab(packed: packing.Packed) -> np.ndarray:
    """The distinct target ids of a split (what "uniform" repeats draw from: the ids of its text
    and EOS, none of the vocabulary's unused or chat-only ids)."""
    return np.unique(packed.targets[packed.mask.astype(bool)])


def with_repeats(packed: packing.Packed, rows: np.ndarray, fraction: float, max_span: int, count: int,
                 seed: int, tokens: str = "span", vocab: np.ndarray | None = None) -> dict[str, jax.Array]:
    """`train_batch` of `rows` where a `fraction` of them (drawn from (seed, count)) are
    `repeated_rows` of `tokens` with spans uniform in [max_span // 8, max_span]: copying from the
    context is learnt from these, which a few million tokens of code alone do not teach a small
    model."""
    b = train_batch(packed, rows)
    rng = np.random.default_rng([seed, count, 7])
    pick = np.flatnonzero(rng.random(len(rows)) < fraction)
    if not len(pick):
        return b
    spans = rng.integers(max(max_span // 8, 1), max_span + 1, len(pick))
    rep = repeated_rows(packed, rows[pick], spans, tokens, rng, vocab)
    for k in ("inputs", "targets", "positions", "segment_ids"):
        b[k] = b[k].at[pick].set(jnp.asarray(rep[k], b[k].dtype))
    b["mask"] = b["mask"].at[pick].set(True)
    return b


def heldout_copy(logprob: Callable, params: Any, data: PackedCorpus, batch: int, span: int = 128,
                 max_rows: int = 32) -> dict[str, float]:
    """In-context copying on held-out code: each of the first `max_rows` rows' first `span`
    tokens repeated; NLL (nats per token) of the first copy and of the repeats. A model that
    copies has a far lower NLL on the repeats; one that does not, about the same."""
    n = min(data.rows, max_rows)
    first = repeat = 0.0
    counts = [0, 0]
    for start in range(0, n, batch):
        rows = np.arange(start, min(start + batch, n))
        rep = repeated_rows(data.packed, rows, np.full(len(rows), span))
        b = {k: jnp.asarray(v) for k, v in rep.items() if k != "repeat"}
        b.update(mask=b["mask"].astype(bool), kv_lengths=jnp.full((len(rows),), b["inputs"].shape[1], jnp.int32))
        logp = np.asarray(logprob(params, b)[0])
        first -= float(logp[~rep["repeat"]].sum())
        repeat -= float(logp[rep["repeat"]].sum())
        counts[0] += int((~rep["repeat"]).sum())
        counts[1] += int(rep["repeat"].sum())
    return {"copy_first_nll": first / max(counts[0], 1), "copy_repeat_nll": repeat / max(counts[1], 1)}


def heldout_loss(logprob: Callable, params: Any, data: PackedCorpus, batch: int) -> dict[str, float]:
    """NLL in nats per token and bits per byte over every row of `data`, `batch` rows at a time
    (the last batch padded with rows that predict nothing)."""
    nll, tokens, n_bytes = 0.0, 0, 0
    for start in range(0, data.rows, batch):
        rows = np.arange(start, start + batch)
        valid = rows < data.rows
        b = train_batch(data.packed, np.where(valid, rows, 0))
        b["mask"] = b["mask"] & jnp.asarray(valid)[:, None]
        logp, _ = logprob(params, b)
        nll -= float(jnp.sum(jnp.where(b["mask"], logp, 0.0)))
        tokens += int(data.row_tokens[rows[valid]].sum())
        n_bytes += int(data.row_bytes[rows[valid]].sum())
    return {"nll": nll / max(tokens, 1), "bpb": nll / math.log(2) / max(n_bytes, 1), "tokens": float(tokens),
            "bytes": float(n_bytes)}


# ------------------------------------------------------------------------------ the job


def setup(ctx: Context) -> tuple[None, tuple[PackedCorpus, PackedCorpus]]:
    """(no SFT demonstrations, (train rows, held-out rows)) from the corpus in ``data.corpus_dir``."""
    cfg = ctx.cfg
    t0 = time.perf_counter()
    split = {name: pack_texts(corpus.read_texts(cfg.data.corpus_dir, name), ctx.tokenizer, cfg.data.seq_len)
             for name in corpus.SPLITS}
    if cfg.data.max_heldout_rows:  # the first rows of the held-out split (a faster evaluation)
        keep = cfg.data.max_heldout_rows
        split["heldout"] = dataclasses.replace(split["heldout"],
                                               packed=packing.Packed(*(a[:keep] for a in split["heldout"].packed)))
    tr, ho = split["train"], split["heldout"]
    if tr.rows < cfg.data.rows_per_step:
        raise ConfigError(f"data.rows_per_step={cfg.data.rows_per_step} > the {tr.rows} rows of the train split")
    if ho.rows == 0:
        raise ConfigError(f"{cfg.data.corpus_dir}: the held-out split is empty (prepare the corpus with --heldout > 0)")
    per_token = tr.row_bytes.sum() / tr.row_tokens.sum()
    ctx.say(f"corpus {cfg.data.corpus_dir}: train {tr.documents} files, {int(tr.row_tokens.sum()):,} tokens in "
            f"{tr.rows} rows of {cfg.data.seq_len} ({per_token:.2f} bytes per token); held-out {ho.documents} files, "
            f"{int(ho.row_tokens.sum()):,} tokens in {ho.rows} rows; an epoch is "
            f"{tr.rows / cfg.data.rows_per_step:.1f} steps; tokenized in {time.perf_counter() - t0:.0f} s")
    return None, (tr, ho)


def plan(ctx: Context, data: tuple[PackedCorpus, PackedCorpus]) -> Plan:
    """Collect = the next rows (`batch_rows`); prepare = `train_batch`; evaluate = `heldout_loss`."""
    cfg = ctx.cfg
    tr, ho = data
    B, seed = cfg.data.rows_per_step, cfg.seed
    logprob = make_logprob_fn(ctx.graphdef)

    def collect(params, version, count):
        return RowBatch(batch_rows(count, B, tr.rows, seed), version, count)

    fraction, max_span = cfg.data.get("repeat_fraction", 0.0), cfg.data.get("repeat_span", 256)
    repeat_tokens = cfg.data.get("repeat_tokens", "span")
    vocab = split_vocab(tr.packed) if fraction > 0 and repeat_tokens == "uniform" else None

    def prepare(params, ref_params, r: RowBatch):
        if fraction > 0:
            return with_repeats(tr.packed, r.rows, fraction, max_span, r.count, seed, repeat_tokens, vocab)
        return train_batch(tr.packed, r.rows)

    def evaluate(params, step):
        t0 = time.perf_counter()
        m = {f"heldout/{k}": v for k, v in heldout_loss(logprob, params, ho, cfg.data.eval_batch).items()}
        m.update({f"heldout/{k}": v for k, v in heldout_copy(logprob, params, ho, cfg.data.eval_batch).items()})
        m["heldout/seconds"] = time.perf_counter() - t0
        ctx.writer.scalars(step, m)
        ctx.say(f"held-out @ step {step}: {m['heldout/bpb']:.4f} bits per byte, {m['heldout/nll']:.4f} nats per token; "
                f"copying a 128-token span: {m['heldout/copy_first_nll']:.2f} -> {m['heldout/copy_repeat_nll']:.2f} "
                f"nats per token ({m['heldout/seconds']:.0f} s)")
        return m

    def metrics(r: RowBatch):
        rows = r.rows
        return {"data/epoch": (r.count + 1) * B / tr.rows,
                "data/tokens": float(tokens_before(r.count + 1, B, tr, seed)),
                "data/bytes_per_token": float(tr.row_bytes[rows].sum() / max(tr.row_tokens[rows].sum(), 1))}

    def derived(scalars):
        return {"train/bpb": scalars["train/policy_loss"] / math.log(2) / scalars["data/bytes_per_token"]}

    def progress(scalars, last_eval):
        fields = {"bpb": scalars["train/bpb"], "epoch": scalars["data/epoch"]}
        if last_eval is not None:
            fields["heldout_bpb"] = last_eval["heldout/bpb"]
        return fields

    return Plan(collect=collect, prepare=prepare, evaluate=evaluate, metrics=metrics, progress=progress,
                minibatches=lambda batch, num, rng: [batch], derived=derived)


JOB = Job(name="pretrain", validate=validate_config, pool_timeout=lambda cfg: None, setup=setup, plan=plan,
          objective=lambda cfg: SFT_OBJECTIVE, log_entropy=False,
          summary_metrics=lambda cfg: ["heldout/bpb", "heldout/nll", "train/bpb"])


def run(cfg: Any, *, log: Callable[[str], None] | None = None, hooks: dict[str, Callable] | None = None) -> RunResult:
    """Run the pretraining job of `cfg` on the engine (`rlcode.train.engine.train`), then export
    its last checkpoint to ``<workdir>/base`` (`export_base`)."""
    result = train(cfg, JOB, log=log, hooks=hooks)
    if result.steps_done > 0:
        export_base(result.workdir, os.path.join(result.workdir, BASE_DIR))
    return result


BASE_DIR = "base"
REPORT = "pretrain.json"
PUBLISHED = os.path.join("checkpoints", "code_base")  # the committed base (experiments/pretrain.py --publish)


def start_from_base(cfg: Any, base: str) -> bool:
    """Apply an RL config's ``base=`` argument to `cfg`: ``"bytes"`` keeps its fresh byte-level
    policy (False); ``"code"`` (the published base, `PUBLISHED`) or a checkpoint directory sets
    ``model.init_from`` to it and takes the tokenizer from its files (True)."""
    if base == "bytes":
        return False
    cfg.model.init_from = PUBLISHED if base == "code" else base
    cfg.tokenizer = "init_from"
    return True


def export_model(model: Any, tokenizer: Any, out: str, report: dict[str, Any]) -> dict[str, Any]:
    """Write `model` with `tokenizer`'s files as a Hugging Face checkpoint directory `out` (config.json,
    model.safetensors, tokenizer files) and `report`, with the parameter count added, as
    ``pretrain.json``; returns that report."""
    from flax import nnx  # noqa: PLC0415

    from rlcode.models import hf  # noqa: PLC0415

    hf.save_checkpoint(model, out, tokenizer=tokenizer)
    report = dict(report, parameters=int(sum(np.size(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))))
    with open(os.path.join(out, REPORT), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, default=str)
    return report


def export_base(workdir: str, out: str, step: int | None = None) -> dict[str, Any]:
    """`export_model` of checkpoint `step` (default: the latest) of the pretraining run in
    `workdir`, with the run's tokenizer. ``pretrain.json`` holds the step, the target tokens
    trained on, the last held-out evaluation at or before that step, the run's time in steps and
    evaluations (all sittings), the parameter count, the config and the corpus's manifest totals."""
    from rlcode.tokenizer import job_tokenizer  # noqa: PLC0415
    from rlcode.train.metrics import read_jsonl  # noqa: PLC0415
    from rlcode.train.workdir import load_run_model  # noqa: PLC0415

    cfg, model, step = load_run_model(workdir, step)
    if cfg.get("job") != "pretrain":
        raise ValueError(f"{workdir}: a {cfg.get('job', 'synth')!r} run, not a pretraining run")
    records = [r for r in read_jsonl(os.path.join(workdir, "tb")) if r["step"] <= step]
    evals = [r for r in records if r.get("heldout/bpb") is not None]
    trained = [r for r in records if r.get("time/step_s") is not None]
    report = {
        "step": step, "steps": int(cfg.train.steps),
        "tokens": trained[-1]["data/tokens"] if trained else 0.0,
        "epochs": trained[-1]["data/epoch"] if trained else 0.0,
        "heldout": {k.split("/", 1)[1]: v for k, v in evals[-1].items() if k.startswith("heldout/")} if evals else None,
        "heldout_step": evals[-1]["step"] if evals else None,
        "train_minutes": sum(r["time/step_s"] for r in trained) / 60,
        "eval_minutes": sum(r.get("heldout/seconds") or 0.0 for r in evals) / 60,
        "config": cfg.to_dict(), "corpus": corpus_summary(cfg.data.corpus_dir),
    }
    tokenizer = job_tokenizer(cfg.get("tokenizer", "byte"), cfg.model.get("init_from", ""))
    return export_model(model, tokenizer, out, report)


def corpus_summary(corpus_dir: str) -> dict[str, Any]:
    """The corpus's manifest without its file list (totals per source and split, what was left
    out); empty when the directory has no manifest."""
    path = os.path.join(corpus_dir, "manifest.json")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return {k: v for k, v in json.load(f).items() if k != "files"}


def heldout_bpb(model: Any, tokenizer: Any, corpus_dir: str, seq_len: int, batch: int = 8) -> dict[str, float]:
    """`heldout_loss` of `model` on the held-out split of the corpus in `corpus_dir`, packed with
    `tokenizer` into rows of `seq_len` as the pretraining job packs it."""
    from flax import nnx  # noqa: PLC0415

    data = pack_texts(corpus.read_texts(corpus_dir, "heldout"), tokenizer, seq_len)
    graphdef, state = nnx.split(model)
    return heldout_loss(make_logprob_fn(graphdef), nnx.to_pure_dict(state), data, batch)
