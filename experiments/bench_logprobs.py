"""Benchmark: chunked vs naive token log-probs + entropy, forward and backward, time and memory.

    python -m experiments.bench_logprobs                 # V=32768, T=2048, B=8, D=512
    python -m experiments.bench_logprobs --quick         # small shapes, seconds
    python -m experiments.bench_logprobs --chunk_sizes=512,1024,2048,4096

Measures value_and_grad of mean(logp) + 0.01 * mean(entropy) with respect to hidden and unembed,
for `rlcode.models.logprobs.naive_token_logprobs` (materialised [B, T, V] logits, JAX autodiff)
and `token_logprobs` at each chunk size. Each variant runs in its own subprocess so that its
peak resident memory can be read cleanly: peak RSS delta = ru_maxrss at the end minus the RSS
after the inputs exist, before compiling. Time: each variant is compiled and warmed up
(`--warmup` calls), then the variants are called round-robin, one call each per round, for
`--repeats` rounds (so that load from other processes on the machine falls on all variants
alike); each call is waited on with block_until_ready and the median (and min) is reported.
Memory is also read from XLA's compiled memory analysis (temp + argument + output bytes). Prints
a table and writes JSON with memory_ratio = naive / chunked (XLA total bytes; also for RSS) and
time_ratio = chunked / naive, all from the same run.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.cli import PUBLISH_HELP, output_paths

from rlcode.models import logprobs as lp_lib

_V = flags.DEFINE_integer("V", 32768, "Vocabulary size.")
_T = flags.DEFINE_integer("T", 2048, "Sequence length.")
_B = flags.DEFINE_integer("B", 8, "Batch size.")
_D = flags.DEFINE_integer("D", 512, "Model width.")
_CHUNK_SIZES = flags.DEFINE_list("chunk_sizes", ["1024"], "Chunk sizes of the chunked variant to run.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "dtype of hidden and unembed.")
_LAYOUT = flags.DEFINE_enum("layout", "dv", ["dv", "vd"], "Unembedding layout.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
_TOP_K = flags.DEFINE_integer("top_k", None, "top-k of the sampler (default off).")
_TOP_P = flags.DEFINE_float("top_p", None, "top-p of the sampler (default off).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per variant (median reported).")
_WARMUP = flags.DEFINE_integer("warmup", 1, "Untimed calls per variant before timing.")
_QUICK = flags.DEFINE_bool("quick", False, "Small shapes (V=4096, T=1024, B=4, D=128) for a fast check.")
_OUT = flags.DEFINE_string(
    "out", None, "JSON output path (default runs/bench_logprobs/bench_logprobs[_quick].json).")
_PUBLISH = flags.DEFINE_bool("publish", False, PUBLISH_HELP)
_WORKER = flags.DEFINE_string("worker", None, "Internal: run one variant ('naive' or 'chunked:C'), print JSON.")

ENTROPY_COEF = 0.01
QUICK_SHAPE = dict(V=4096, T=1024, B=4, D=128)
MIB = 2**20


def _shape() -> dict[str, int]:
    if _QUICK.value:
        return dict(QUICK_SHAPE)
    return dict(V=_V.value, T=_T.value, B=_B.value, D=_D.value)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def run_worker(variant: str) -> None:
    """Serve one variant over stdin/stdout: compile and warm up, then time one call per request.

    Protocol (one JSON object per stdout line): after warm-up, {"ready": ...memory analysis};
    then for each stdin line "time", {"t": seconds of one call}; on "done", the final record
    with peak RSS delta, objective value and gradient norms.
    """
    shape = _shape()
    B, T, D, V = shape["B"], shape["T"], shape["D"], shape["V"]
    dtype = jnp.dtype(_DTYPE.value)
    kh, kw, kt = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(kh, (B, T, D), jnp.float32).astype(dtype)
    unembed = (jax.random.normal(kw, (D, V), jnp.float32) * (2.0 / np.sqrt(D))).astype(dtype)
    if _LAYOUT.value == "vd":
        unembed = unembed.T.copy()
    tokens = jax.random.randint(kt, (B, T), 0, V)
    jax.block_until_ready((hidden, unembed, tokens))

    options = dict(
        temperature=_TEMPERATURE.value,
        top_k=_TOP_K.value,
        top_p=_TOP_P.value,
        return_entropy=True,
        unembed_layout=_LAYOUT.value,
    )
    if variant == "naive":
        fn, chunk = lp_lib.naive_token_logprobs, None
    else:
        chunk = int(variant.split(":")[1])
        fn = functools.partial(lp_lib.token_logprobs, chunk_size=chunk)

    def objective(h, w, tok):
        logp, ent = fn(h, w, tok, **options)
        # Sampled tokens lie in the support; random tokens may not, and -inf would poison the mean.
        logp = jnp.where(jnp.isfinite(logp), logp, 0.0)
        return jnp.mean(logp) + ENTROPY_COEF * jnp.mean(ent)

    rss_before = _rss_bytes()
    t0 = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(objective, argnums=(0, 1))).lower(hidden, unembed, tokens).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    for _ in range(_WARMUP.value):
        value, (dh, dw) = jax.block_until_ready(compiled(hidden, unembed, tokens))
    record = dict(
        variant="naive" if chunk is None else "chunked",
        chunk_size=chunk,
        compile_s=compile_s,
        xla_temp_bytes=mem.temp_size_in_bytes,
        xla_argument_bytes=mem.argument_size_in_bytes,
        xla_output_bytes=mem.output_size_in_bytes,
        xla_alias_bytes=mem.alias_size_in_bytes,
        xla_total_bytes=mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes,
    )
    print(json.dumps(dict(ready=record)), flush=True)
    for line in sys.stdin:
        if line.strip() != "time":
            break
        t0 = time.perf_counter()
        value, (dh, dw) = jax.block_until_ready(compiled(hidden, unembed, tokens))
        print(json.dumps(dict(t=time.perf_counter() - t0)), flush=True)
    record.update(
        rss_delta_bytes=_peak_rss_bytes() - rss_before,
        value=float(value),
        grad_hidden_norm=float(jnp.linalg.norm(dh.astype(jnp.float32))),
        grad_unembed_norm=float(jnp.linalg.norm(dw.astype(jnp.float32))),
    )
    print(json.dumps(dict(done=record)), flush=True)


class _Worker:
    """One variant in its own process (so its peak RSS is its own), driven line by line."""

    def __init__(self, variant: str):
        argv = [a for a in sys.argv[1:] if not a.startswith(("--worker", "--out"))]
        cmd = [sys.executable, "-m", "experiments.bench_logprobs", f"--worker={variant}", *argv]
        self.variant = variant
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True
        )

    def _read(self, key: str):
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)[key]
        code = self.proc.wait()
        self.stderr.seek(0)
        raise RuntimeError(f"worker {self.variant} exited ({code}) before {key!r}:\n{self.stderr.read()[-4000:]}")

    def ready(self) -> dict:
        return self._read("ready")

    def time_one(self) -> float:
        self.proc.stdin.write("time\n")
        self.proc.stdin.flush()
        return self._read("t")

    def finish(self) -> dict:
        self.proc.stdin.write("done\n")
        self.proc.stdin.flush()
        record = self._read("done")
        self.proc.wait()
        return record


def run_variants(variants: list[str], repeats: int) -> list[dict]:
    """Time the variants round-robin (one call each per round) so that load from other processes
    on the machine falls on all of them alike; return one record per variant."""
    workers = []
    for v in variants:  # compile and warm up one at a time, so warm-ups do not overlap
        workers.append(_Worker(v))
        workers[-1].ready()
        print(f"{v}: compiled and warmed up", flush=True)
    times = {w.variant: [] for w in workers}
    for r in range(repeats):
        for w in workers:
            times[w.variant].append(w.time_one())
        print(f"round {r + 1}/{repeats}: " + ", ".join(f"{k} {t[-1]:.3f}s" for k, t in times.items()), flush=True)
    rows = []
    for w in workers:
        record = w.finish()
        ts = times[w.variant]
        record.update(median_s=statistics.median(ts), min_s=min(ts), times_s=ts)
        rows.append(record)
    return rows


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _ratios(naive: dict, chunked: dict) -> dict:
    return dict(
        chunk_size=chunked["chunk_size"],
        memory_ratio=naive["xla_total_bytes"] / chunked["xla_total_bytes"],
        temp_memory_ratio=naive["xla_temp_bytes"] / max(chunked["xla_temp_bytes"], 1),
        rss_memory_ratio=naive["rss_delta_bytes"] / max(chunked["rss_delta_bytes"], 1),
        time_ratio=chunked["median_s"] / naive["median_s"],
        time_ratio_of_min=chunked["min_s"] / naive["min_s"],
        value_rel_diff=_rel(chunked["value"], naive["value"]),
        grad_hidden_norm_rel_diff=_rel(chunked["grad_hidden_norm"], naive["grad_hidden_norm"]),
        grad_unembed_norm_rel_diff=_rel(chunked["grad_unembed_norm"], naive["grad_unembed_norm"]),
    )


def _print_table(rows: list[dict], ratios: dict[int, dict]) -> None:
    header = ("variant", "chunk", "median_s", "min_s", "xla_temp_MiB", "xla_total_MiB", "rss_delta_MiB",
              "time_ratio", "mem_ratio", "rss_ratio")
    print(" ".join(f"{h:>13}" for h in header))
    for r in rows:
        q = ratios.get(r["chunk_size"], {})
        cells = (
            r["variant"],
            "-" if r["chunk_size"] is None else str(r["chunk_size"]),
            f"{r['median_s']:.3f}",
            f"{r['min_s']:.3f}",
            f"{r['xla_temp_bytes'] / MIB:.1f}",
            f"{r['xla_total_bytes'] / MIB:.1f}",
            f"{r['rss_delta_bytes'] / MIB:.1f}",
            f"{q['time_ratio']:.3f}" if q else "1.000",
            f"{q['memory_ratio']:.2f}" if q else "1.00",
            f"{q['rss_memory_ratio']:.2f}" if q else "1.00",
        )
        print(" ".join(f"{c:>13}" for c in cells))


def main(argv):
    del argv
    if _WORKER.value:
        run_worker(_WORKER.value)
        return
    out, _ = output_paths("bench_logprobs", _QUICK.value, _OUT.value, None, _PUBLISH.value)  # no figure
    shape = _shape()
    chunk_sizes = [int(c) for c in _CHUNK_SIZES.value]
    config = dict(
        **shape,
        chunk_sizes=chunk_sizes,
        dtype=_DTYPE.value,
        layout=_LAYOUT.value,
        temperature=_TEMPERATURE.value,
        top_k=_TOP_K.value,
        top_p=_TOP_P.value,
        entropy_coef=ENTROPY_COEF,
        repeats=_REPEATS.value,
        warmup=_WARMUP.value,
        logits_bytes=shape["B"] * shape["T"] * shape["V"] * 4,
    )
    print(f"config: {json.dumps(config)}", flush=True)
    # Other processes on the machine slow every variant; the load average is kept with the result.
    load_start = os.getloadavg()
    rows = run_variants(["naive"] + [f"chunked:{c}" for c in chunk_sizes], _REPEATS.value)
    ratios = {r["chunk_size"]: _ratios(rows[0], r) for r in rows[1:]}
    _print_table(rows, ratios)
    best = min(ratios.values(), key=lambda q: q["time_ratio"])
    summary = dict(
        best_chunk_size=best["chunk_size"],
        memory_ratio=best["memory_ratio"],
        rss_memory_ratio=best["rss_memory_ratio"],
        time_ratio=best["time_ratio"],
        targets=dict(memory_ratio=">= 4", time_ratio="<= 1.3"),
        memory_target_met=best["memory_ratio"] >= 4,
        time_target_met=best["time_ratio"] <= 1.3,
    )
    machine = dict(
        jax=jax.__version__,
        backend=jax.default_backend(),
        device=str(jax.devices()[0].device_kind),
        cpu_count=os.cpu_count(),
        loadavg_1m_start=load_start[0],
        loadavg_1m_end=os.getloadavg()[0],
    )
    result = dict(config=config, machine=machine, results=rows, ratios=list(ratios.values()), summary=summary)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"summary: {json.dumps(summary)}")
    print(f"wrote {out}")


if __name__ == "__main__":
    app.run(main)
