"""The benchmarks' shared compiling and timing: a failing variant is recorded, not raised; short
calls are repeated within a round and the round's time divided among them."""

import types

import jax.numpy as jnp
import numpy as np

from experiments import bench_util


def test_try_compile_records_failures_and_skips():
    x = jnp.ones((4, 8), jnp.float32)

    def broken(a):
        raise ValueError("no kernel for this shape\nsecond line")

    row, compiled, out = bench_util.try_compile({"variant": "v"}, broken, (x,), "fwd")
    assert compiled is None and out is None
    assert row == {"variant": "v", "failed": "ValueError: no kernel for this shape"}

    row, compiled, out = bench_util.try_compile({"variant": "w"}, lambda a: jnp.tanh(a) @ a.T, (x,), "fwd",
                                                max_temp_bytes=-1)
    assert compiled is None and row["skipped"].startswith("XLA temp") and "compile_s" in row

    row, compiled, out = bench_util.try_compile({"variant": "g"}, lambda a: jnp.sin(a), (x,), "fwdbwd")
    value, (grad,) = out
    np.testing.assert_allclose(np.asarray(grad), np.cos(np.ones((4, 8))) * np.cos(np.arange(32).reshape(4, 8)),
                               rtol=1e-5)
    assert set(row) >= {"compile_s", "temp_bytes"} and "failed" not in row


def test_short_calls_are_repeated_within_a_round(monkeypatch):
    # A fake clock that only the calls advance, so the counts do not depend on the machine's load.
    clock = {"now": 0.0}
    monkeypatch.setattr(bench_util, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    calls = {"fast": 0, "slow": 0}

    class Counted:
        def __init__(self, name, seconds):
            self.name, self.seconds = name, seconds

        def __call__(self, a):
            calls[self.name] += 1
            clock["now"] += self.seconds
            return a

    x = jnp.ones(3)
    entries = [({"v": "fast"}, Counted("fast", 0.0005), (x,)), ({"v": "slow"}, Counted("slow", 0.03), (x,))]
    bench_util.time_round_robin(entries, repeats=3, min_round_s=0.02)
    fast, slow = entries[0][0], entries[1][0]
    assert slow["calls_per_round"] == 1 and calls["slow"] == 1 + 3
    # 0.02 s of 0.5 ms calls: about 40 calls a round, each round waited on once.
    assert 40 <= fast["calls_per_round"] <= 41 and calls["fast"] == 1 + 3 * fast["calls_per_round"]
    # The per-call time is the round's time over its calls: the call's time, not the round's.
    np.testing.assert_allclose(fast["times_s"], [0.0005] * 3, rtol=1e-9)
    np.testing.assert_allclose(slow["times_s"], [0.03] * 3, rtol=1e-9)
    assert fast["median_s"] == fast["min_s"] == fast["times_s"][1]
