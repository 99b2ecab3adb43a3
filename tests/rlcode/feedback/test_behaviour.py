"""The behaviour monitor: its statistic against an independent computation, its delays and false
alarms on synthetic behaviour streams, its input checks, and the jobs' use of it."""

import math

import numpy as np
import pytest

from rlcode.checks import ConfigError
from rlcode.feedback.behaviour import BehaviourConfig, BehaviourMonitor, BehaviourWatch, behaviour_config


def stream(seed, steps=200, rows=64, question=lambda t: 0.1, malformed=0.05, length=lambda t: 40.0, cfg=None):
    """Feed a monitor `steps` batches of synthetic rows; returns it."""
    rng = np.random.default_rng(seed)
    m = BehaviourMonitor(cfg or BehaviourConfig())
    for t in range(steps):
        asked = rng.random(rows) < question(t)
        m.update(t, {"answer_rate": ~asked, "question_rate": asked,
                     "malformed_rate": (rng.random(rows) < malformed) & ~asked,
                     "length": rng.poisson(length(t), rows).astype(float)})
    return m


def first(m, stat):
    return next((step for step, s, _ in m.events if s == stat), None)


def test_shift_and_bound_equal_a_direct_computation():
    rng = np.random.default_rng(3)
    cfg = BehaviourConfig(baseline_steps=4, window=3, z=2.5, rate_tolerance=0.02, length_tolerance=0.01)
    m = BehaviourMonitor(cfg)
    batches = []
    for t in range(12):
        n = int(rng.integers(5, 30))  # rows per step vary (invalid rows are left out by the jobs)
        b = {"question_rate": rng.random(n) < 0.2 + 0.03 * t, "malformed_rate": rng.random(n) * 0.5,
             "length": rng.gamma(4.0, 10.0 + t, n)}
        batches.append(b)
        out, _ = m.update(t, b)
        if t < cfg.baseline_steps:
            assert "behaviour/length_shift" not in out
            continue
        for stat in b:
            base = np.concatenate([x[stat] for x in batches[:cfg.baseline_steps]]).astype(np.float64)
            now = np.concatenate([x[stat] for x in batches[-cfg.window:]]).astype(np.float64)
            shift = now.mean() - base.mean()
            if stat == "question_rate":  # pooled two-proportion error
                p = np.concatenate([base, now]).mean()
                se = math.sqrt(p * (1 - p) * (1 / len(base) + 1 / len(now)))
                tol = cfg.rate_tolerance
            else:  # Welch
                se = math.sqrt(base.var(ddof=1) / len(base) + now.var(ddof=1) / len(now))
                tol = cfg.length_tolerance * base.mean() if stat == "length" else cfg.rate_tolerance
            bound = max(tol, cfg.z * se)
            assert out[f"behaviour/{stat}_shift"] == pytest.approx(shift, abs=1e-9)
            assert out[f"behaviour/{stat}_bound"] == pytest.approx(bound, rel=1e-7)
            assert out[f"behaviour/{stat}_flag"] == float(abs(shift) > bound)
        assert out["behaviour/question_rate"] == pytest.approx(b["question_rate"].mean())


@pytest.mark.slow
def test_steady_behaviour_rarely_flags():
    """No statistic moves: over 200 steps, at most 2 of 50 runs flag anything (64 and 16 rows a
    step, the defaults; 0 and 2 of 100 flagged when this was written)."""
    for rows in (64, 16):
        alarms = sum(bool(stream(seed, rows=rows).events) for seed in range(50))
        assert alarms <= 2, (rows, alarms)


def test_a_jump_is_flagged_within_the_window():
    """The question rate jumps 0.1 -> 0.5 at step 30 (64 rows a step): every run flags it within
    `window` steps of the jump, and none before it."""
    cfg = BehaviourConfig()
    for seed in range(30):
        m = stream(seed, steps=60, question=lambda t: 0.1 if t < 30 else 0.5)
        step = first(m, "question_rate")
        assert step is not None and 30 <= step < 30 + cfg.window, (seed, m.events)
        assert first(m, "answer_rate") is not None  # its mirror image
        assert first(m, "length") is None


def test_a_gradual_takeover_is_flagged_before_it_is_done():
    """The question rate climbs 0.02 a step from 0.1 (step 30) towards 0.9 (step 70): flagged in
    every run once the climb passes the tolerance, by step 30 + 15 at the latest."""
    for seed in range(30):
        m = stream(seed, steps=80, question=lambda t: min(0.9, 0.1 + 0.02 * max(0, t - 30)))
        step = first(m, "question_rate")
        assert step is not None and 30 < step <= 45, (seed, step)


def test_length_needs_a_relative_change_beyond_the_tolerance():
    # +5% of the mean length, with many rows: significant, but inside the 25% tolerance.
    m = stream(0, steps=60, rows=256, length=lambda t: 40.0 if t < 20 else 42.0)
    assert first(m, "length") is None
    m = stream(0, steps=60, rows=256, length=lambda t: 40.0 if t < 20 else 60.0)
    assert 20 <= first(m, "length") < 25
    m = stream(0, steps=60, rows=256, length=lambda t: 40.0 if t < 20 else 20.0)  # shorter counts too
    assert 20 <= first(m, "length") < 25
    assert m.events[0][2] < 0


def test_a_stat_stays_flagged_and_counts_one_event_until_it_returns():
    m = stream(0, steps=40, question=lambda t: 0.1 if t < 20 or t >= 30 else 0.6)
    q = [e for e in m.events if e[1] == "question_rate"]
    assert len(q) == 1 and 20 <= q[0][0] < 25
    assert not m.flagged["question_rate"]  # back to the baseline by the end


def test_bad_rows_are_refused():
    m = BehaviourMonitor(BehaviourConfig())
    with pytest.raises(ValueError, match="unknown behaviour statistics"):
        m.update(0, {"answers": [1.0]})
    with pytest.raises(ValueError, match="not finite"):
        m.update(0, {"length": [1.0, float("nan")]})
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        m.update(0, {"question_rate": [2.0]})
    with pytest.raises(ConfigError, match="behaviour.window"):
        BehaviourConfig.from_config(behaviour_config(window=0))


def test_watch_logs_each_shift_once_and_stops_under_stop():
    said = []
    w = BehaviourWatch(behaviour_config(baseline_steps=2, window=1, action="stop"), said.append)
    for t in range(2):
        assert "behaviour/question_rate" in w.observe({"question_rate": np.zeros(50)})
        assert w.control(t) is None
    w.observe({"question_rate": np.ones(50)})
    assert w.control(7) == {"stop": "behaviour"}
    assert len(said) == 1 and "step 7" in said[0] and "question_rate 0 -> 1" in said[0]
    w.observe({"question_rate": np.ones(50)})
    assert w.control(8) is None  # still shifted, no new event
    # Disabled: only the means are logged, nothing acts.
    w = BehaviourWatch(behaviour_config(enabled=False), said.append)
    assert w.observe({"length": np.array([3.0, 5.0])}) == {"behaviour/length": 4.0}
    assert w.control(0) is None


def test_agent_episodes_rows():
    from types import SimpleNamespace as NS

    from rlcode.train.agent import behaviour_rows

    def episode(calls, malformed, no_call, submitted, generated):
        turns = [NS(num_generated=g) for g in generated]
        return NS(trajectory=NS(tool_calls=[object()] * calls, num_malformed_calls=malformed,
                                num_no_call_turns=no_call, submitted=submitted, turns=turns))

    rows = behaviour_rows([episode(4, 1, 0, True, [10, 20]), episode(2, 2, 2, False, [5]), episode(0, 0, 0, False, [])])
    assert rows["answer_rate"].tolist() == [1.0, 0.0, 0.0]
    assert rows["malformed_rate"].tolist() == [0.25, 1.0, 0.0]  # (malformed + turns without a call) / actions
    assert rows["length"].tolist() == [30.0, 5.0, 0.0]
    assert "question_rate" not in rows
