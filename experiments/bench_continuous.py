"""Benchmark: continuous batching in the sampler against the static batch, at equal work.

    python -m experiments.bench_continuous                 # the main job's policy after SFT, and widely varying lengths
    python -m experiments.bench_continuous --publish       # the same into results/ (the README's table)
    python -m experiments.bench_continuous --quick         # small sizes, fresh weights (seconds)

A static batch decodes every row until the longest one ends; with `sampling.slots` = S, S rows
decode at a time and a slot whose row ended takes the next waiting row (`rlcode.sampling`,
continuous batching). Both draw the same tokens with the same log-probs per row (checked here
on every batch), so generated tokens per second compare equal work. Two length distributions:

* ``main_job``: the synthesis job's own model after its SFT warm start (`--policy=sft`, from the
  job's SFT cache, trained there first if missing: minutes) on its train prompts, its batch
  (8 prompts x 8 samples, 80 new tokens, the EOS stop): the lengths RL starts from;
* ``varied``: the same architecture with fresh weights (a near-uniform policy) and a set of stop
  tokens whose total probability is about 1/30 per step, up to 4x that many new tokens:
  geometric lengths, from 1 token to the cap.

Every variant runs `--batches` batches (different prompts) per round, round-robin over
`--repeats` rounds; reported: the length distribution, seconds per batch, generated tokens/s and
the speed-up over the static batch. JSON to runs/bench_continuous/ (results/ with --publish).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from experiments import bench_util
from experiments import train as train_cli
from experiments.cli import BYTE_LEVEL_MAIN_JOB, PUBLISH_HELP, output_paths
from rlcode import sampling
from rlcode.models import hf
from rlcode.tokenizer import job_tokenizer
from rlcode.train import loop
from rlcode.train import sft as sft_lib

DEFAULT_CONFIG = BYTE_LEVEL_MAIN_JOB
_SLOTS = flags.DEFINE_list("slots", ["4", "8", "16"], "Slot counts to compare with the static batch.")
_POLICY = flags.DEFINE_enum("policy", "sft", ["sft", "fresh"], "Weights of the main-job case.")
_BATCHES = flags.DEFINE_integer("batches", 4, "Batches (different prompts) per round.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed rounds.")
_CASES = flags.DEFINE_list("cases", ["main_job", "varied"], "Length distributions to run.")
_QUICK = flags.DEFINE_bool("quick", False, "Small batches, fresh weights, one round (smoke run).")
_OUT = flags.DEFINE_string("out", None, "JSON output (default runs/bench_continuous/bench_continuous[_quick].json).")
_PUBLISH = flags.DEFINE_bool("publish", False, PUBLISH_HELP)


def length_summary(lengths: np.ndarray, max_new: int) -> dict:
    q = np.percentile(lengths, [0, 25, 50, 75, 90, 100])
    return {"mean": float(lengths.mean()), "std": float(lengths.std()), "min": int(q[0]), "p25": float(q[1]),
            "median": float(q[2]), "p75": float(q[3]), "p90": float(q[4]), "max": int(q[5]),
            "at_cap": float(np.mean(lengths >= max_new)),
            # what a static batch decodes (rows x its longest row) over what the rows generate
            "static_waste": float(np.mean([b.max() * b.size / max(b.sum(), 1) for b in lengths]))}


def run_case(name, graphdef, params, batches, G, opts, slot_counts, repeats) -> list[dict]:
    """batches: [(prompts [P, Lp], lengths [P], key)]. Times the static batch and each slot count."""
    fns = {"static": opts, **{f"slots={s}": dataclasses.replace(opts, slots=s) for s in slot_counts}}
    outs = {}
    for label, cfg in fns.items():  # compile, and the equality check on every batch
        outs[label] = [sampling.sample(graphdef, params, p, n, k, group_size=G, cfg=cfg) for p, n, k in batches]
    lengths = np.stack([np.asarray(o.lengths) for o in outs["static"]])
    for label, res in outs.items():
        for o, ref in zip(res, outs["static"]):
            if not (np.array_equal(np.asarray(o.tokens), np.asarray(ref.tokens))
                    and np.abs(np.asarray(o.logprobs) - np.asarray(ref.logprobs)).max() < 1e-4):
                raise AssertionError(f"{name}: {label} drew different tokens or log-probs than the static batch")
    times = {label: [] for label in fns}
    for _ in range(repeats):
        for label, cfg in fns.items():
            t0 = time.perf_counter()
            for p, n, k in batches:
                jax.block_until_ready(sampling.sample(graphdef, params, p, n, k, group_size=G, cfg=cfg).tokens)
            times[label].append((time.perf_counter() - t0) / len(batches))
    tokens = float(lengths.sum()) / len(batches)
    base = statistics.median(times["static"])
    rows = []
    for label in fns:
        med = statistics.median(times[label])
        rows.append({"case": name, "variant": label, "seconds_per_batch": med, "times_s": times[label],
                     "generated_tokens_per_s": tokens / med, "speedup": base / med,
                     "rows_per_batch": int(lengths.shape[1]), "generated_tokens_per_batch": tokens})
    summary = length_summary(lengths, opts.max_new_tokens)
    for r in rows:
        r["lengths"] = summary
    return rows


def main(cfg):
    quick = _QUICK.value
    out_path, _ = output_paths("bench_continuous", quick, _OUT.value, None, _PUBLISH.value)
    slot_counts = [int(s) for s in _SLOTS.value]
    repeats = 1 if quick else _REPEATS.value
    n_batches = 2 if quick else _BATCHES.value
    P, G = (2, 4) if quick else (cfg.rollout.prompts_per_step, cfg.rollout.group_size)
    M = 16 if quick else cfg.sampling.max_new_tokens
    if quick:
        cfg.task.num_train, cfg.task.num_eval, cfg.task.num_fresh = 8, 4, 0
    tok = job_tokenizer(cfg.get("tokenizer", "byte"), cfg.model.get("init_from", ""))
    tasks, _, _ = loop.build_tasks(cfg, tok)
    graphdef, fresh = nnx.split(hf.initial_model(cfg.model, cfg.seed))
    rows, policy = [], "fresh"
    if "main_job" in _CASES.value:
        params = fresh
        if _POLICY.value == "sft" and not quick:
            sft_params, info = sft_lib.load_or_train(cfg.model, cfg.sft, tasks, cfg.seed)
            params = nnx.split(hf.initial_model(cfg.model, cfg.seed))[1]
            nnx.replace_by_pure_dict(params, sft_lib.merge_params(nnx.to_pure_dict(params), sft_params))
            policy = f"sft ({info['path']})"
        opts = sampling.SamplingConfig(max_new_tokens=M, temperature=cfg.sampling.temperature,
                                       stop_ids=(tok.eos_id,), pad_id=tok.pad_id)
        rng = np.random.default_rng(cfg.seed)
        batches = []
        for b in range(n_batches):
            ids = rng.choice(len(tasks), P, replace=False)
            batches.append((jnp.asarray(tasks.prompts[ids]), jnp.asarray(tasks.prompt_lengths[ids]),
                            jax.random.key(b)))
        rows += run_case("main_job", graphdef, params, batches, G, opts, slot_counts, repeats)
    if "varied" in _CASES.value:
        V = cfg.model.vocab_size
        stops = tuple(range(V - max(1, V // 30), V))
        opts = sampling.SamplingConfig(max_new_tokens=4 * M, temperature=1.0, stop_ids=stops, pad_id=0)
        rng = np.random.default_rng(cfg.seed + 1)
        Lp = tasks.prompts.shape[1]
        batches = []
        for b in range(n_batches):
            lengths = rng.integers(Lp // 2, Lp + 1, P)
            prompts = np.where(np.arange(Lp)[None] < lengths[:, None], rng.integers(1, V - len(stops), (P, Lp)), 0)
            batches.append((jnp.asarray(prompts, jnp.int32), jnp.asarray(lengths, jnp.int32), jax.random.key(100 + b)))
        rows += run_case("varied", graphdef, fresh, batches, G, opts, slot_counts, repeats)
    header = (f"{'case':9s} {'variant':9s} {'s/batch':>8s} {'gen tok/s':>10s} {'speedup':>8s}   lengths "
              "(mean / median / p90 / max; static decodes x as many)")
    print(header + "\n" + "-" * len(header))
    for r in rows:
        L = r["lengths"]
        print(f"{r['case']:9s} {r['variant']:9s} {r['seconds_per_batch']:8.3f} {r['generated_tokens_per_s']:10.0f} "
              f"{r['speedup']:7.2f}x   {L['mean']:.1f} / {L['median']:.0f} / {L['p90']:.0f} / {L['max']} "
              f"(x{L['static_waste']:.2f})")
    bench_util.write_json(out_path, {
        "rows": rows, "policy": policy, "prompts": P, "group": G, "max_new_tokens": M, "batches": n_batches,
        "repeats": repeats, "quick": quick, "machine": bench_util.machine_info()})


if __name__ == "__main__":
    app.run(main, flags_parser=lambda argv: train_cli.flags_parser(argv, DEFAULT_CONFIG))
