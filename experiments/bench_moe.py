"""Benchmark: MoE expert dispatch (dropless ragged vs one-hot einsum vs capacity scatter), MXFP8
grouped GEMM vs bf16, and MXFP8 quantiser throughput; time and memory, all ratios from one run.

    python -m experiments.bench_moe                  # CPU: E=64, k=2, N=8192, D=512, F=1024 -> runs/bench_moe/
    python -m experiments.bench_moe --publish        # the same into results/bench_moe.json, docs/figures/bench_moe.png
    python -m experiments.bench_moe --quick          # E=8, N=512, D=64, F=128, quantiser [512, 512]; seconds
    python -m experiments.bench_moe --impls=xla,triton   # on a GPU: also the Triton grouped GEMM and quantiser

Sections (sizes from flags; shape letters N tokens, D model, E experts, F expert ffw, C capacity):

1. dispatch: the routed expert computation of an MoE layer (`rlcode.models.moe`) on N tokens,
   SwiGLU experts W_gate, W_up [E, D, F], W_down [E, F, D] in --dtype. The routing (float32
   softmax router, top-k, renormalised gates) is computed once, outside the timed functions, with
   `moe.route`; every variant takes the same x, weights, expert indices [N, k] and gates [N, k]
   and returns y [N, D] = sum_k gate * Expert(x):

     onehot_einsum     the GShard baseline (written here; the baseline of every ratio): positions
                       by a cumsum over the one-hot assignments (token order, as the library
                       ranks), dispatch tensor [N, E, C] and combine tensor (gates) [N, E, C],
                       x_ecd = einsum("nec,nd->ecd"), batched expert matmuls,
                       y = einsum("nec,ecd->nd")
     dropless_ragged   `moe.routed_dropless`: stable sort by expert, grouped GEMMs
                       (`kernels.moe_gemm.grouped_matmul`, impl "xla": `jax.lax.ragged_dot`, on
                       CPU a loop over row tiles, see below), unsort, gate
     capacity_scatter  the library's capacity mode: `moe.assignment_slots`, scatter into
                       [E, C, D] (`moe.dispatch`), `moe.experts_batched`, `moe.combine`
     dropless_triton   `moe.routed_dropless` with impl "triton" (only with --impls=...,triton)

   C = ceil(k N / E * capacity_factor) (`moe.capacity`); the capacity variants drop assignments
   past C (reported: the fraction dropped, the largest expert load). The three variants must agree
   on every token none of whose assignments was dropped (max abs difference printed and checked),
   and the two capacity variants on every token.
   Modes: fwd (y) and fwdbwd (value and gradient of sum(y * cos(i)) w.r.t. x and the three expert
   weights; the routing is fixed).

2. precision: one grouped GEMM `kernels.moe_gemm.grouped_matmul(x_sorted [N k, D], W_gate
   [E, D, F], group_sizes)` with precision "bf16" (operands in --dtype, float32 accumulation; the
   baseline) and "mxfp8" (the XLA emulation: quantise + dequantise both operands, then the same
   GEMM; expected slower where there is no MX hardware), the groups from the same routing.

3. quantize: `kernels.mxfp8.quantize(x, axis=-1)` on a --quant_shape array of each
   --quant_dtypes, against `x * 2` (a jitted streaming read + write of the same array: the
   bandwidth baseline; `x * 1` would be simplified away). GB/s counts bytes read + written:
   input bytes + FP8 values (1 B each) + E8M0 scales (1 B per 32); the copy reads and writes the
   input bytes. `quantize_triton` with --impls=...,triton.

The Triton faces run on a CUDA GPU; elsewhere only in the Triton interpreter, which is far too
slow for these sizes, so they are timed only when --impls names triton (the choice is
`kernels._triton.configure()`, called first).

Timing (as experiments/bench_attention.py): each variant is compiled once (XLA's memory analysis
gives its temporary bytes, the "temp MiB" column; a variant above --max_temp_bytes is skipped and
marked), warmed up, then all variants of a section are called round-robin for --repeats rounds so
that load from elsewhere on the machine falls on all alike (calls under 20 ms are repeated within a
round and averaged, so GPU timings are the device's, not the host's dispatch overhead); a
variant that fails to compile or run is reported as failed and the others go on; the median is
reported and every ratio is against the section's baseline measured in the same run ("vs base" =
baseline median / variant median, > 1 is faster; the quantiser's note also gives the GB/s ratio,
which differs because the two move different byte counts). Prints a table, writes JSON and a PNG of bar charts
(dispatch time and memory, precision time, quantiser GB/s).

The dropless and precision rows measure whatever engine `kernels.moe_gemm`'s XLA face uses on
this backend; the JSON records it ("grouped_gemm_engine"). On XLA:CPU `jax.lax.ragged_dot` has no
native kernel: jax lowers it by expanding the ragged operand to a dense, masked [E, M, D] tensor
and contracting over the groups, E times the FLOPs of the grouped GEMM (measured through that
lowering at the default sizes: dropless fwd 8x slower than one-hot, fwdbwd planning ~28 GiB of
temporaries, skipped under the default --max_temp_bytes), so `moe_gemm` runs its XLA face on CPU
as a loop over row tiles (`moe_gemm.ragged_dot_is_dense`). On GPU/TPU ragged_dot lowers to a
grouped GEMM.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.bench_util import time_round_robin, try_compile
from experiments.cli import PUBLISH_HELP, output_paths
from kernels import _triton, moe_gemm, mxfp8
from rlcode.models import moe

_E = flags.DEFINE_integer("E", 64, "Experts.")
_TOPK = flags.DEFINE_integer("k", 2, "Experts per token (top-k).")
_N = flags.DEFINE_integer("N", 8192, "Tokens.")
_D = flags.DEFINE_integer("D", 512, "Model width.")
_F = flags.DEFINE_integer("F", 1024, "Expert ffw width.")
_CAPACITY_FACTOR = flags.DEFINE_float("capacity_factor", 1.25, "C = ceil(k N / E * capacity_factor), capped at N.")
_QUANT_SHAPE = flags.DEFINE_list("quant_shape", ["8192", "4096"], "Shape [R, C] of the quantiser input.")
_QUANT_DTYPES = flags.DEFINE_list("quant_dtypes", ["float32", "bfloat16"], "Quantiser input dtypes.")
_SECTIONS = flags.DEFINE_list("sections", ["dispatch", "precision", "quantize"], "Sections to run.")
_IMPLS = flags.DEFINE_list("impls", ["xla"], "Faces to time: xla, triton (GPU; on CPU the interpreter).")
_MODES = flags.DEFINE_list("modes", ["fwd", "fwdbwd"], "fwd and/or fwdbwd (dispatch and precision sections).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "dtype of x and the expert weights.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed rounds (median reported).")
_MAX_TEMP_BYTES = flags.DEFINE_float(
    "max_temp_bytes", 14e9, "Skip (and mark) a variant whose XLA temporary memory exceeds this many bytes."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the inputs.")
_QUICK = flags.DEFINE_bool(
    "quick", False, "E=8, N=512, D=64, F=128, quantiser [512, 512], 2 rounds (unless given explicitly)."
)
_OUT = flags.DEFINE_string("out", None, "JSON path (default runs/bench_moe/bench_moe[_quick].json).")
_PNG = flags.DEFINE_string("png", None, "PNG path (default: next to the JSON).")
_PUBLISH = flags.DEFINE_bool("publish", False, PUBLISH_HELP)

QUICK_SIZES = dict(E=8, N=512, D=64, F=128, quant_shape=["512", "512"])
DISPATCH_BASELINE, PRECISION_BASELINE, QUANT_BASELINE = "onehot_einsum", "bf16", "copy"
AGREE_TOL = {"float32": 1e-4, "bfloat16": 1e-2}  # max abs diff / max(1, max |y|)


# ---------------------------------------------------------------------------------------------
# Inputs and the one-hot baseline
# ---------------------------------------------------------------------------------------------


def make_inputs(shape: dict, dtype, seed: int):
    """x [N, D], expert weights (fan-in scaled) in dtype, and the float32 routing of x."""
    E, N, D, F = shape["E"], shape["N"], shape["D"], shape["F"]
    kx, kr, kg, ku, kd = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(kx, (N, D), jnp.float32).astype(dtype)
    router = jax.random.normal(kr, (D, E), jnp.float32) / math.sqrt(D)
    w_gate = (jax.random.normal(kg, (E, D, F), jnp.float32) / math.sqrt(D)).astype(dtype)
    w_up = (jax.random.normal(ku, (E, D, F), jnp.float32) / math.sqrt(D)).astype(dtype)
    w_down = (jax.random.normal(kd, (E, F, D), jnp.float32) / math.sqrt(F)).astype(dtype)
    r = jax.jit(lambda x, w: moe.route(x, w, None, shape["opts"]))(x, router)
    return x, (w_gate, w_up, w_down), r


def onehot_einsum(x_nd, w_gate, w_up, w_down, idx_nk, gate_nk, *, num_experts: int, cap: int):
    """GShard dispatch (Lepikhin et al. 2020): [N, E, C] one-hot dispatch and combine tensors.

    An assignment's slot is its rank among its expert's assignments in token-major order (a
    cumsum over the flattened one-hot [N k, E]); slots >= C are dropped (one_hot gives a zero row).
    """
    N, k = idx_nk.shape
    E, C, dt = num_experts, cap, x_nd.dtype
    oh_e = jax.nn.one_hot(idx_nk, E, dtype=jnp.int32)  # [N, k, E]
    pos_nk = jnp.sum((jnp.cumsum(oh_e.reshape(N * k, E), axis=0) - 1).reshape(N, k, E) * oh_e, axis=-1)
    oh_c = jax.nn.one_hot(pos_nk, C, dtype=jnp.float32)  # [N, k, C]; zero where pos >= C
    oh_ef = oh_e.astype(jnp.float32)
    dispatch_nec = jnp.einsum("nke,nkc->nec", oh_ef, oh_c).astype(dt)  # one token, one slot per expert: 0/1
    combine_nec = jnp.einsum("nk,nke,nkc->nec", gate_nk, oh_ef, oh_c)
    x_ecd = jnp.einsum("nec,nd->ecd", dispatch_nec, x_nd)
    mm = lambda a, b: jnp.einsum("ecd,edf->ecf", a, b, preferred_element_type=jnp.float32).astype(dt)
    out_ecd = mm(jax.nn.silu(mm(x_ecd, w_gate)) * mm(x_ecd, w_up), w_down)
    return jnp.einsum("nec,ecd->nd", combine_nec, out_ecd.astype(jnp.float32))


def capacity_drops(idx_nk: np.ndarray, num_experts: int, cap: int):
    """(kept [N, k] bool, expert loads [E]) of the token-order capacity rule, in numpy (an oracle
    independent of both the library and the one-hot cumsum)."""
    N, k = idx_nk.shape
    seen = np.zeros(num_experts, np.int64)
    kept = np.zeros(N * k, bool)
    for j, e in enumerate(idx_nk.reshape(-1)):
        kept[j] = seen[e] < cap
        seen[e] += 1
    return kept.reshape(N, k), seen


# ---------------------------------------------------------------------------------------------
# Variants: (function, its arguments, the argument numbers differentiated in fwdbwd)
# ---------------------------------------------------------------------------------------------


def make_dispatch_variant(name: str, impl: str, shape: dict, inputs):
    x, (wg, wu, wd), r = inputs
    E, k, C, opts = shape["E"], shape["k"], shape["C"], shape["opts"]
    args = (x, wg, wu, wd, r.idx, r.gate)
    if name == "onehot_einsum":
        if impl != "xla":
            return None
        fn = lambda x, wg, wu, wd, idx, gate: onehot_einsum(x, wg, wu, wd, idx, gate, num_experts=E, cap=C)
    elif name == "dropless_ragged":
        lib_opts = dataclasses.replace(opts, impl=impl)

        def fn(x, wg, wu, wd, idx, gate):
            return moe.routed_dropless(x, moe.Routing(idx, gate, None, None), moe.ExpertWeights(wg, wu, wd), lib_opts)
    elif name == "capacity_scatter":
        if impl != "xla":
            return None

        def fn(x, wg, wu, wd, idx, gate):
            dest, _ = moe.assignment_slots(idx, E, C)
            out = moe.experts_batched(moe.dispatch(x, dest, k, E, C), moe.ExpertWeights(wg, wu, wd), opts)
            return moe.combine(out, dest, gate)
    else:
        raise ValueError(f"unknown dispatch variant {name!r}")
    return fn, args, (0, 1, 2, 3)


def make_precision_variant(precision: str, impl: str, shape: dict, inputs):
    x, (wg, _, _), r = inputs
    N, k, E = shape["N"], shape["k"], shape["E"]
    flat_e = r.idx.reshape(N * k)
    order = jnp.argsort(flat_e, stable=True)
    x_sorted = x[order // k]
    group_sizes = jnp.zeros((E,), jnp.int32).at[flat_e].add(1)
    fn = lambda x, w, gs: moe_gemm.grouped_matmul(x, w, gs, precision=precision, impl=impl)
    return fn, (x_sorted, wg, group_sizes), (0, 1)


def make_quant_variant(name: str, impl: str, x):
    """(function, args, bytes read + written) of the quantiser section."""
    n = x.size
    if name == QUANT_BASELINE:
        if impl != "xla":
            return None
        return (lambda x: x * 2), (x,), 2 * n * x.dtype.itemsize
    if name == "quantize":
        fn = (lambda x: mxfp8.quantize(x, axis=-1)) if impl == "xla" else (lambda x: mxfp8.quantize_triton(x))
        return fn, (x,), n * x.dtype.itemsize + n + n // mxfp8.BLOCK
    raise ValueError(f"unknown quantiser variant {name!r}")


def grouped_gemm_engine() -> str:
    """What the XLA face of `kernels.moe_gemm.grouped_matmul` runs on this backend."""
    if moe_gemm.ragged_dot_is_dense():
        return "row-tile loop (ragged_dot is dense here)"
    return "jax.lax.ragged_dot"


# ---------------------------------------------------------------------------------------------
# Compiling and timing
# ---------------------------------------------------------------------------------------------


def run_section(specs, repeats, max_temp_bytes):
    """specs: (row, fn, args, mode, argnums). Compile, warm up, time round-robin; rows + fwd outputs."""
    rows, entries, outputs = [], [], {}
    for row, fn, args, mode, argnums in specs:
        row, compiled, out = try_compile(row, fn, args, mode, argnums, max_temp_bytes)  # + warm-up
        rows.append(row)
        if compiled is None:
            print(f"  {row['variant']} {mode}: {row.get('failed') or row['skipped']}", flush=True)
            continue
        if mode == "fwd":
            outputs[row["variant"]] = out
        else:
            del out
        entries.append((row, compiled, args))
    time_round_robin(entries, repeats)
    return rows, outputs


def add_ratios(rows, baseline, key=("section", "mode", "dtype")):
    """speedup_vs_baseline = baseline median / median, baseline of the same section/mode/dtype."""
    for row in rows:
        if "median_s" not in row:
            continue
        base = next(
            (b for b in rows if b["variant"] == baseline and "median_s" in b and all(b.get(c) == row.get(c) for c in key)),
            None,
        )
        row["baseline"] = baseline
        row["speedup_vs_baseline"] = None if base is None else base["median_s"] / row["median_s"]
        if base is not None and base.get("temp_bytes") and row.get("temp_bytes"):
            row["memory_ratio_vs_baseline"] = base["temp_bytes"] / row["temp_bytes"]
        if "gb_s" in row and base is not None:
            row["bandwidth_ratio_vs_copy"] = row["gb_s"] / base["gb_s"]


def agreement(outputs, kept_n: np.ndarray, dtype: str) -> dict:
    """Max abs differences of the fwd outputs: on tokens with no dropped assignment, and all tokens
    between the two capacity variants (same slots, same drops)."""
    base = np.asarray(outputs[DISPATCH_BASELINE], np.float64)
    scale = max(1.0, float(np.max(np.abs(base))))
    tol = AGREE_TOL[dtype] * scale
    checks = {"tolerance": tol, "max_abs_y": float(np.max(np.abs(base))), "pairs": []}
    for name, out in outputs.items():
        if name == DISPATCH_BASELINE:
            continue
        diff = np.abs(np.asarray(out, np.float64) - base)
        pair = dict(a=name, b=DISPATCH_BASELINE, tokens="not dropped", max_abs_diff=float(np.max(diff[kept_n], initial=0.0)))
        checks["pairs"].append(pair)
        if name.startswith("capacity"):
            checks["pairs"].append(dict(a=name, b=DISPATCH_BASELINE, tokens="all", max_abs_diff=float(np.max(diff))))
    checks["passed"] = all(p["max_abs_diff"] <= tol for p in checks["pairs"])
    return checks


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


def bench_dispatch(shape, inputs, impls, modes, repeats, max_temp_bytes):
    specs = []
    for mode in modes:
        for name in (DISPATCH_BASELINE, "dropless_ragged", "capacity_scatter"):
            for impl in impls:
                made = make_dispatch_variant(name, impl, shape, inputs)
                if made is None:
                    continue
                variant = name if impl == "xla" else name.replace("_ragged", "") + f"_{impl}"
                row = dict(section="dispatch", mode=mode, variant=variant, impl=impl, dtype=shape["dtype"])
                specs.append((row, *made[:2], mode, made[2]))
    rows, outputs = run_section(specs, repeats, max_temp_bytes)
    add_ratios(rows, DISPATCH_BASELINE)
    return rows, outputs


def bench_precision(shape, inputs, impls, modes, repeats, max_temp_bytes):
    specs = []
    for mode in modes:
        for precision in moe_gemm.PRECISIONS:
            for impl in impls:
                fn, args, argnums = make_precision_variant(precision, impl, shape, inputs)
                variant = precision if impl == "xla" else f"{precision}_{impl}"
                row = dict(section="precision", mode=mode, variant=variant, impl=impl, dtype=shape["dtype"])
                specs.append((row, fn, args, mode, argnums))
    rows, _ = run_section(specs, repeats, max_temp_bytes)
    add_ratios(rows, PRECISION_BASELINE)
    return rows


def bench_quantize(quant_shape, dtypes, impls, repeats, max_temp_bytes, seed):
    specs = []
    for dt in dtypes:
        x = jax.random.normal(jax.random.key(seed + 1), quant_shape, jnp.float32).astype(dt)
        for name in (QUANT_BASELINE, "quantize"):
            for impl in impls:
                made = make_quant_variant(name, impl, x)
                if made is None:
                    continue
                fn, args, b = made
                variant = name if impl == "xla" else f"{name}_{impl}"
                row = dict(section="quantize", mode="fwd", variant=variant, impl=impl, dtype=dt, shape=list(quant_shape), bytes=b)
                specs.append((row, fn, args, "fwd", ()))
    rows, _ = run_section(specs, repeats, max_temp_bytes)
    for row in rows:
        if "median_s" in row:
            row["gb_s"] = row["bytes"] / row["median_s"] / 1e9
    add_ratios(rows, QUANT_BASELINE)
    return rows


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def print_table(rows):
    print(f"{'section':<10} {'mode':>6} {'dtype':>8} {'variant':<18} {'median ms':>10} {'vs base':>8} "
          f"{'temp MiB':>9} {'compile s':>9}  note")
    for r in rows:
        head = f"{r['section']:<10} {r['mode']:>6} {r['dtype']:>8} {r['variant']:<18}"
        if "skipped" in r or "failed" in r:
            print(f"{head} {'failed: ' + r['failed'] if 'failed' in r else 'skipped: ' + r['skipped']}")
            continue
        sp, mem = r.get("speedup_vs_baseline"), r.get("temp_bytes")
        note = f"{r['gb_s']:.2f} GB/s ({r['bandwidth_ratio_vs_copy']:.2f}x copy)" if "gb_s" in r else ""
        if r.get("variant") == r.get("baseline"):
            note = (note + " " if note else "") + "(baseline)"
        print(f"{head} {r['median_s'] * 1e3:>10.3f} {(f'{sp:.2f}x' if sp else '-'):>8} "
              f"{(f'{mem / 2**20:.1f}' if mem is not None else '-'):>9} {r['compile_s']:>9.1f}  {note}")


def print_summary(rows, record):
    print("\nsummary")
    print_table(rows)
    disp = record.get("dispatch")
    if disp:
        print(f"\ngrouped GEMM (xla face): {record['grouped_gemm_engine']}")
        print(f"dispatch: E={disp['E']} k={disp['k']} N={disp['N']} D={disp['D']} F={disp['F']} {disp['dtype']}; "
              f"capacity C={disp['capacity']} (factor {disp['capacity_factor']}), dropped "
              f"{disp['dropped_frac']:.4%} of assignments ({disp['tokens_with_drop']} tokens), "
              f"largest expert load {disp['max_load']} (mean {disp['mean_load']:.0f})")
        chk = record["agreement"]
        for p in chk["pairs"]:
            print(f"  max |{p['a']} - {p['b']}| on {p['tokens']} tokens: {p['max_abs_diff']:.3e}")
        print(f"  agreement (tolerance {chk['tolerance']:.1e}): {'passed' if chk['passed'] else 'FAILED'}")
    for r in rows:
        if r["section"] != "quantize" and r.get("speedup_vs_baseline") and r["variant"] != r["baseline"]:
            print(f"{r['section']} {r['mode']}: {r['variant']} is {r['speedup_vs_baseline']:.2f}x the speed of {r['baseline']}")
    for r in rows:
        if r["section"] == "quantize" and r["variant"] != QUANT_BASELINE and "gb_s" in r:
            print(f"quantize {r['dtype']} {r['variant']}: {r['gb_s']:.2f} GB/s, {r['bandwidth_ratio_vs_copy']:.2f}x copy")


def plot(rows, path, backend=None):
    """Draw the figure of `rows` (the JSON's rows) into the PNG `path`; `backend` names the machine
    in the title (default: this process's JAX backend; pass the JSON's `backend` to redraw a logged run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    timed = [r for r in rows if "median_s" in r]
    color = {v: f"C{i}" for i, v in enumerate(dict.fromkeys(r["variant"] for r in rows))}

    def bars(ax, section, value, ylabel, pool=timed):
        sel = [r for r in pool if r["section"] == section]
        if not sel:
            ax.set_axis_off()
            ax.set_title(f"{section}: not run")
            return
        groups = list(dict.fromkeys((r["mode"], r["dtype"]) if section == "quantize" else r["mode"] for r in sel))
        variants = list(dict.fromkeys(r["variant"] for r in sel))
        width = 0.8 / max(1, len(variants))
        labelled = set()
        for i, v in enumerate(variants):
            for g, grp in enumerate(groups):
                r = next((r for r in sel if r["variant"] == v and
                          ((r["mode"], r["dtype"]) if section == "quantize" else r["mode"]) == grp), None)
                if r is not None and value(r) is not None:
                    # Skipped variants (memory only) are hatched: planned by XLA, never run.
                    bar = ax.bar(g + (i - (len(variants) - 1) / 2) * width, value(r), width, color=color[v],
                                 hatch="//" if "skipped" in r else None, label=v if v not in labelled else None)
                    v_ = value(r)
                    ax.bar_label(bar, labels=[f"{v_:,.0f}" if v_ >= 100 else f"{v_:.3g}"], fontsize=6, rotation=90,
                                 padding=2)
                    labelled.add(v)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([g[1] if isinstance(g, tuple) else g for g in groups])
        ax.set_ylabel(ylabel)
        ax.set_xlabel("quantiser input dtype" if section == "quantize" else "pass")
        ax.margins(y=0.18)  # room for the value labels
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title(section)

    # Linear axes (bar heights are the values) with each bar's value written on it.
    bars(axes[0], "dispatch", lambda r: r["median_s"] * 1e3, "median time (ms)")
    bars(axes[1], "dispatch", lambda r: None if r.get("temp_bytes") is None else r["temp_bytes"] / 2**20,
         "XLA temporary memory (MiB)", pool=rows)
    skipped = any("skipped" in r for r in rows if r["section"] == "dispatch")
    axes[1].set_title("dispatch memory" + (" (hatched: skipped, too large to run)" if skipped else ""))
    bars(axes[2], "precision", lambda r: r["median_s"] * 1e3, "median time (ms)")
    axes[2].set_title("grouped GEMM precision")
    bars(axes[3], "quantize", lambda r: r["gb_s"], "GB/s (read + written)")
    axes[3].set_title("MXFP8 quantiser vs x * 2")
    fig.suptitle(f"MoE on {backend or jax.default_backend()}: dispatch, grouped-GEMM precision, quantiser")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv):
    del argv
    _triton.configure()  # the Triton faces: compiled on a CUDA GPU, in the interpreter elsewhere
    quick = _QUICK.value
    given = lambda name: flags.FLAGS[name].present
    sizes = dict(E=_E.value, N=_N.value, D=_D.value, F=_F.value, quant_shape=_QUANT_SHAPE.value)
    if quick:
        sizes.update({n: v for n, v in QUICK_SIZES.items() if not given(n)})
    repeats = 2 if quick and not given("repeats") else _REPEATS.value
    for impl in _IMPLS.value:
        if impl not in ("xla", "triton"):
            raise app.UsageError(f"--impls: unknown face {impl!r}")
        if impl == "triton":
            if _triton.available() is not None:
                raise app.UsageError(f"--impls=triton: {_triton.available()}")
            if _triton.interpreting():
                print("warning: no GPU: the Triton faces run in the interpreter (slow; small sizes only)", flush=True)
    for s in _SECTIONS.value:
        if s not in ("dispatch", "precision", "quantize"):
            raise app.UsageError(f"--sections: unknown section {s!r}")
    for m in _MODES.value:
        if m not in ("fwd", "fwdbwd"):
            raise app.UsageError(f"--modes: unknown mode {m!r}")
    quant_shape = tuple(int(v) for v in sizes["quant_shape"])
    if len(quant_shape) != 2 or quant_shape[1] % mxfp8.BLOCK:
        raise app.UsageError(f"--quant_shape must be R,C with C a multiple of {mxfp8.BLOCK}, got {quant_shape}")
    out, png = output_paths("bench_moe", quick, _OUT.value, _PNG.value, _PUBLISH.value)

    E, k, N, D, F = sizes["E"], _TOPK.value, sizes["N"], sizes["D"], sizes["F"]
    opts = moe.MoEOptions.from_config(moe.moe_config(
        num_experts=E, top_k=k, expert_ffw_dim=F, capacity_factor=_CAPACITY_FACTOR.value,
        dispatch="dropless", precision="bf16", impl="xla"))
    C = moe.capacity(N, opts)
    shape = dict(E=E, k=k, N=N, D=D, F=F, C=C, dtype=_DTYPE.value, opts=opts)
    dtype = jnp.dtype(_DTYPE.value)
    record = dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                  grouped_gemm_engine=grouped_gemm_engine(), dtype=_DTYPE.value, repeats=repeats,
                  impls=_IMPLS.value, modes=_MODES.value)
    rows = []
    sections = _SECTIONS.value
    if "dispatch" in sections or "precision" in sections:
        inputs = make_inputs(shape, dtype, _SEED.value)
        kept_nk, loads = capacity_drops(np.asarray(inputs[2].idx), E, C)
        record["dispatch"] = dict(
            E=E, k=k, N=N, D=D, F=F, dtype=_DTYPE.value, capacity=C, capacity_factor=_CAPACITY_FACTOR.value,
            dropped_frac=float(1 - kept_nk.mean()), tokens_with_drop=int((~kept_nk.all(1)).sum()),
            max_load=int(loads.max()), mean_load=float(loads.mean()), no_drop_capacity=int(loads.max()),
        )
    if "dispatch" in sections:
        print(f"dispatch: E={E} k={k} N={N} D={D} F={F} C={C}; grouped GEMM (xla face): {grouped_gemm_engine()}; "
              "compiling and timing ...", flush=True)
        new, outputs = bench_dispatch(shape, inputs, _IMPLS.value, _MODES.value, repeats, _MAX_TEMP_BYTES.value)
        print_table(new)
        rows += new
        if DISPATCH_BASELINE in outputs:
            record["agreement"] = agreement(outputs, kept_nk.all(1), _DTYPE.value)
        del outputs
    if "precision" in sections:
        print(f"precision: grouped GEMM [{N * k}, {D}] x [{E}, {D}, {F}]: compiling and timing ...", flush=True)
        new = bench_precision(shape, inputs, _IMPLS.value, _MODES.value, repeats, _MAX_TEMP_BYTES.value)
        print_table(new)
        rows += new
    if "quantize" in sections:
        print(f"quantize: {list(quant_shape)} {_QUANT_DTYPES.value}: compiling and timing ...", flush=True)
        new = bench_quantize(quant_shape, _QUANT_DTYPES.value, _IMPLS.value, repeats, _MAX_TEMP_BYTES.value, _SEED.value)
        print_table(new)
        rows += new
    print_summary(rows, record)
    record["rows"] = rows
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    plot(rows, png)
    print(f"wrote {out} and {png}")
    if "agreement" in record and not record["agreement"]["passed"]:
        raise SystemExit("dispatch variants disagree beyond the tolerance (see above)")


if __name__ == "__main__":
    app.run(main)
