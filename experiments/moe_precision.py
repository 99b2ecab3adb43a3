"""Does low precision train? A tiny MoE language model in bf16 vs MXFP8 expert GEMMs.

    python -m experiments.moe_precision                    # 300 steps per precision (minutes on CPU)
    python -m experiments.moe_precision --quick            # 20 steps, a smoke test

Trains the same MoE policy model (2 layers, d 128, 8 experts top-2 of width 256 plus one shared
expert, softmax router with the Switch load-balancing and z losses) as a byte-level language
model on a built-in corpus: the program-synthesis tasks of `rlcode.envs.tasks.synth` (signature,
examples and reference body of each task; seeded, so every run sees the same text). One run per
precision with the same seed, the same initial parameters and the same batches:

  bf16    activations and expert GEMMs in bfloat16 (float32 accumulation), router in float32
  mxfp8   the same, but every expert GEMM (forward, input gradient and weight gradient) goes
          through the MXFP8 emulation of `kernels.moe_gemm` (E4M3 elements, E8M0 scales per 32
          along each GEMM's contracting axis, RCEIL; docs/reference.md §9)

Parameters are float32 (AdamW master weights) in both. Logged per step: train loss (next-token
cross-entropy, nats/byte), the MoE aux and z losses; every `--eval_every` steps the loss on a
held-out slice of the corpus. Writes TensorBoard event files + metrics.jsonl per run under
`--workdir`, a JSON summary and a PNG of both loss curves (runs/moe_precision/; with `--publish`
`results/moe_precision.json` and `docs/figures/moe_precision.png`). The reported gap is (mxfp8 - bf16) / bf16 of the final
held-out loss and of the mean train loss over the last `--final_window` steps.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from experiments.cli import PUBLISH_HELP, output_paths
from flax import nnx

from rlcode.envs.tasks import synth
from rlcode.models.moe import moe_config
from rlcode.models.transformer import init_model, model_config
from rlcode.tokenizer import ByteTokenizer
from rlcode.train.metrics import EventWriter

_STEPS = flags.DEFINE_integer("steps", 300, "Training steps per precision.")
_BATCH = flags.DEFINE_integer("batch", 16, "Sequences per batch.")
_SEQ = flags.DEFINE_integer("seq", 128, "Tokens per sequence.")
_LR = flags.DEFINE_float("lr", 3e-3, "Peak learning rate (AdamW, warmup then cosine).")
_SEED = flags.DEFINE_integer("seed", 0, "Initialisation and data seed (shared by both precisions).")
_PRECISIONS = flags.DEFINE_list("precisions", ["bf16", "mxfp8"], "Expert GEMM precisions to train.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 25, "Held-out loss every this many steps.")
_FINAL_WINDOW = flags.DEFINE_integer("final_window", 25, "Steps averaged for the final train loss.")
_NUM_TASKS = flags.DEFINE_integer("num_tasks", 3000, "Synthesis tasks in the corpus.")
_QUICK = flags.DEFINE_bool("quick", False, "20 steps, 300 tasks: a smoke test.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/moe_precision", "TensorBoard logs, one subdirectory per precision.")
_OUT = flags.DEFINE_string("out", None, "JSON summary (default runs/moe_precision/moe_precision[_quick].json).")
_PNG = flags.DEFINE_string("png", None, "PNG (default: next to the JSON).")
_PUBLISH = flags.DEFINE_bool("publish", False, PUBLISH_HELP)


def build_corpus(num_tasks: int, seed: int) -> np.ndarray:
    """Byte ids of the synthesis tasks' text (prompt + reference body per task), one stream."""
    tok = ByteTokenizer()
    # Depth 1 has under a hundred distinct behaviours; depths 2-4 have plenty.
    tasks = synth.make_split("train", num_tasks, seed=seed, levels=(2, 3, 4))
    text = "\n".join(synth.completion_prompt(t) + synth.completion_target(t) for t in tasks)
    return np.asarray(tok.encode(text), np.int32)


def make_batches(corpus: np.ndarray, steps: int, batch: int, seq: int, seed: int):
    """(train batches [steps, batch, seq+1], eval batch [4*batch, seq+1]); the last 10% of the
    corpus is held out for evaluation."""
    split = int(len(corpus) * 0.9)
    train, held = corpus[:split], corpus[split:]
    if len(held) < seq + 2:
        raise ValueError(f"corpus of {len(corpus)} tokens is too small for sequences of {seq}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(train) - seq - 1, size=(steps, batch))
    train_b = train[starts[..., None] + np.arange(seq + 1)]
    eval_starts = np.linspace(0, len(held) - seq - 2, 4 * batch).astype(int)
    return train_b, held[eval_starts[:, None] + np.arange(seq + 1)]


def model_cfg(precision: str):
    return model_config(
        vocab_size=ByteTokenizer().vocab_size, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
        ffw_dim=256, dtype="bfloat16", param_dtype="float32",
        mlp=moe_config(num_experts=8, top_k=2, expert_ffw_dim=256, num_shared_experts=1, router="softmax",
                       aux_loss_coef=0.01, z_loss_coef=1e-3, dispatch="dropless", precision=precision, impl="xla"),
    )


def lm_loss(model, batch):
    """Mean next-token cross-entropy (float32) plus the MoE auxiliary losses; returns (total, parts)."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    out = model(inputs)
    logits = model.logits(out.hidden)
    nll = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1))
    aux = {k: v for k, v in out.aux.items() if k.endswith("_loss")}
    return nll + sum(aux.values()), {"nll": nll, **aux}


def train_one(precision: str, train_b, eval_b, logdir: str, settings: dict) -> dict:
    """One run; `settings` (the run's other options) are logged as its hyperparameters."""
    steps = train_b.shape[0]
    model = init_model(model_cfg(precision), seed=_SEED.value)
    graphdef, params = nnx.split(model)
    schedule = optax.warmup_cosine_decay_schedule(0.0, _LR.value, min(20, steps // 5 + 1), steps, _LR.value * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        def loss_fn(p):
            return lm_loss(nnx.merge(graphdef, p), batch)

        (_, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, parts

    @jax.jit
    def evaluate(params, batch):
        return lm_loss(nnx.merge(graphdef, params), batch)[1]["nll"]

    curve, evals = [], []
    t0 = time.time()
    with EventWriter(logdir) as writer:
        writer.hparams({"precision": precision, **settings}, metrics=["train/loss", "eval/loss"])
        for s in range(steps):
            params, opt_state, parts = step(params, opt_state, jnp.asarray(train_b[s]))
            parts = {k: float(v) for k, v in parts.items()}
            if not np.isfinite(parts["nll"]):
                raise FloatingPointError(f"{precision}: non-finite loss at step {s + 1}: {parts}")
            curve.append(parts["nll"])
            values = {"train/loss": parts["nll"], **{f"train/{k}": v for k, v in parts.items() if k != "nll"}}
            if (s + 1) % _EVAL_EVERY.value == 0 or s + 1 == steps:
                evals.append((s + 1, float(evaluate(params, jnp.asarray(eval_b)))))
                values["eval/loss"] = evals[-1][1]
            writer.scalars(s + 1, values)
            if (s + 1) % 25 == 0 or s + 1 == steps:
                el = time.time() - t0
                print(f"[{precision}] step {s + 1}/{steps} loss {parts['nll']:.4f} "
                      f"eval {evals[-1][1] if evals else float('nan'):.4f} ({el:.0f}s, ETA {el / (s + 1) * (steps - s - 1):.0f}s)",
                      flush=True)
    window = min(_FINAL_WINDOW.value, steps)
    return dict(precision=precision, train_curve=curve, eval_curve=evals, final_train=float(np.mean(curve[-window:])),
                final_eval=evals[-1][1], wall_s=time.time() - t0, logdir=logdir)


def plot(runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, r in enumerate(runs):
        curve = np.asarray(r["train_curve"])
        k = max(1, len(curve) // 30)
        smooth = np.convolve(curve, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(k, len(curve) + 1), smooth, color=f"C{i}", label=f"{r['precision']} train (mean of {k})")
        ax.plot([s for s, _ in r["eval_curve"]], [v for _, v in r["eval_curve"]], "o--", color=f"C{i}",
                label=f"{r['precision']} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title("MoE LM: bf16 vs MXFP8 expert GEMMs (python -m experiments.moe_precision)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv):
    del argv
    quick = _QUICK.value
    steps = 20 if quick and not flags.FLAGS["steps"].present else _STEPS.value
    num_tasks = 300 if quick and not flags.FLAGS["num_tasks"].present else _NUM_TASKS.value
    for p in _PRECISIONS.value:
        if p not in ("bf16", "mxfp8"):
            raise app.UsageError(f"--precisions: unknown precision {p!r} (bf16, mxfp8)")
    out, png = output_paths("moe_precision", quick, _OUT.value, _PNG.value, _PUBLISH.value)
    corpus = build_corpus(num_tasks, _SEED.value)
    train_b, eval_b = make_batches(corpus, steps, _BATCH.value, _SEQ.value, _SEED.value)
    print(f"corpus: {len(corpus)} bytes from {num_tasks} synthesis tasks; {steps} steps of {_BATCH.value}x{_SEQ.value}")
    settings = dict(steps=steps, batch=_BATCH.value, seq=_SEQ.value, lr=_LR.value, seed=_SEED.value,
                    num_tasks=num_tasks)
    runs = [train_one(p, train_b, eval_b, os.path.join(_WORKDIR.value, p), settings) for p in _PRECISIONS.value]
    record = dict(steps=steps, batch=_BATCH.value, seq=_SEQ.value, lr=_LR.value, seed=_SEED.value,
                  corpus_tokens=int(len(corpus)), num_tasks=num_tasks, runs=runs)
    by = {r["precision"]: r for r in runs}
    print(f"\n{'precision':<10} {'final train (last ' + str(min(_FINAL_WINDOW.value, steps)) + ')':>24} {'final held-out':>15} {'wall s':>8}")
    for r in runs:
        print(f"{r['precision']:<10} {r['final_train']:>24.4f} {r['final_eval']:>15.4f} {r['wall_s']:>8.0f}")
    if "bf16" in by and "mxfp8" in by:
        for key in ("final_train", "final_eval"):
            record[f"gap_{key}"] = (by["mxfp8"][key] - by["bf16"][key]) / by["bf16"][key]
        print(f"MXFP8 vs bf16: train {100 * record['gap_final_train']:+.2f}%, held-out {100 * record['gap_final_eval']:+.2f}% "
              "(target: within 1%)")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    plot(runs, png)
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    app.run(main)
