"""Benchmark: dense vs NSA vs squid attention, forward and forward+backward, time and memory.

    python -m experiments.bench_attention                  # CPU: T = 1k..16k -> runs/bench_attention/
    python -m experiments.bench_attention --publish        # the same into results/bench_attention.json and
                                                           #   docs/figures/bench_attention.png (the README's)
    python -m experiments.bench_attention --quick          # small lengths, seconds
    python -m experiments.bench_attention --lengths=65536 --impls=xla,triton,cudnn   # on a GPU

Per sequence length T (B, N, K, H from flags; defaults N=4, K=1, H=64):

  dense         causal attention, `jax.nn.dot_product_attention` (XLA; the baseline of every ratio)
  dense_cudnn   the same through cuDNN (GPU only, impl `cudnn`)
  flash         `kernels.flash.flash_attention`, causal (chunked XLA reference / Triton kernel)
  nsa           `kernels.nsa.nsa_attention`, docs/reference.md §7 defaults (l=32, d=16, l'=64, n=16,
                w=512), random compressed keys/values and gates (the op, not the compression MLP)
  squid         `kernels.squid.squid_attention` over T/doc_len documents of doc_len tokens

and, separately, the reuse case of squid attention:

  prefill_docs    `kernels.squid.global_attention`: a global segment of `--global_len` tokens
                  over `T / doc_len` cached documents (T document tokens)
  prefill_dense   causal attention over all T + global_len tokens (what prefilling without the
                  cache costs)

Each variant is compiled once (XLA's memory analysis gives its temporary bytes, the "memory"
column), warmed up, then all variants of one length are called round-robin for `--repeats`
rounds so that load from elsewhere on the machine falls on all alike; the median is reported and
every ratio is against `dense` (or `prefill_dense`) of the same length in the same run. Variants
whose dense score matrix would exceed `--max_dense_bytes` are skipped and marked so (XLA's dense
variants only: cuDNN's fused attention never forms the matrix); on a GPU every row also gets its
ratio against cuDNN's dense attention ("vs cudnn"). Calls shorter than 20 ms are repeated within
a round and averaged (bench_util.time_round_robin), so GPU timings are the device's, not the
host's dispatch overhead. Prints a
table, writes JSON and a log-log PNG of time and memory vs length. The Triton face runs compiled
on a CUDA GPU and in the Triton interpreter elsewhere (`kernels._triton.configure()`, called first).
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments.bench_util import time_round_robin, try_compile
from experiments.cli import PUBLISH_HELP, output_paths
from kernels import _triton, flash, nsa, squid

_LENGTHS = flags.DEFINE_list("lengths", ["1024", "2048", "4096", "8192", "16384"], "Sequence lengths T.")
_B = flags.DEFINE_integer("B", 1, "Batch size.")
_N = flags.DEFINE_integer("N", 4, "Query heads.")
_K = flags.DEFINE_integer("K", 1, "Key/value heads.")
_H = flags.DEFINE_integer("H", 64, "Head dim.")
_DOC_LEN = flags.DEFINE_integer("doc_len", 1024, "Document length of the squid variants.")
_GLOBAL_LEN = flags.DEFINE_integer("global_len", 256, "Global segment length of the prefill variants.")
_IMPLS = flags.DEFINE_list("impls", ["xla"], "Faces to time: xla, triton (GPU or interpreter), cudnn (GPU).")
_VARIANTS = flags.DEFINE_list(
    "variants", ["dense", "flash", "nsa", "squid", "prefill"], "Which of dense, flash, nsa, squid, prefill to run."
)
_MODES = flags.DEFINE_list("modes", ["fwd", "fwdbwd"], "fwd and/or fwdbwd (value and gradient of sum(o * do)).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Input dtype.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed rounds (median reported).")
_MAX_DENSE_BYTES = flags.DEFINE_float(
    "max_dense_bytes", 6e9,
    "Skip an XLA dense variant whose [B,N,T,T] float32 scores exceed this (x3 with backward); cuDNN's never forms them."
)
_QUICK = flags.DEFINE_bool("quick", False, "Lengths 512,1024 (unless --lengths is given), short documents, 2 rounds.")
_OUT = flags.DEFINE_string("out", None, "JSON path (default runs/bench_attention/bench_attention[_quick].json).")
_PNG = flags.DEFINE_string(
    "png", None, "PNG path (default: next to the JSON)."
)
_PUBLISH = flags.DEFINE_bool("publish", False, PUBLISH_HELP)


NSA_DEFAULTS = dict(block_len=32, stride=16, select_size=64, num_select=16, window=512)


def _inputs(key, B, T, N, K, H, dtype):
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, T, K, H), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, T, K, H), jnp.float32).astype(dtype)
    return q, k, v


def make_variant(name: str, impl: str, T: int, shape: dict, dtype) -> tuple[callable, tuple] | None:
    """(function of float arrays returning o, its arguments), or None when the variant does not apply."""
    B, N, K, H = shape["B"], shape["N"], shape["K"], shape["H"]
    key = jax.random.key(T)
    if name == "dense":
        if impl not in ("xla", "cudnn"):
            return None
        q, k, v = _inputs(key, B, T, N, K, H, dtype)
        fn = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=impl)
        return (lambda q, k, v: fn(q, k, v)), (q, k, v)
    if name == "flash":
        if impl == "cudnn":
            return None
        q, k, v = _inputs(key, B, T, N, K, H, dtype)
        return (lambda q, k, v: flash.flash_attention(q, k, v, causal=True, impl=impl)), (q, k, v)
    if name == "nsa":
        if impl == "cudnn":
            return None
        q, k, v = _inputs(key, B, T, N, K, H, dtype)
        Tc = nsa.num_compressed_blocks(T, NSA_DEFAULTS["block_len"], NSA_DEFAULTS["stride"])
        kc, kvc, kg = jax.random.split(jax.random.fold_in(key, 1), 3)
        k_cmp = jax.random.normal(kc, (B, Tc, K, H), jnp.float32).astype(dtype)
        v_cmp = jax.random.normal(kvc, (B, Tc, K, H), jnp.float32).astype(dtype)
        gates = jax.nn.sigmoid(jax.random.normal(kg, (B, T, N, 3), jnp.float32)).astype(dtype)
        return (
            lambda q, k, v, k_cmp, v_cmp, gates: nsa.nsa_attention(q, k, v, k_cmp, v_cmp, gates, **NSA_DEFAULTS, impl=impl)
        ), (q, k, v, k_cmp, v_cmp, gates)
    if name == "squid":
        if impl == "cudnn":
            return None
        q, k, v = _inputs(key, B, T, N, K, H, dtype)
        seg = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) // shape["doc_len"], (B, T))
        glob = jnp.zeros((B, T), bool)
        return (lambda q, k, v: squid.squid_attention(q, k, v, seg, glob, impl=impl)), (q, k, v)
    if name == "prefill_docs":
        if impl == "cudnn":
            return None
        G = shape["global_len"]
        q, k, v = _inputs(key, B, G, N, K, H, dtype)
        _, dk, dv = _inputs(jax.random.fold_in(key, 2), B, T, N, K, H, dtype)
        valid = jnp.ones((B, T), bool)
        return (lambda q, k, v, dk, dv: squid.global_attention(q, k, v, dk, dv, valid, impl=impl)), (q, k, v, dk, dv)
    if name == "prefill_dense":
        if impl not in ("xla", "cudnn"):
            return None
        q, k, v = _inputs(key, B, T + shape["global_len"], N, K, H, dtype)
        fn = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=impl)
        return (lambda q, k, v: fn(q, k, v)), (q, k, v)
    raise ValueError(f"unknown variant {name!r}")


def _dense_bytes(B, N, T, mode):
    return B * N * T * T * 4 * (1 if mode == "fwd" else 3)


def bench_length(T: int, shape: dict, impls, variants, modes, dtype, repeats, max_dense_bytes) -> list[dict]:
    rows, entries = [], []
    names = []
    for v in variants:
        names += ["prefill_docs", "prefill_dense"] if v == "prefill" else [v]
    for mode in modes:
        for name in names:
            for impl in impls:
                made = make_variant(name, impl, T, shape, dtype)
                if made is None:
                    continue
                row = dict(T=T, variant=name if impl == "xla" else f"{name}_{impl}", op=name, impl=impl, mode=mode)
                Tq = T + shape["global_len"] if name == "prefill_dense" else T
                if impl == "xla" and name in ("dense", "prefill_dense") and _dense_bytes(shape["B"], shape["N"], Tq, mode) > max_dense_bytes:
                    rows.append(dict(row, skipped="dense scores exceed --max_dense_bytes"))
                    continue
                fn, args = made
                row, compiled, _ = try_compile(row, fn, args, mode)  # + warm-up
                if compiled is None:
                    print(f"  {row['variant']} {mode}: failed: {row['failed']}", flush=True)
                    rows.append(row)
                    continue
                entries.append((row, compiled, args))
    time_round_robin(entries, repeats)
    rows += [row for row, _, _ in entries]
    # Ratios against the baseline of the same length and mode, from this run.
    for row in rows:
        if "median_s" not in row:
            continue
        base_name = "prefill_dense" if row["op"].startswith("prefill") else "dense"
        base = next((b for b in rows if b["variant"] == base_name and b["mode"] == row["mode"] and "median_s" in b), None)
        row["speedup_vs_dense"] = None if base is None else base["median_s"] / row["median_s"]
        # On a GPU, also against cuDNN's fused attention (the fastest dense alternative there).
        cudnn = next((b for b in rows if b["variant"] == f"{base_name}_cudnn" and b["mode"] == row["mode"] and "median_s" in b), None)
        if cudnn is not None:
            row["speedup_vs_cudnn"] = cudnn["median_s"] / row["median_s"]
        if base is not None and base.get("temp_bytes") and row.get("temp_bytes"):
            row["memory_ratio_vs_dense"] = base["temp_bytes"] / row["temp_bytes"]
    return rows


def print_table(rows):
    print(f"{'T':>6} {'mode':>6} {'variant':<20} {'median ms':>10} {'vs dense':>9} {'vs cudnn':>9} {'temp MiB':>10} {'compile s':>9}")
    for r in rows:
        if "skipped" in r or "failed" in r:
            what = "failed: " + r["failed"] if "failed" in r else "skipped: " + r["skipped"]
            print(f"{r['T']:>6} {r['mode']:>6} {r['variant']:<20} {what}")
            continue
        sp, cu = r.get("speedup_vs_dense"), r.get("speedup_vs_cudnn")
        mem = r.get("temp_bytes")
        print(
            f"{r['T']:>6} {r['mode']:>6} {r['variant']:<20} {r['median_s'] * 1e3:>10.3f} "
            f"{(f'{sp:.2f}x' if sp else '-'):>9} {(f'{cu:.2f}x' if cu else '-'):>9} "
            f"{(f'{mem / 2**20:.1f}' if mem is not None else '-'):>10} {r['compile_s']:>9.1f}"
        )


def plot(rows, path, backend=None):
    """Draw the figure of `rows` (the JSON's rows) into the PNG `path`; `backend` names the machine
    in the title (default: this process's JAX backend; pass the JSON's `backend` to redraw a logged run).

    Three panels: forward time, forward + backward time, and XLA's temporary memory (solid
    forward, dashed forward + backward). One colour per op (dense, flash, NSA, squid, the two
    prefill cases), one line style and marker per face (XLA, Triton, cuDNN), and one legend under
    the panels, so a run with every face stays readable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    ops = list(dict.fromkeys(r["op"] for r in rows if "median_s" in r))
    color = {op: f"C{i}" for i, op in enumerate(ops)}
    face = {"xla": ("-", "o"), "triton": ("--", "s"), "cudnn": (":", "^")}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    for r_op in ops:
        for impl, (style, marker) in face.items():
            for mode, ax in (("fwd", axes[0]), ("fwdbwd", axes[1])):
                pts = sorted((r["T"], r["median_s"], r.get("temp_bytes")) for r in rows
                             if r["op"] == r_op and r["impl"] == impl and r["mode"] == mode and "median_s" in r)
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], style, marker=marker, color=color[r_op])
                mem = [(p[0], p[2]) for p in pts if p[2]]
                if mem:
                    axes[2].plot([m[0] for m in mem], [m[1] / 2**20 for m in mem], "-" if mode == "fwd" else "--",
                                 marker=marker, color=color[r_op], alpha=0.8)
    titles = ("forward", "forward + backward", "XLA temporary memory (solid fwd, dashed fwd+bwd)")
    for ax, label, title in zip(axes, ("median time (ms)", "median time (ms)", "MiB"), titles):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T (prefill: document tokens)")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    impls = [i for i in face if any(r["impl"] == i and "median_s" in r for r in rows)]
    handles = [Line2D([], [], color=color[op], lw=2.5, label=op) for op in ops]
    handles += [Line2D([], [], color="0.3", linestyle=face[i][0], marker=face[i][1], label=f"face: {i}") for i in impls]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    failed = sorted({f"{r['variant']} {r['mode']} T={r['T']}" for r in rows if "failed" in r})
    note = f"not run (failed): {', '.join(failed)}" if failed else ""
    fig.suptitle(f"attention on {backend or jax.default_backend()}: dense vs flash vs NSA vs squid; "
                 "medians of round-robin rounds" + (f"\n{note}" if note else ""), fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv):
    del argv
    _triton.configure()  # the Triton face: compiled on a CUDA GPU, in the interpreter elsewhere
    quick = _QUICK.value
    lengths = [512, 1024] if quick and not flags.FLAGS["lengths"].present else [int(x) for x in _LENGTHS.value]
    repeats = 2 if quick and not flags.FLAGS["repeats"].present else _REPEATS.value
    shape = dict(B=_B.value, N=_N.value, K=_K.value, H=_H.value, doc_len=_DOC_LEN.value, global_len=_GLOBAL_LEN.value)
    if quick:
        shape.update(doc_len=128, global_len=64)
    for impl in _IMPLS.value:
        if impl not in ("xla", "triton", "cudnn"):
            raise app.UsageError(f"--impls: unknown face {impl!r}")
        if impl == "triton" and _triton.available() is not None:
            raise app.UsageError(f"--impls=triton: {_triton.available()}")
        if impl == "cudnn" and jax.default_backend() != "gpu":
            raise app.UsageError("--impls=cudnn needs a GPU")
    for T in lengths:
        if T % shape["doc_len"] and T > shape["doc_len"]:
            raise app.UsageError(f"length {T} is not a multiple of --doc_len={shape['doc_len']}")
    out, png = output_paths("bench_attention", quick, _OUT.value, _PNG.value, _PUBLISH.value)
    dtype = jnp.dtype(_DTYPE.value)
    rows = []
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    record = dict(
        backend=jax.default_backend(),
        device=str(jax.devices()[0].device_kind),
        jax=jax.__version__,
        shape=shape,
        dtype=_DTYPE.value,
        nsa=NSA_DEFAULTS,
        repeats=repeats,
        lengths=lengths,
        rows=rows,
    )
    for T in lengths:
        print(f"T={T}: compiling and timing ...", flush=True)
        doc_shape = dict(shape, doc_len=min(shape["doc_len"], T))
        new = bench_length(T, doc_shape, _IMPLS.value, _VARIANTS.value, _MODES.value, dtype, repeats, _MAX_DENSE_BYTES.value)
        print_table(new)
        rows += new
        # Written after every length: a run stopped at a long length keeps the shorter ones.
        record["completed_lengths"] = sorted({r["T"] for r in rows})
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, out)
    print("\nsummary")
    print_table(rows)
    plot(rows, png)
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    app.run(main)
