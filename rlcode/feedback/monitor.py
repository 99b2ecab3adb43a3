"""Online detection of reward over-optimisation from a small gold-labelled audit sample.

When a policy is trained against a learned (proxy) reward, the proxy keeps rising while the true
(gold) objective peaks and then falls: the policy has found what the proxy over-rewards. Gold is
expensive in a deployment (people, or slow checks), so the monitor sees it only on an *audit
sample*: `audit_size` rows of each step's batch, drawn at random, whose gold score is looked up.

Each step hands the monitor the audit rows' proxy and gold rewards. It groups steps into windows
(`window` steps each) and, whenever a window completes, compares the latest `span` windows with the
best earlier run of `span` windows that shares no rows with them (the gold peak so far):

    diverged  <=>  gold_now < gold_peak - max(tolerance, z * sqrt(se_now^2 + se_peak^2))
                   and proxy_now >= proxy_peak - proxy_slack

with se the standard error of a span's gold mean over its audit rows. In words: the gold mean fell
clearly (beyond `tolerance` and beyond `z` standard errors of the difference) while the proxy did
not fall, so the fall is not an overall collapse of the policy but the proxy and gold parting
ways. The peak is the best of many noisy spans, so it is biased upwards, and the test is repeated
at every window: `z` is set well above a single test's 2 (the defaults: on a gold pass rate that
rises and then stays flat, audited 8 rows a step, about 4 runs in 100 flag within 300 steps; on one
that falls 0.004 a step after its peak every run is flagged, a median of 60 steps after the peak;
tests/rlcode/feedback/test_monitor.py measures both). After an action the monitor waits `cooldown`
steps and restarts its reference from the windows after them.

Actions (`action`, applied by the job): "log" (only the flag), "stop" (end training), "raise_kl"
(multiply the KL coefficient of the reward's KL penalty by `kl_factor`), "refresh" (label new
choices on current samples and continue training the reward model on them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np

from rlcode.checks import TypedSection, flag, integer, real, text
from rlcode.feedback.simulated_users import FEATURES

__all__ = ["MONITOR_ACTIONS", "MonitorConfig", "monitor_config", "OveroptimizationMonitor", "audit_rows"]

MONITOR_ACTIONS = ("log", "stop", "raise_kl", "refresh")


@dataclasses.dataclass(frozen=True)
class MonitorConfig(TypedSection):
    """The `monitor` section of a job that trains against a learned reward.

    enabled: run the monitor. audit_size: rows per step whose gold is looked at. window: steps per
    window. span: windows pooled into one estimate (the current one and the peak). tolerance: the smallest gold drop (absolute, in gold units) that counts. z: standard
    errors the drop must also exceed. proxy_slack: how far the proxy may fall from its value at the
    gold peak and still count as "not falling". min_windows: complete windows before the first
    verdict (at least 2 * span: the peak and the current span share no rows, so the first verdict
    comes after 2 * span * window steps). action: "log" | "stop" | "raise_kl" | "refresh". kl_factor: the KL coefficient's
    factor per "raise_kl" (a coefficient of 0 becomes `kl_floor`). cooldown: steps after an action
    before the next verdict. refresh_pairs: choices labelled per "refresh"; refresh_steps,
    refresh_lr: reward-model training steps on them and their peak learning rate. user_beta,
    user_bias, user_feature, user_flip: the simulated users who label them
    (`rlcode.feedback.simulated_users.SimulatedUser`).
    """

    SPECS = {"enabled": flag(), "audit_size": integer(1), "window": integer(1), "span": integer(1), "tolerance": real(0), "z": real(0),
             "proxy_slack": real(0), "min_windows": integer(1), "action": text(MONITOR_ACTIONS),
             "kl_factor": real(1, low_open=True), "kl_floor": real(0, low_open=True), "cooldown": integer(0),
             "refresh_pairs": integer(1), "refresh_steps": integer(1), "refresh_lr": real(0, low_open=True),
             "user_beta": real(0), "user_bias": real(), "user_feature": text(FEATURES), "user_flip": real(0, 0.5)}
    SECTION = "monitor"

    enabled: bool = False
    audit_size: int = 8
    window: int = 10
    span: int = 3
    tolerance: float = 0.05
    z: float = 3.0
    proxy_slack: float = 0.0
    min_windows: int = 3
    action: str = "log"
    kl_factor: float = 4.0
    kl_floor: float = 0.05
    cooldown: int = 20
    refresh_pairs: int = 128
    refresh_steps: int = 40
    refresh_lr: float = 1e-4
    user_beta: float = 20.0
    user_bias: float = 0.0
    user_feature: str = "comment_lines"
    user_flip: float = 0.1


def monitor_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The `monitor` config section: the `MonitorConfig` defaults with `overrides`."""
    return MonitorConfig.default_section(**overrides)


def audit_rows(num_rows: int, audit_size: int, valid: Sequence[bool], rng: np.random.Generator) -> np.ndarray:
    """Indices of `audit_size` valid rows drawn without replacement (all valid rows if fewer)."""
    candidates = np.flatnonzero(np.asarray(valid, bool)[:num_rows])
    if len(candidates) <= audit_size:
        return candidates
    return np.sort(rng.choice(candidates, size=audit_size, replace=False))


@dataclasses.dataclass
class _Window:
    proxy: list[float] = dataclasses.field(default_factory=list)
    gold: list[float] = dataclasses.field(default_factory=list)
    steps: int = 0

    def stats(self) -> tuple[float, float, float]:
        """(proxy mean, gold mean, standard error of the gold mean)."""
        g = np.asarray(self.gold, np.float64)
        se = float(g.std(ddof=1) / math.sqrt(len(g))) if len(g) > 1 else math.inf
        return float(np.mean(self.proxy)), float(g.mean()), se


class OveroptimizationMonitor:
    """Feed `update(step, proxy, gold)` once per step with the audit rows' rewards; it returns the
    step's scalars (``monitor/...``) and whether it flags a divergence (module docstring). The
    caller applies the action and calls `acted(step)`."""

    def __init__(self, config: MonitorConfig):
        self.cfg = MonitorConfig.from_config(config)
        self.windows: list[_Window] = []  # completed windows since the last reset
        self.current = _Window()
        self.quiet_until = -1
        self.flags = 0
        self.actions: list[tuple[int, str]] = []

    def update(self, step: int, proxy: Sequence[float], gold: Sequence[float]) -> tuple[dict[str, float], bool]:
        proxy, gold = np.asarray(proxy, np.float64), np.asarray(gold, np.float64)
        if proxy.shape != gold.shape:
            raise ValueError(f"{proxy.shape} proxy rewards but {gold.shape} gold scores")
        if not (np.isfinite(proxy).all() and np.isfinite(gold).all()):
            raise ValueError(f"step {step}: the audit sample's rewards are not finite")
        out = {"monitor/audit_rows": float(len(gold))}
        if len(gold):
            out.update({"monitor/audit_proxy": float(proxy.mean()), "monitor/audit_gold": float(gold.mean())})
        if step <= self.quiet_until:  # after an action: skip the steps it needs to take effect
            out["monitor/diverged"] = 0.0
            return out, False
        self.current.proxy.extend(proxy.tolist())
        self.current.gold.extend(gold.tolist())
        self.current.steps += 1
        diverged = False
        if self.current.steps >= self.cfg.window and len(self.current.gold):  # a verdict per completed window
            self.windows.append(self.current)
            self.current = _Window()
            diverged = self._verdict(out)
        out["monitor/diverged"] = float(diverged)
        if diverged:
            self.flags += 1
        out["monitor/flags"] = float(self.flags)
        return out, diverged

    def _span(self, end: int) -> tuple[float, float, float]:
        """(proxy mean, gold mean, standard error of the gold mean) of the `span` windows ending at `end`."""
        rows = _Window()
        for w in self.windows[end - self.cfg.span + 1:end + 1]:
            rows.proxy += w.proxy
            rows.gold += w.gold
        return rows.stats()

    def _verdict(self, out: dict[str, float]) -> bool:
        span, n = self.cfg.span, len(self.windows)
        if n < max(self.cfg.min_windows, 2 * span):
            return False
        # The peak: the best span that ends before the current one starts (no shared rows).
        earlier = [self._span(end) for end in range(span - 1, n - span)]
        p_peak, g_peak, se_peak = max(earlier, key=lambda x: x[1])
        p_now, g_now, se_now = self._span(n - 1)
        se = math.sqrt(se_now ** 2 + se_peak ** 2)
        drop = g_peak - g_now
        out.update({"monitor/gold_drop": drop, "monitor/gold_drop_se": se if math.isfinite(se) else -1.0,
                    "monitor/gold_peak": g_peak, "monitor/proxy_gain": p_now - p_peak})
        return drop > max(self.cfg.tolerance, self.cfg.z * se) and p_now >= p_peak - self.cfg.proxy_slack

    def acted(self, step: int, action: str) -> None:
        """Record an action at `step`: the reference restarts after `cooldown` steps."""
        self.actions.append((step, action))
        self.windows, self.current = [], _Window()
        self.quiet_until = step + self.cfg.cooldown
