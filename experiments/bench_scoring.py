"""Benchmark: scoring only the loss positions (`score_index`) against scoring every position.

    python -m experiments.bench_scoring                                  # the agent job's base=code shapes
    python -m experiments.bench_scoring --config=configs/grpo_synth.py --rows=64 --length=320 --scored=128
    python -m experiments.bench_scoring --quick                          # small shapes, seconds

The model, objective and optimizer are those of `--config` (default the agent job from the
pretrained base; ``--config.<field>=`` overrides apply; its warm start included, e.g. the
pretrained base of ``:base=code``). A batch of `--rows` rows of `--length` positions gets, per
row, between half and 1.5x `--scored` loss positions in up to four spans (turns of an agent
episode, or one completion), as sampled tokens lie in the jobs' batches. Two stages, each with
and without `rlcode.train.step.with_score_index`: ``score`` = one old / reference log-prob pass
(`make_logprob_fn`; a job with a KL term runs two) and ``train`` = one train step (forward, backward, AdamW). The log-probs and
the loss of both variants are checked equal first. Each variant is compiled and warmed up, then
the variants run round-robin for `--repeats` rounds (load from elsewhere falls on all alike);
medians are reported with speedup = full / scored, from the same run. Prints a table and writes
JSON to `--out` (a run directory by default).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import bench_util
from experiments import train as train_cli
from rlcode import losses
from rlcode.models import hf
from rlcode.train import step as step_lib

DEFAULT_CONFIG = "configs/agent_repo.py:base=code"
_ROWS = flags.DEFINE_integer("rows", 32, "Rows of the batch (segments of episodes, or completions).")
_LENGTH = flags.DEFINE_integer("length", 1024, "Positions per row.")
_SCORED = flags.DEFINE_integer("scored", 150, "Mean loss positions per row.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed rounds.")
_QUICK = flags.DEFINE_bool("quick", False, "Small shapes and 2 rounds (smoke run).")
_OUT = flags.DEFINE_string("out", "runs/bench_scoring/bench_scoring.json", "Where to write the JSON results.")


def make_batch(rows: int, length: int, scored: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.zeros((rows, length), bool)
    for r in range(rows):
        n = int(rng.integers(max(scored // 2, 1), max(3 * scored // 2, 2)))
        spans = int(rng.integers(1, 5))
        ends = np.sort(rng.choice(np.arange(length // 4, length), spans, replace=False))
        for e, k in zip(ends, np.diff(np.linspace(0, n, spans + 1).astype(int))):
            mask[r, max(e - k, 0):e] = True
    return {"inputs": rng.integers(0, vocab, (rows, length)).astype(np.int32),
            "targets": rng.integers(0, vocab, (rows, length)).astype(np.int32),
            "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy(),
            "mask": mask, "kv_lengths": np.full(rows, length, np.int32),
            "advantages": rng.normal(size=rows).astype(np.float32),
            "old_logp": np.where(mask, -rng.gamma(2.0, 1.0, mask.shape), 0).astype(np.float32),
            "behavior_logp": np.where(mask, -rng.gamma(2.0, 1.0, mask.shape), 0).astype(np.float32),
            "ref_logp": np.where(mask, -rng.gamma(2.0, 1.0, mask.shape), 0).astype(np.float32)}


def main(cfg):
    rows, length, scored, repeats = ((8, 256, 40, 2) if _QUICK.value else
                                     (_ROWS.value, _LENGTH.value, _SCORED.value, _REPEATS.value))
    model = hf.initial_model(cfg.model, cfg.seed)
    objective = losses.ObjectiveConfig.from_config(cfg.loss)
    optimizer = step_lib.make_optimizer(cfg.optim)
    graphdef, state0 = step_lib.init_train_state(model, optimizer, cfg.seed)
    full = {k: jnp.asarray(v) for k, v in make_batch(rows, length, scored, model.cfg.vocab_size).items()}
    part = step_lib.with_score_index(full, max_fraction=1.0)
    K = int(part["score_index"].shape[1])
    logprob = step_lib.make_logprob_fn(graphdef)
    train_step = step_lib.make_train_step(graphdef, objective, optimizer)
    batches = {"full": full, "scored": part}
    states = {v: jax.tree.map(jnp.copy, state0) for v in batches}

    # Equal numbers first: log-probs at the loss positions, and one train step's loss (old,
    # behaviour and reference log-probs are the model's own, the reference slightly apart).
    lp = {v: np.asarray(logprob(state0.params, b)[0]) for v, b in batches.items()}
    m = np.asarray(full["mask"])
    own = jnp.asarray(np.where(m, lp["full"], 0.0))
    for b in batches.values():
        b.update(old_logp=own, behavior_logp=own, ref_logp=own - 0.05 * jnp.asarray(m))
    logp_diff = float(np.abs(lp["full"][m] - lp["scored"][m]).max())
    losses_ = {}
    for v, b in batches.items():
        states[v], metrics = train_step(states[v], b)
        losses_[v] = float(metrics["loss"])
    print(f"equal: max |logp diff| {logp_diff:.2e}, loss {losses_['full']:.6f} vs {losses_['scored']:.6f}")

    times = {(stage, v): [] for stage in ("score", "train") for v in batches}
    for _ in range(repeats + 1):  # the first round warms up
        for v, b in batches.items():
            t0 = time.perf_counter()
            jax.block_until_ready(logprob(state0.params, b))
            times[("score", v)].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            states[v], metrics = train_step(states[v], b)
            jax.block_until_ready(metrics["loss"])
            times[("train", v)].append(time.perf_counter() - t0)
    rows_out = []
    for stage in ("score", "train"):
        f, s = (statistics.median(times[(stage, v)][1:]) for v in ("full", "scored"))
        rows_out.append({"stage": stage, "full_s": f, "scored_s": s, "speedup": f / s})
    print(f"{rows} rows x {length} positions, {int(m.sum())} loss positions "
          f"({m.sum() / m.size:.1%}), score_index width {K}; {repeats} rounds, medians")
    print(f"| stage | every position (s) | loss positions only (s) | speedup |\n|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['stage']} | {r['full_s']:.3f} | {r['scored_s']:.3f} | {r['speedup']:.2f}x |")
    out = {"config": flags.FLAGS["config"].config_filename, "rows": rows, "length": length, "loss_positions": int(m.sum()),
           "score_index_width": K, "repeats": repeats, "max_logp_diff": logp_diff, "loss": losses_,
           "results": rows_out, "params": int(sum(x.size for x in jax.tree.leaves(state0.params))),
           "machine": bench_util.machine_info()}
    bench_util.write_json(_OUT.value, out)


if __name__ == "__main__":
    app.run(main, flags_parser=lambda argv: train_cli.flags_parser(argv, DEFAULT_CONFIG))
