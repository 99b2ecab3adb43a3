"""Compiling and timing shared by the benchmark scripts (docs/architecture.md, convention 6)."""

from __future__ import annotations

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


def time_round_robin(entries, repeats: int) -> None:
    """entries: (row dict, compiled, args). Calls every entry once per round for `repeats` rounds
    (so load from elsewhere on the machine falls on all alike), each waited on with
    block_until_ready; adds median_s, min_s and times_s to each row."""
    times = [[] for _ in entries]
    for _ in range(repeats):
        for (_, compiled, args), ts in zip(entries, times):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            ts.append(time.perf_counter() - t0)
    for (row, _, _), ts in zip(entries, times):
        row.update(median_s=statistics.median(ts), min_s=min(ts), times_s=ts)
