"""The over-optimisation monitor on synthetic proxy / gold curves with audit-sample noise: how soon
it flags a real divergence, how rarely it flags when there is none, and what it ignores."""

import math

import numpy as np
import pytest

from rlcode.checks import ConfigError
from rlcode.feedback.monitor import MonitorConfig, OveroptimizationMonitor, audit_rows


def run(gold_curve, proxy_curve, cfg, seed, audit=8, steps=200):
    """Feed Bernoulli(gold) audit samples (gold as a pass rate) and noisy proxy scores; the step of
    the first flag, or None."""
    rng = np.random.default_rng(seed)
    mon = OveroptimizationMonitor(cfg)
    for step in range(steps):
        g = rng.random(audit) < gold_curve(step)
        p = proxy_curve(step) + rng.normal(0, 0.5, audit)
        out, flagged = mon.update(step, p, g.astype(float))
        assert out["monitor/audit_rows"] == audit
        if flagged:
            return step
    return None


def peaked(step):  # gold rises to 0.6 at step 80, then falls by 0.004 a step
    return 0.2 + 0.005 * step if step <= 80 else max(0.6 - 0.004 * (step - 80), 0.0)


def rising(step):  # gold rises then plateaus: never diverges
    return min(0.2 + 0.005 * step, 0.6)


def proxy_up(step):
    return 0.02 * step


CFG = MonitorConfig(enabled=True, audit_size=8)  # the defaults: windows of 10 steps, spans of 3, z = 3


@pytest.mark.slow
def test_a_real_divergence_is_flagged_within_a_bounded_delay():
    delays = []
    for seed in range(60):
        flagged = run(peaked, proxy_up, CFG, seed)
        assert flagged is not None, seed
        delays.append(flagged - 80)
    # Gold falls 0.04 per window; a span of 3 windows (240 audit rows) has a standard error of
    # about 0.03, so the fall passes 3 standard errors of the difference (plus the lag of the span)
    # after about 40-90 steps.
    assert np.median(delays) <= 70 and max(delays) <= 100, delays
    assert min(delays) >= 0, delays  # never before the peak


@pytest.mark.slow
def test_no_divergence_rarely_flags():
    false = sum(run(rising, proxy_up, CFG, seed, steps=300) is not None for seed in range(100))
    assert false <= 8, false  # the peak is a max over noisy spans, and the test repeats every window


@pytest.mark.slow
def test_a_collapse_of_both_is_not_a_divergence():
    """Gold and proxy falling together is a broken policy, not the proxy and gold parting ways."""
    proxy_falls = lambda step: 0.02 * min(step, 80) - 0.05 * max(step - 80, 0)
    assert all(run(peaked, proxy_falls, CFG, seed) is None for seed in range(20))
    # With proxy_slack the monitor tolerates a small proxy fall (it still flags the same runs).
    proxy_dips = lambda step: 0.02 * min(step, 80) - 0.001 * max(step - 80, 0)
    loose = MonitorConfig(**{**CFG.__dict__, "proxy_slack": 1.0})
    assert sum(run(peaked, proxy_dips, loose, seed) is not None for seed in range(20)) >= 18


def test_exact_verdict_on_constructed_windows():
    """Windows of constant values: a drop beyond the tolerance flags exactly at the window that
    completes it; the standard error of constant windows is 0."""
    cfg = MonitorConfig(enabled=True, window=2, span=1, tolerance=0.1, z=2.0, min_windows=2)
    mon = OveroptimizationMonitor(cfg)
    golds = [[1, 1]] * 2 + [[0.95, 0.95]] * 2 + [[0.85, 0.85]] * 2
    verdicts = [mon.update(i, [float(i)] * 2, g)[1] for i, g in enumerate(golds)]
    # windows: 1.0 (steps 0-1), 0.95 (2-3): drop 0.05 <= 0.1; 0.85 (4-5): drop 0.15 > 0.1.
    assert verdicts == [False, False, False, False, False, True]
    out, _ = mon.update(6, [6.0, 6.0], [0.85, 0.85])
    assert out["monitor/flags"] == 1.0


def test_after_an_action_the_reference_restarts():
    cfg = MonitorConfig(enabled=True, window=1, span=1, tolerance=0.1, z=0.0, min_windows=2, cooldown=3)
    mon = OveroptimizationMonitor(cfg)
    assert not mon.update(0, [0.0], [1.0])[1]
    assert mon.update(1, [1.0], [0.5])[1]
    mon.acted(1, "raise_kl")
    # Steps 2-4 are skipped; from step 5 the peak is the windows after the action.
    assert [mon.update(s, [2.0], [0.5])[1] for s in (2, 3, 4)] == [False] * 3
    assert [mon.update(s, [2.0], [0.5])[1] for s in (5, 6)] == [False, False]
    assert mon.update(7, [3.0], [0.3])[1]
    assert mon.actions == [(1, "raise_kl")]


def test_bad_input_is_refused():
    mon = OveroptimizationMonitor(CFG)
    with pytest.raises(ValueError, match="proxy rewards but"):
        mon.update(0, [1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="not finite"):
        mon.update(0, [math.nan], [1.0])
    with pytest.raises(ConfigError, match="monitor.action"):
        MonitorConfig(action="panic")
    with pytest.raises(ConfigError, match="monitor.kl_factor"):
        MonitorConfig(kl_factor=1.0)


def test_audit_rows_are_valid_distinct_and_seeded():
    valid = np.array([True, False] * 10)
    rows = audit_rows(20, 5, valid, np.random.default_rng(0))
    assert len(rows) == 5 == len(set(rows)) and valid[rows].all()
    assert np.array_equal(rows, audit_rows(20, 5, valid, np.random.default_rng(0)))
    assert np.array_equal(audit_rows(20, 50, valid, np.random.default_rng(0)), np.flatnonzero(valid))
