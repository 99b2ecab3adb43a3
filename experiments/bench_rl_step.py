"""Benchmark: one RL step of the synthesis job, stage by stage, with and without its fast paths.

    python -m experiments.bench_rl_step                                   # the main job's shapes
    python -m experiments.bench_rl_step --prompts=8 --group=8 --prompt_len=192 --new_tokens=128
    python -m experiments.bench_rl_step --quick                           # small shapes, seconds

The model, objective, optimizer and sampler are those of `--config` (default the main job,
configs/grpo_synth.py; ``--config.<field>=`` overrides apply) with freshly initialised weights.
One batch: the first `--prompts` train tasks' prompts (cut to `--prompt_len`), `--group` samples
each of `--new_tokens` tokens (stop tokens are ignored: every row generates the full length, so
each variant does the same work). Stages:

* ``sample``: the group sampler (`rlcode.sampling.sample`: each prompt prefilled once, its rows
  decoded against it);
* ``grade``: the sandbox grades every row (each row is its task's reference solution, so every
  test runs) in a pool of ``sandbox.workers``;
* ``score``: the old / reference log-prob passes that lay out the train batch
  (`rlcode.train.loop.make_prepare_fn`), host work included;
* ``train``: one train step (forward, backward, AdamW).

Score and train run in three variants, round-robin in one process (medians of `--repeats`
rounds; load from elsewhere falls on all alike): ``per_row`` (every row laid out prompt +
completion, a separate old-log-prob pass: the layout before these fast paths), ``shared_prompts``
(each group's prompt computed once, `rlcode.train.step.with_shared_prompts`) and
``shared+on_policy`` (also no old-log-prob pass: one update per batch takes the train step's
own log-probs). Their log-probs and the train step's loss are checked equal first. Reported per
stage: seconds, tokens/s, XLA's temporary memory, and XLA's FLOP count per second against this
machine's measured float32 matmul rate (``util``); speedups against ``per_row`` from the same run.
Prints a table and writes JSON to `--out` (a run directory by default).
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
from experiments.cli import BYTE_LEVEL_MAIN_JOB
from rlcode import advantages as adv_lib
from rlcode import losses, sampling
from rlcode.models import hf
from rlcode.recipes import ShapingConfig
from rlcode.tokenizer import job_tokenizer
from rlcode.train import loop
from rlcode.train import step as step_lib
from rlcode.train.engine import default_pool
from rlcode.train.rollout import Grader, Rollout

DEFAULT_CONFIG = BYTE_LEVEL_MAIN_JOB
VARIANTS = {"per_row": (False, False), "shared_prompts": (True, False), "shared+on_policy": (True, True)}
_PROMPTS = flags.DEFINE_integer("prompts", 0, "Prompts per batch (0: rollout.prompts_per_step).")
_GROUP = flags.DEFINE_integer("group", 0, "Samples per prompt (0: rollout.group_size).")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 0, "Prompt width in tokens (0: task.max_prompt_len).")
_NEW = flags.DEFINE_integer("new_tokens", 0, "Generated tokens per row (0: sampling.max_new_tokens).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed rounds.")
_QUICK = flags.DEFINE_bool("quick", False, "Small shapes and 2 rounds (smoke run).")
_OUT = flags.DEFINE_string("out", "runs/bench_rl_step/bench_rl_step.json", "Where to write the JSON results.")


def matmul_peak(n: int = 1024, repeats: int = 10) -> float:
    """This machine's float32 matmul rate (FLOP/s): the best of `repeats` n x n products."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    jax.block_until_ready(f(a, a))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, a))
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def xla_cost(fn, *args) -> tuple[float | None, int | None]:
    """(FLOPs, temporary bytes) of the jitted `fn` at these arguments, as XLA counts them."""
    compiled = fn.lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mem = compiled.memory_analysis()
    return (float(cost["flops"]) if cost and "flops" in cost else None,
            None if mem is None else int(mem.temp_size_in_bytes))


def make_rollout(cfg, tasks, graphdef, params, P, G, Lp, M, key, repeats) -> tuple[Rollout, float]:
    prompts = np.asarray(tasks.prompts[:P, :Lp])
    lengths = np.minimum(tasks.prompt_lengths[:P], Lp).astype(np.int32)
    scfg = sampling.SamplingConfig(max_new_tokens=M, temperature=cfg.sampling.temperature, stop_ids=(),
                                   pad_id=0)
    fn = lambda k: jax.device_get(sampling.sample(graphdef, params, jnp.asarray(prompts), jnp.asarray(lengths), k,
                                                  group_size=G, cfg=scfg))
    fn(jax.random.fold_in(key, 99))  # compile
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        out = fn(jax.random.fold_in(key, i))
        times.append(time.perf_counter() - t0)
    sample_s = statistics.median(times)
    B = P * G
    rng = np.random.default_rng(0)
    r = Rollout(task_ids=np.arange(P), prompts=prompts, prompt_lengths=lengths, tokens=np.asarray(out.tokens),
                logprobs=np.asarray(out.logprobs, np.float32), mask=np.asarray(out.mask, bool),
                lengths=np.asarray(out.lengths), rewards=rng.random(B).astype(np.float32), terms={},
                valid=np.ones(B, bool), passed=np.zeros(B, bool), pass_fraction=np.zeros(B, np.float32), version=0,
                texts=[""] * B, stats={}, behaviour={})
    return r, sample_s


def time_grading(cfg, tasks, P, G, repeats) -> dict:
    pool = default_pool(cfg.sandbox.workers, cfg.reward.timeout)
    try:
        grader = Grader(pool, timeout=cfg.reward.timeout)
        rows = [tasks.tasks[i] for i in np.repeat(np.arange(P), G)]
        bodies = [t.completion_target() for t in rows]
        grader.grade(rows[:2], bodies[:2])  # workers warm
        times, passed = [], 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            frac, valid, _, _ = grader.grade(rows, bodies)
            times.append(time.perf_counter() - t0)
            passed = float(np.mean(frac >= 1.0))
    finally:
        pool.close()
    return {"stage": "grade", "median_s": statistics.median(times), "executions": len(rows),
            "executions_per_s": len(rows) / statistics.median(times), "reference_pass_rate": passed,
            "workers": int(cfg.sandbox.workers)}


def main(cfg):
    quick = _QUICK.value
    P = 2 if quick else (_PROMPTS.value or cfg.rollout.prompts_per_step)
    G = 4 if quick else (_GROUP.value or cfg.rollout.group_size)
    Lp = 64 if quick else (_PROMPT_LEN.value or cfg.task.max_prompt_len)
    M = 16 if quick else (_NEW.value or cfg.sampling.max_new_tokens)
    repeats = 2 if quick else _REPEATS.value
    cfg.task.max_prompt_len = max(cfg.task.max_prompt_len, Lp)
    if quick:
        cfg.task.num_train, cfg.task.num_eval, cfg.task.num_fresh = 8, 4, 0
    tok = job_tokenizer(cfg.get("tokenizer", "byte"), cfg.model.get("init_from", ""))
    tasks = loop.build_tasks(cfg, tok)[0]
    if len(tasks) < P:
        raise SystemExit(f"--prompts={P}: only {len(tasks)} train tasks fit")
    model = hf.initial_model(cfg.model, cfg.seed)
    objective = losses.ObjectiveConfig.from_config(cfg.loss)
    if objective.kl_coef == 0:
        print("note: the objective has no KL term: no reference pass")
    adv = adv_lib.AdvantageConfig.from_config(cfg.advantage)
    optimizer = step_lib.make_optimizer(cfg.optim)
    graphdef, state0 = step_lib.init_train_state(model, optimizer, cfg.seed)
    ref_params = jax.tree.map(jnp.copy, state0.params) if objective.kl_coef > 0 else None
    opts = sampling.SamplingConfig(max_new_tokens=M, temperature=cfg.sampling.temperature)
    peak = matmul_peak()
    print(f"float32 matmul rate: {peak / 1e9:.1f} GFLOP/s; batch {P} prompts x {G} samples, prompts <= {Lp}, "
          f"{M} new tokens")

    r, sample_s = make_rollout(cfg, tasks, graphdef, state0.params, P, G, Lp, M, jax.random.key(cfg.seed), repeats)
    B = P * G
    rows = [{"stage": "sample", "median_s": sample_s, "tokens": B * M, "tokens_per_s": B * M / sample_s}]
    rows.append(time_grading(cfg, tasks, P, G, repeats))

    # Each variant: its prepare fn and train step, compiled and checked equal.
    logprob = step_lib.make_logprob_fn(graphdef, temperature=cfg.sampling.temperature)
    runs, reference = {}, None
    for name, (shared, on_policy) in VARIANTS.items():
        if shared and not loop.use_shared_prompts(cfg):
            print(f"{name}: skipped (the model's forward does not share prompts: {cfg.model.attention['kind']} "
                  f"attention, {cfg.model.mlp['kind']} MLP)")
            continue
        prepare = loop.make_prepare_fn(objective, adv, opts, graphdef, G, 0, cfg.rollout.get("trim_multiple", 32),
                                       shared_prompts=shared, on_policy=on_policy)
        step = step_lib.make_train_step(graphdef, objective, optimizer)
        state = jax.tree.map(jnp.copy, state0)
        batch = jax.block_until_ready(prepare(state.params, ref_params, r))
        flops_lp, temp_lp = xla_cost(logprob, state.params, batch)
        flops_tr, temp_tr = xla_cost(step, state, batch)
        state, metrics = step(state, batch)
        lp = np.asarray(logprob(state0.params, batch)[0])
        if reference is None:
            reference = (lp, float(metrics["loss"]), np.asarray(batch["mask"]))
        m = reference[2]  # the per-row batch's time axis is trimmed, the shared one's is whole
        if np.asarray(batch["mask"])[:, m.shape[1]:].any():
            raise AssertionError(f"{name}: loss positions beyond the per-row batch's time axis")
        diff = float(np.abs(lp[:, :m.shape[1]][m] - reference[0][m]).max())
        print(f"{name}: max |logp - per_row| {diff:.2e}, loss {float(metrics['loss']):.6e} "
              f"(per_row {reference[1]:.6e})")
        passes = (0 if "old_logp" not in batch else 1) + (ref_params is not None)
        runs[name] = dict(prepare=prepare, step=step, state=state, passes=passes, logp_diff=diff,
                          loss=float(metrics["loss"]), flops_score=None if flops_lp is None else flops_lp * passes,
                          flops_train=flops_tr, temp_score=temp_lp, temp_train=temp_tr, times={"score": [], "train": []},
                          tokens=int(np.asarray(batch["mask"]).sum()))
    for _ in range(repeats + 1):  # the first round warms up
        for run in runs.values():
            t0 = time.perf_counter()
            batch = jax.block_until_ready(run["prepare"](run["state"].params, ref_params, r))
            t1 = time.perf_counter()
            run["state"], metrics = run["step"](run["state"], batch)
            jax.block_until_ready(metrics["loss"])
            run["times"]["score"].append(t1 - t0)
            run["times"]["train"].append(time.perf_counter() - t1)
    base = runs.get("per_row")
    for name, run in runs.items():
        for stage in ("score", "train"):
            t = statistics.median(run["times"][stage][1:])
            flops = run[f"flops_{stage}"]
            row = {"stage": stage, "variant": name, "median_s": t, "tokens": run["tokens"],
                   "tokens_per_s": run["tokens"] / t, "xla_temp_bytes": run[f"temp_{stage}"],
                   "xla_flops": flops, "util": None if flops is None else flops / t / peak,
                   "passes": run["passes"] if stage == "score" else None}
            if base is not None:
                row["speedup"] = statistics.median(base["times"][stage][1:]) / t
            rows.append(row)
        rows.append({"stage": "step", "variant": name, "median_s": sum(
            statistics.median(run["times"][s][1:]) for s in ("score", "train")) + rows[0]["median_s"]
            + rows[1]["median_s"], "logp_diff": run["logp_diff"], "loss": run["loss"]})
    if base is not None:
        b = next(x["median_s"] for x in rows if x["stage"] == "step" and x["variant"] == "per_row")
        for x in rows:
            if x["stage"] == "step":
                x["speedup"] = b / x["median_s"]

    print(f"\n{B} rows x ({Lp} prompt + {M} new) tokens; {repeats} rounds, medians; util = XLA FLOPs / s / "
          f"matmul rate")
    print("| stage | variant | seconds | tokens/s | XLA temp (MiB) | util | speedup vs per_row |")
    print("|---|---|---|---|---|---|---|")
    fmt = lambda v, f: "" if v is None else format(v, f)
    for x in rows:
        temp, speed = x.get("xla_temp_bytes"), x.get("speedup")
        print(f"| {x['stage']} | {x.get('variant', '')} | {x['median_s']:.3f} | {fmt(x.get('tokens_per_s'), ',.0f')} | "
              f"{fmt(None if temp is None else temp / 2**20, '.1f')} | {fmt(x.get('util'), '.1%')} | "
              f"{fmt(speed, '.2f')}{'x' if speed is not None else ''} |")
    out = {"config": flags.FLAGS["config"].config_filename, "prompts": P, "group": G, "prompt_len": Lp,
           "new_tokens": M, "repeats": repeats, "matmul_flops_per_s": peak, "results": rows,
           "params": int(sum(x.size for x in jax.tree.leaves(state0.params))),
           "machine": bench_util.machine_info()}
    bench_util.write_json(_OUT.value, out)


if __name__ == "__main__":
    app.run(main, flags_parser=lambda argv: train_cli.flags_parser(argv, DEFAULT_CONFIG))
