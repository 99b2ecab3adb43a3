"""Which part of the pretraining step decides how fast a model learns to copy from its context?

    python -m experiments.copy_probe                      # the committed base, 200 steps per variant
    python -m experiments.copy_probe --steps=100 --variants=job,adam
    python -m experiments.copy_probe --scratch --variants=job --steps=1500   # the base's shape, fresh

Every variant starts from the same checkpoint (``--init``, default checkpoints/code_base), or with
``--scratch`` from a fresh initialisation (seed ``--seed``) of its architecture, whose fields
``--arch`` may change (e.g. ``--arch=num_layers=6,num_heads=8``; the tokenizer stays the
checkpoint's), and trains on rows of ``--seq_len`` tokens that are one span of ids repeated (`rlcode.train.pretrain.
repeated_rows`, "uniform": ids drawn from the corpus's train vocabulary, or its ``--vocab_top`` most
frequent ids), ``--rows`` rows a step, for
``--steps`` steps at a constant learning rate. Variants differ in one thing each:

* ``job``: the pretraining job's own step (`make_train_step` with the SFT objective and
  `make_optimizer`: clipping at 1.0, AdamW b2 = 0.95, weight decay 0), spans uniform in
  [2, ``--span``] as the job draws them;
* ``job_fixed``: the same step, every span exactly ``--span`` tokens;
* ``adam``: plain `optax.adam` (b2 = 0.999, no clipping) on the mean NLL, spans as ``job``;
* ``adam_fixed``: plain Adam, fixed spans;
* ``job_mixed`` (not run by default): the job's step and spans, but only half of each step's rows
  are copy rows; the other half are rows of the train split's code (`train_batch`, in the job's
  order), as a pretraining schedule that must keep the base's code would mix them.

Each variant's batches are the same for a given span rule (the same random generator). Every
``--eval_every`` steps it reports the copy NLL (nats per token of the repeats, the first copy
excluded) on 64 fresh rows of uniform ids with spans uniform in [``--span`` // 8, ``--span``]
(``uniform_repeat_nll``: a model that only learnt "copy from ``--span`` tokens back" fails most of
them), on 64 rows whose spans are all ``--span`` (``fixed_repeat_nll``: that rule suffices), and on
128-token spans of held-out code (`heldout_copy`, the pretraining job's metric: copying by content). Prints a table and writes
``<out>/copy_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import types
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.cli import summary
from rlcode.data import corpus
from rlcode.models import hf
from rlcode.models.transformer import ModelConfig, init_model
from rlcode.tokenizer import load_tokenizer
from rlcode.train import pretrain
from rlcode.train.sft import SFT_OBJECTIVE
from rlcode.train.step import init_train_state, make_logprob_fn, make_optimizer, make_train_step, optim_config

VARIANTS = ("job", "job_fixed", "adam", "adam_fixed", "job_mixed")
DEFAULT_VARIANTS = VARIANTS[:4]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.copy_probe", description=summary(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init", default=pretrain.PUBLISHED, help="Hugging Face checkpoint directory to start from")
    p.add_argument("--scratch", action="store_true",
                   help="start from a fresh initialisation of the checkpoint's architecture instead of its weights")
    p.add_argument("--arch", default="",
                   help="with --scratch: comma-separated model-config fields to change, e.g. num_layers=6,num_heads=8")
    p.add_argument("--corpus", default=".cache/corpus", help="prepared corpus (experiments.prepare_corpus)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--span", type=int, default=16, help="longest (job) or every (fixed) span")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab_top", type=int, default=0,
                   help="draw the trained rows' ids from the N most frequent train ids (0: all of them); the "
                        "probe rows always draw from all")
    p.add_argument("--eval_every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("runs", "copy_probe"))
    return p.parse_args(argv)


def parse_arch(text: str) -> dict[str, int | float]:
    """``"num_layers=6,num_heads=8"`` -> {"num_layers": 6, "num_heads": 8} (ints, else floats)."""
    out: dict[str, int | float] = {}
    for item in filter(None, text.split(",")):
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise SystemExit(f"error: --arch item {item!r}: expected field=value")
        try:
            out[name.strip()] = int(value)
        except ValueError:
            try:
                out[name.strip()] = float(value)
            except ValueError:
                raise SystemExit(f"error: --arch item {item!r}: {value!r} is not a number") from None
    return out


def scratch_section(init: str, arch: dict[str, int | float]) -> Any:
    """The model section of checkpoint `init`'s architecture with the `arch` changes, validated
    (an impossible shape fails here, before the corpus is read)."""
    section = hf.model_config_from_hf(hf.read_config(init), dtype="float32", param_dtype="float32")
    for name, value in arch.items():
        if name not in section:
            raise SystemExit(f"error: --arch: the model config has no field {name!r}")
        section[name] = value
    ModelConfig.from_config(section)
    return section


def start_model(args, section: Any) -> Any:
    """The model every variant starts from: the checkpoint (`section` None), or a fresh one of `section`."""
    if section is None:
        return hf.load_checkpoint(args.init, dtype="float32", param_dtype="float32")
    return init_model(section, args.seed)


def batch_of(rows: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """The job's train batch (`train_batch`) of every row of `repeated_rows` fields."""
    return pretrain.train_batch(types.SimpleNamespace(**rows), np.arange(len(rows["inputs"])))


def uniform_rows(vocab: np.ndarray, rows: int, seq_len: int, spans: np.ndarray, rng: np.random.Generator):
    """`repeated_rows` of uniform ids, `rows` rows of `seq_len` (uniform ids read only the split's shapes)."""
    shape = np.zeros((rows, seq_len), np.int32)
    split = types.SimpleNamespace(inputs=shape, targets=shape, mask=shape, segment_ids=shape)
    return pretrain.repeated_rows(split, np.arange(rows), spans, "uniform", rng, vocab)


def probe_nll(logprob, params, rows: dict[str, np.ndarray]) -> float:
    logp = np.asarray(logprob(params, batch_of(rows))[0])
    return float(-logp[rows["repeat"]].mean())


def run_variant(name: str, args, model, vocab, heldout, probe_rows, code: pretrain.PackedCorpus) -> dict[str, Any]:
    fixed = name.endswith("_fixed")
    job_step = name.startswith("job")
    optimizer = (make_optimizer(optim_config(lr=args.lr, warmup_steps=1, min_lr_ratio=1.0, total_steps=args.steps,
                                             weight_decay=0.0)) if job_step else optax.adam(args.lr))
    graphdef, state = init_train_state(model, optimizer, args.seed)
    logprob = make_logprob_fn(graphdef)
    if job_step:
        step_fn = make_train_step(graphdef, SFT_OBJECTIVE, optimizer)
    else:
        @jax.jit
        def step_fn(state, batch):
            def loss_fn(params):
                logp = logprob(params, batch)[0]
                return -(logp * batch["mask"]).sum() / batch["mask"].sum()
            loss, grads = jax.value_and_grad(loss_fn)(state.params)
            updates, opt = optimizer.update(grads, state.opt_state, state.params)
            return state._replace(params=optax.apply_updates(state.params, updates), opt_state=opt,
                                  step=state.step + 1), {"loss": loss}
    rng = np.random.default_rng([args.seed, 1 if fixed else 0])
    curve, t0 = [], time.perf_counter()

    def evaluate(step: int, loss: float | None) -> None:
        row = {"step": step, "loss": loss, "uniform_repeat_nll": probe_nll(logprob, state.params, probe_rows["varied"]),
               "fixed_repeat_nll": probe_nll(logprob, state.params, probe_rows["fixed"])}
        row.update(pretrain.heldout_copy(logprob, state.params, heldout, batch=8))
        curve.append(row)
        print(f"{name:>10} step {step:4d}  loss {'-' if loss is None else f'{loss:.3f}':>6}  "
              f"repeat NLL, spans varied {row['uniform_repeat_nll']:.3f} / fixed {row['fixed_repeat_nll']:.3f}  "
              f"held-out code copy "
              f"{row['copy_first_nll']:.2f} -> {row['copy_repeat_nll']:.2f}  ({time.perf_counter() - t0:.0f} s)",
              flush=True)

    evaluate(0, None)
    for step in range(1, args.steps + 1):
        spans = (np.full(args.rows, args.span) if fixed else rng.integers(max(args.span // 8, 1), args.span + 1,
                                                                           args.rows))
        if name == "job_mixed":  # half copy rows (the first spans drawn), half code rows
            half = args.rows // 2
            copy = batch_of(uniform_rows(vocab, half, args.seq_len, spans[:half], rng))
            text = pretrain.train_batch(code.packed, pretrain.batch_rows(step - 1, args.rows - half, code.rows,
                                                                         args.seed))
            batch = {k: jnp.concatenate([text[k], copy[k].astype(text[k].dtype)]) for k in copy}
        else:
            batch = batch_of(uniform_rows(vocab, args.rows, args.seq_len, spans, rng))
        state, m = step_fn(state, batch)
        loss = float(m["loss"] if "loss" in m else m["train/loss"])
        if step % args.eval_every == 0 or step == args.steps:
            evaluate(step, loss)
    return {"variant": name, "curve": curve, "seconds": time.perf_counter() - t0,
            "parameters": int(sum(x.size for x in jax.tree.leaves(state.params)))}


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    arch = parse_arch(args.arch)  # a malformed --arch fails before the corpus is read
    if arch and not args.scratch:
        raise SystemExit("error: --arch changes the architecture of a fresh model: it needs --scratch")
    if "vocab_size" in arch:
        raise SystemExit("error: --arch cannot change vocab_size: the rows use the checkpoint's tokenizer")
    section = scratch_section(args.init, arch) if args.scratch else None
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"error: unknown variants {bad}; expected some of {VARIANTS}")
    tokenizer = load_tokenizer(args.init)  # the checkpoint's own ids
    train_split = pretrain.pack_texts(corpus.read_texts(args.corpus, "train"), tokenizer, args.seq_len)
    heldout = pretrain.pack_texts(corpus.read_texts(args.corpus, "heldout"), tokenizer, 256)
    vocab = pretrain.split_vocab(train_split.packed)
    train_vocab = vocab
    if args.vocab_top:
        counts = np.bincount(train_split.packed.targets[train_split.packed.mask.astype(bool)])
        train_vocab = np.sort(np.argsort(-counts, kind="stable")[:args.vocab_top])
    probe_rng = np.random.default_rng([args.seed, 99])
    probe_rows = {"varied": uniform_rows(vocab, 64, args.seq_len, probe_rng.integers(max(args.span // 8, 1),
                                                                                       args.span + 1, 64), probe_rng),
                  "fixed": uniform_rows(vocab, 64, args.seq_len, np.full(64, args.span), probe_rng)}
    results = []
    for name in variants:
        model = start_model(args, section)
        results.append(run_variant(name, args, model, train_vocab, heldout, probe_rows, train_split))
    print("\n| variant | steps | repeat NLL, spans varied: start -> end | spans fixed | held-out code copy NLL "
          "(first -> repeat) start | end |")
    print("|---|---|---|---|---|---|")
    for r in results:
        a, b = r["curve"][0], r["curve"][-1]
        print(f"| {r['variant']} | {b['step']} | {a['uniform_repeat_nll']:.3f} -> {b['uniform_repeat_nll']:.3f} | "
              f"{a['fixed_repeat_nll']:.3f} -> {b['fixed_repeat_nll']:.3f} | "
              f"{a['copy_first_nll']:.2f} -> {a['copy_repeat_nll']:.2f} | {b['copy_first_nll']:.2f} -> "
              f"{b['copy_repeat_nll']:.2f} |")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "copy_probe.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
