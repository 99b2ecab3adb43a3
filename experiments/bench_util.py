"""Compiling and timing shared by the benchmark scripts (docs/architecture.md, convention 6)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp


def compile_variant(fn, args, mode: str, argnums=None):
    """AOT-compile `fn(*args)` ("fwd") or the value and gradient of a fixed scalar of its output
    ("fwdbwd", w.r.t. `argnums`, default every floating argument). Returns (compiled, compile
    seconds, XLA temporary bytes or None)."""
    if mode == "fwd":
        jitted = jax.jit(fn)
    else:
        def loss(*a):
            y = fn(*a)
            return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape)))

        if argnums is None:
            argnums = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
        jitted = jax.jit(jax.value_and_grad(loss, argnums=argnums))
    t0 = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    return compiled, compile_s, None if mem is None else int(mem.temp_size_in_bytes)


def try_compile(row: dict, fn, args, mode: str, argnums=None, max_temp_bytes=None):
    """compile_variant + one warm-up call, with a failure recorded instead of raised.

    Returns (row with compile_s and temp_bytes, compiled, warm-up output); (row with `skipped`,
    None, None) when XLA plans more than `max_temp_bytes` of temporaries (not run); or (row with
    `failed`, None, None) when compiling or the first call raised. A benchmark reports such a
    variant and goes on with the others: a kernel that does not build on a device is a result too.
    """
    try:
        jax.block_until_ready(args)
        compiled, compile_s, temp = compile_variant(fn, args, mode, argnums)
        row = dict(row, compile_s=compile_s, temp_bytes=temp)
        if max_temp_bytes is not None and temp is not None and temp > max_temp_bytes:
            return dict(row, skipped=f"XLA temp {temp / 2**20:,.0f} MiB exceeds --max_temp_bytes"), None, None
        out = jax.block_until_ready(compiled(*args))
    except Exception as e:  # noqa: BLE001  (any failure of the variant, reported in its row)
        first = (str(e).strip().splitlines() or [""])[0]
        return dict(row, failed=f"{type(e).__name__}: {first[:300]}"), None, None
    return row, compiled, out


def time_round_robin(entries, repeats: int, min_round_s: float = 0.02) -> None:
    """entries: (row dict, compiled, args). Calls every entry once per round for `repeats` rounds
    (so load from elsewhere on the machine falls on all alike) and adds median_s, min_s, times_s
    and calls_per_round to each row.

    A call that takes less than `min_round_s` is repeated within its round: the calls are issued
    back to back and waited on once (block_until_ready on the last), and the round's time is
    divided by their number. On a GPU, whose calls run asynchronously, this measures the device's
    time per call rather than the host's dispatch and synchronisation overhead, which is what a
    single short call mostly measures; on CPU it averages timer noise over a few calls."""
    counts = []
    for _, compiled, args in entries:
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        once = time.perf_counter() - t0
        counts.append(max(1, min(1000, int(min_round_s / max(once, 1e-6)) + 1)) if once < min_round_s else 1)
    times = [[] for _ in entries]
    for _ in range(repeats):
        for (_, compiled, args), n, ts in zip(entries, counts, times):
            t0 = time.perf_counter()
            for _ in range(n - 1):
                compiled(*args)
            jax.block_until_ready(compiled(*args))
            ts.append((time.perf_counter() - t0) / n)
    for (row, _, _), n, ts in zip(entries, counts, times):
        row.update(median_s=statistics.median(ts), min_s=min(ts), times_s=ts, calls_per_round=n)


def machine_info() -> dict:
    """What a benchmark's numbers were measured on."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "backend": jax.default_backend(),
            "jax": jax.__version__}


def write_json(path: str, result: dict) -> None:
    """Write a benchmark's result (its directory created) and say where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
