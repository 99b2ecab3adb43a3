"""Sampling benchmark: KV-cached decode and shared-prefix groups against their naive baselines.

    python -m experiments.bench_sampling            # full sizes (a few minutes on 2 CPU cores)
    python -m experiments.bench_sampling --quick    # small sizes, seconds

1. decode: `rlcode.sampling.sample` (prefill once, then one cached decode step per token) vs a
   sampler that recomputes the full forward over the whole sequence buffer for every new token,
   at 256 new tokens.
2. groups: G = 16 samples of one 1024-token prompt, 32 new tokens: the prompt prefilled once and
   its cache shared by the group vs the prompt prefilled 16 times (16 independent rows).

Both pairs draw the same tokens (same per-row keys; checked here), so the comparison is of
equal work. Times are medians of repeated runs after a compile/warm-up run, ratios are taken
within one run. Prints a table and writes JSON (default runs/bench_sampling/bench_sampling.json;
results/bench_sampling.json with --publish).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.cli import PUBLISH_HELP, output_paths
from flax import nnx

from rlcode import sampling
from rlcode.models.attention import AttentionMask
from rlcode.models.transformer import init_model, model_config

_QUICK = flags.DEFINE_bool("quick", False, "Small sizes (smoke run).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repeats per variant (median reported).")
_OUT = flags.DEFINE_string("out", None, "Where to write the JSON results (default runs/bench_sampling/).")
_PUBLISH = flags.DEFINE_bool("publish", False, PUBLISH_HELP)


def bench_model_config(quick: bool):
    if quick:
        return model_config(vocab_size=512, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffw_dim=192)
    return model_config(vocab_size=4096, d_model=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, ffw_dim=768)


@functools.partial(jax.jit, static_argnames=("graphdef", "group_size", "cfg"))
def sample_without_cache(graphdef, params, prompts, prompt_lengths, key, *, group_size, cfg):
    """Baseline: every new token recomputes the full causal forward over the sequence buffer.

    Same distribution and per-row keys as `rlcode.sampling.sample`, so it draws the same tokens.
    """
    model = nnx.merge(graphdef, params)
    Pg, Lp = prompts.shape
    B, M = Pg * group_size, cfg.max_new_tokens
    p = jnp.repeat(prompt_lengths.astype(jnp.int32), group_size)
    buf = jnp.concatenate([jnp.repeat(prompts, group_size, 0), jnp.full((B, M), cfg.pad_id, jnp.int32)], axis=1)
    row_keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(B))

    def body(step, carry):
        buf, tokens, logps = carry
        hidden = model(buf, mask=AttentionMask(kv_lengths=p + step)).hidden
        last = jnp.take_along_axis(hidden, (p + step - 1)[:, None, None], axis=1)[:, 0]
        keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(row_keys)
        token, logp = sampling.sample_token(keys, model.logits(last), cfg)
        buf = buf.at[jnp.arange(B), p + step].set(token)
        return buf, tokens.at[:, step].set(token), logps.at[:, step].set(logp)

    init = (buf, jnp.zeros((B, M), jnp.int32), jnp.zeros((B, M), jnp.float32))
    _, tokens, logps = jax.lax.fori_loop(0, M, body, init)
    return tokens, logps


def timed(fn, repeats):
    jax.block_until_ready(fn())  # compile + warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def main(argv):
    del argv
    quick, repeats = _QUICK.value, _REPEATS.value
    out, _ = output_paths("bench_sampling", quick, _OUT.value, None, _PUBLISH.value)  # no figure
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    model = init_model(bench_model_config(quick), seed=0)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    V = model.cfg.vocab_size
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    rows = []

    # 1. Cached decode vs full recompute per token.
    B, Lp, M = (2, 16, 32) if quick else (4, 64, 256)
    prompts = jnp.asarray(rng.integers(1, V, (B, Lp)), jnp.int32)
    lengths = jnp.full((B,), Lp, jnp.int32)
    cfg = sampling.SamplingConfig(max_new_tokens=M, temperature=1.0)
    cached = lambda: sampling.sample(graphdef, params, prompts, lengths, key, group_size=1, cfg=cfg).tokens
    naive = lambda: sample_without_cache(graphdef, params, prompts, lengths, key, group_size=1, cfg=cfg)[0]
    same = bool(np.array_equal(np.asarray(cached()), np.asarray(naive())))
    t_cached, all_cached = timed(cached, repeats)
    t_naive, all_naive = timed(naive, repeats)
    rows.append({"benchmark": "decode", "setting": f"B={B} prompt={Lp} new={M}", "baseline": "full forward per token",
                 "baseline_s": t_naive, "ours_s": t_cached, "speedup": t_naive / t_cached, "target": 5.0,
                 "same_tokens": same, "baseline_runs_s": all_naive, "ours_runs_s": all_cached})

    # 2. Shared-prefix group vs independent prefills.
    Lp, G, M = (128, 8, 8) if quick else (1024, 16, 32)
    prompt = jnp.asarray(rng.integers(1, V, (1, Lp)), jnp.int32)
    length = jnp.array([Lp], jnp.int32)
    cfg = sampling.SamplingConfig(max_new_tokens=M, temperature=1.0)
    shared = lambda: sampling.sample(graphdef, params, prompt, length, key, group_size=G, cfg=cfg).tokens
    separate = lambda: sampling.sample(graphdef, params, jnp.repeat(prompt, G, 0), jnp.repeat(length, G), key,
                                       group_size=1, cfg=cfg).tokens
    same = bool(np.array_equal(np.asarray(shared()), np.asarray(separate())))
    t_shared, all_shared = timed(shared, repeats)
    t_separate, all_separate = timed(separate, repeats)
    rows.append({"benchmark": "groups", "setting": f"prompt={Lp} G={G} new={M}", "baseline": f"{G} independent prefills",
                 "baseline_s": t_separate, "ours_s": t_shared, "speedup": t_separate / t_shared, "target": 3.0,
                 "same_tokens": same, "baseline_runs_s": all_separate, "ours_runs_s": all_shared})

    header = f"{'benchmark':<10} {'setting':<26} {'baseline':<26} {'base s':>8} {'ours s':>8} {'speedup':>8} {'target':>7} {'same':>5}"
    print(header)
    for r in rows:
        print(f"{r['benchmark']:<10} {r['setting']:<26} {r['baseline']:<26} {r['baseline_s']:>8.3f} {r['ours_s']:>8.3f} "
              f"{r['speedup']:>7.1f}x {r['target']:>6.1f}x {str(r['same_tokens']):>5}")
    result = {
        "rows": rows,
        "model": model.cfg.__dict__ | {"dtype": str(model.cfg.dtype), "param_dtype": str(model.cfg.param_dtype),
                                      "attention": dict(model.cfg.attention), "mlp": dict(model.cfg.mlp)},
        "quick": quick,
        "repeats": repeats,
        "device": str(jax.devices()[0]),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "jax": jax.__version__,
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    app.run(main)
