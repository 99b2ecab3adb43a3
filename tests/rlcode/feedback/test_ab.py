"""A/B statistics: Wilson and Newcombe intervals against published values and a direct root
finding, their coverage by simulation, and the split of a log into release periods."""

import math

import numpy as np
import pytest

from rlcode.feedback.ab import compare, newcombe, rollout_periods, wilson
from rlcode.feedback.usage_log import Interaction, Outcome


@pytest.mark.parametrize("k,n,low,high", [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611),
                                          (1, 29, 0.0061, 0.1718)])
def test_wilson_matches_published_values(k, n, low, high):
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I (method 3).
    lo, hi = wilson(k, n)
    assert lo == pytest.approx(low, abs=6e-5) and hi == pytest.approx(high, abs=6e-5)


def test_wilson_is_the_set_of_proportions_the_score_test_accepts():
    # Independent definition: pi is inside iff |p - pi| <= z sqrt(pi (1 - pi) / n); find the ends by bisection.
    z = 1.959963984540054
    for k, n in ((3, 17), (40, 41), (12, 100), (1, 2)):
        p = k / n
        inside = lambda pi: abs(p - pi) <= z * math.sqrt(pi * (1 - pi) / n)  # noqa: E731

        def edge(a, b):  # a inside, b outside
            for _ in range(100):
                m = (a + b) / 2
                a, b = (m, b) if inside(m) else (a, m)
            return a

        lo, hi = wilson(k, n)
        assert lo == pytest.approx(edge(p, 0.0), abs=1e-9) and hi == pytest.approx(edge(p, 1.0), abs=1e-9)


@pytest.mark.parametrize("k1,n1,k2,n2,low,high", [(48, 80, 56, 70, 0.0524, 0.3339), (0, 10, 0, 10, -0.2775, 0.2775)])
def test_newcombe_matches_published_values(k1, n1, k2, n2, low, high):
    # Newcombe (1998), "Interval estimation for the difference between independent proportions", method 10.
    d, lo, hi = newcombe(k1, n1, k2, n2)
    assert d == pytest.approx(k2 / n2 - k1 / n1)
    assert lo == pytest.approx(low, abs=6e-5) and hi == pytest.approx(high, abs=6e-5)


def test_newcombe_covers_the_true_difference_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    for p1, p2, n in ((0.3, 0.4, 80), (0.05, 0.1, 60), (0.9, 0.95, 120)):
        hits = 0
        trials = 2000
        for k1, k2 in zip(rng.binomial(n, p1, trials), rng.binomial(n, p2, trials)):
            _, lo, hi = newcombe(int(k1), n, int(k2), n)
            hits += lo <= p2 - p1 <= hi
        assert 0.925 <= hits / trials <= 0.975, (p1, p2, n, hits / trials)


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="0 <= k <= n"):
        wilson(5, 3)
    with pytest.raises(ValueError):
        wilson(-1, 3)


def row(i, version, t, kinds, latency=2.0):
    it = Interaction(id=f"i{i}", version=version, time=t, user="u", request="", prompt_ids=(1,), completion="",
                     completion_ids=(2,), logprobs=(-1.0,))
    outs = [Outcome(id=f"i{i}-{k}", interaction=it.id, kind=k, time=t + 1, value=latency if k == "latency" else 1.0)
            for k in kinds]
    return it, outs


def test_release_periods_and_their_comparison():
    rows = [row(0, 0, 0.0, ["latency"]), row(1, 0, 10.0, ["accepted", "kept", "latency"]),
            # v3 rolls out at t = 20 while v0 still serves a share
            row(2, 3, 20.0, ["accepted", "kept", "latency"], 1.0), row(3, 0, 25.0, ["followup", "latency"], 3.0),
            row(4, 3, 30.0, ["accepted", "reverted", "latency"], 1.0), row(5, 0, 31.0, ["accepted", "kept"]),
            # v7 rolls out at t = 40
            row(6, 7, 40.0, ["followup"]), row(7, 3, 41.0, ["accepted"])]
    periods = rollout_periods(rows)
    assert [(p["a"], p["b"], p["start"], p["end"]) for p in periods] == [(0, 3, 20.0, 40.0), (3, 7, 40.0, math.inf)]
    first = periods[0]
    assert [r[0].id for r in first["rows_a"]] == ["i3", "i5"] and [r[0].id for r in first["rows_b"]] == ["i2", "i4"]
    c = compare(first["rows_a"], first["rows_b"])
    assert c["n"] == {"a": 2, "b": 2}
    assert (c["acceptance"]["a"], c["acceptance"]["b"]) == (0.5, 1.0)
    assert (c["persistence"]["a"], c["persistence"]["b"]) == (1.0, 0.5)  # B: one of its two accepted edits reverted
    assert (c["followup"]["a"], c["followup"]["b"]) == (0.5, 0.0)
    assert c["acceptance"]["diff_ci"] == pytest.approx(newcombe(1, 2, 2, 2)[1:])
    assert (c["latency"]["a"], c["latency"]["b"], c["latency"]["diff"]) == (3.0, 1.0, -2.0)
