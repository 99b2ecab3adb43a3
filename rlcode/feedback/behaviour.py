"""Online monitors of a policy's behaviour: the hacks that no reward term shows.

A policy under RL finds the cheapest way to its reward, and some ways show only in *what it does*:
asking a clarifying question instead of risking a wrong answer, emitting broken tool calls to end an
episode early, answering at ever greater (or smaller) length. The reward can look healthy while
this happens. This monitor watches per-row behaviour statistics of every batch:

* ``answer_rate``: rows that answered (the synthesis job: not a question; the agent job: the
  episode ended with ``submit``);
* ``question_rate``: rows that asked a clarifying question instead;
* ``malformed_rate``: the synthesis job: answers whose program does not parse; the agent job: the
  fraction of an episode's tool calls that were malformed;
* ``length``: tokens the policy generated in the row.

It compares each statistic's mean over the latest `window` steps with its mean over a *baseline*:
the first `baseline_steps` steps of the run (the behaviour the run started from). A statistic
*shifts* when

    |mean_now - mean_base| > max(tolerance, z * se)

with ``tolerance`` = `rate_tolerance` for the rates and `length_tolerance` times the baseline mean
for the length, and ``se`` the standard error of the difference: for the 0/1 rates the pooled
two-proportion error ``sqrt(p (1 - p) (1/n_base + 1/n_now))``, otherwise Welch's
``sqrt(var_base/n_base + var_now/n_now)``. Both bounds matter: `z` keeps noise from flagging (the
test is repeated every step, so `z` is well above a single test's 2), the tolerance keeps a real
but harmless drift from flagging. The bound on detection: a change larger than both bounds is
flagged at the latest `window` steps after it is complete, once the window holds only new rows
(tests/rlcode/feedback/test_behaviour.py measures the delays and the false alarms).

The first step a statistic shifts is an *event* (``behaviour/events`` counts them, the job logs
it); a statistic stays flagged (``behaviour/<stat>_flag``) while it is shifted. ``action``:
"log" (only the flags) or "stop" (the job ends the run at the first event).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import ml_collections
import numpy as np

from rlcode.checks import TypedSection, flag, integer, real, text

__all__ = ["BEHAVIOUR_ACTIONS", "BEHAVIOUR_STATS", "RATE_STATS", "BehaviourConfig", "behaviour_config",
           "BehaviourMonitor"]

BEHAVIOUR_STATS = ("answer_rate", "question_rate", "malformed_rate", "length")
RATE_STATS = ("answer_rate", "question_rate")  # 0/1 per row: the pooled two-proportion error
BEHAVIOUR_ACTIONS = ("log", "stop")


@dataclasses.dataclass(frozen=True)
class BehaviourConfig(TypedSection):
    """The `behaviour` section of both RL jobs (module docstring).

    enabled: run the monitor (its statistics are logged either way). baseline_steps: the first
    steps, whose rows are the reference. window: the latest steps pooled into the current estimate.
    z: standard errors a shift must exceed. rate_tolerance: the smallest change of a rate that
    counts (absolute). length_tolerance: the smallest change of the mean length that counts
    (relative to the baseline). action: "log" | "stop".
    """

    SPECS = {"enabled": flag(), "baseline_steps": integer(1), "window": integer(1), "z": real(0),
             "rate_tolerance": real(0, 1), "length_tolerance": real(0), "action": text(BEHAVIOUR_ACTIONS)}
    SECTION = "behaviour"

    enabled: bool = True
    baseline_steps: int = 10
    window: int = 5
    z: float = 4.0
    rate_tolerance: float = 0.1
    length_tolerance: float = 0.25
    action: str = "log"


def behaviour_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The `behaviour` config section: the `BehaviourConfig` defaults with `overrides`."""
    return BehaviourConfig.default_section(**overrides)


@dataclasses.dataclass
class _Pool:
    """Running sums of one statistic's rows."""

    n: int = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, x: np.ndarray) -> None:
        self.n += x.size
        self.total += float(x.sum())
        self.squares += float(np.square(x).sum())

    @property
    def mean(self) -> float:
        return self.total / self.n

    @property
    def var(self) -> float:
        if self.n < 2:
            return 0.0
        return max(self.squares - self.total ** 2 / self.n, 0.0) / (self.n - 1)


def _pool(parts) -> _Pool:
    """The sums of several steps' pools."""
    return _Pool(sum(p.n for p in parts), sum(p.total for p in parts), sum(p.squares for p in parts))


class BehaviourMonitor:
    """Feed `update(step, rows)` once per step with each statistic's per-row values (of valid rows:
    0/1 for the rates, a fraction for ``malformed_rate``, token counts for ``length``); it returns
    the step's scalars (``behaviour/...``) and the statistics whose shift began at this step."""

    def __init__(self, config: BehaviourConfig | Any):
        self.cfg = BehaviourConfig.from_config(config)
        self.steps = 0
        self.baseline = {s: _Pool() for s in BEHAVIOUR_STATS}
        self.recent: dict[str, collections.deque] = {s: collections.deque(maxlen=self.cfg.window)
                                                     for s in BEHAVIOUR_STATS}
        self.flagged: dict[str, bool] = {s: False for s in BEHAVIOUR_STATS}
        self.events: list[tuple[int, str, float]] = []  # (step, statistic, shift)

    def update(self, step: int, rows: Mapping[str, Any]) -> tuple[dict[str, float], list[str]]:
        unknown = set(rows) - set(BEHAVIOUR_STATS)
        if unknown:
            raise ValueError(f"unknown behaviour statistics {sorted(unknown)}; expected {BEHAVIOUR_STATS}")
        out: dict[str, float] = {}
        started: list[str] = []
        in_baseline = self.steps < self.cfg.baseline_steps
        for stat in BEHAVIOUR_STATS:
            x = np.asarray(rows.get(stat, ()), np.float64).reshape(-1)
            if not np.isfinite(x).all():
                raise ValueError(f"step {step}: behaviour statistic {stat} is not finite")
            if stat != "length" and ((x < 0) | (x > 1)).any():
                raise ValueError(f"step {step}: {stat} values must be in [0, 1]")
            if x.size:
                out[f"behaviour/{stat}"] = float(x.mean())
            step_pool = _Pool()
            step_pool.add(x)
            self.recent[stat].append(step_pool)
            if in_baseline:
                self.baseline[stat].add(x)
                continue
            shifted, shift, bound = self._test(stat)
            out[f"behaviour/{stat}_shift"] = shift
            out[f"behaviour/{stat}_bound"] = bound
            out[f"behaviour/{stat}_flag"] = float(shifted)
            if shifted and not self.flagged[stat]:
                self.events.append((step, stat, shift))
                started.append(stat)
            self.flagged[stat] = shifted
        self.steps += 1
        out["behaviour/events"] = float(len(self.events))
        return out, started

    def _test(self, stat: str) -> tuple[bool, float, float]:
        """(shifted, mean_now - mean_base, the bound the shift must exceed) of one statistic."""
        base, now = self.baseline[stat], _pool(self.recent[stat])
        if base.n == 0 or now.n == 0:
            return False, 0.0, math.inf
        shift = now.mean - base.mean
        if stat in RATE_STATS:
            p = (base.total + now.total) / (base.n + now.n)
            se = math.sqrt(p * (1 - p) * (1 / base.n + 1 / now.n))
            tolerance = self.cfg.rate_tolerance
        else:
            se = math.sqrt(base.var / base.n + now.var / now.n)
            tolerance = self.cfg.length_tolerance * abs(base.mean) if stat == "length" else self.cfg.rate_tolerance
        bound = max(tolerance, self.cfg.z * se)
        return abs(shift) > bound, shift, bound

    def describe(self, stat: str, shift: float) -> str:
        """A line for the log: which statistic moved, from what to what."""
        base = self.baseline[stat].mean if self.baseline[stat].n else float("nan")
        return f"{stat} {base:.3g} -> {base + shift:.3g} (baseline: the first {self.cfg.baseline_steps} steps)"


class BehaviourWatch:
    """A job's use of the monitor: `observe(rows)` once per batch (its scalars go to TensorBoard
    with the step's; with the monitor disabled, only the statistics' means), `control(step)` from
    the job's `Plan.control` (logs each new shift and returns ``{"stop": "behaviour"}`` under
    ``action="stop"``). A resumed run starts a new baseline: the monitor keeps no checkpoint."""

    def __init__(self, section: Any, say):
        self.cfg = BehaviourConfig.from_config(section) if section is not None else BehaviourConfig()
        self.monitor = BehaviourMonitor(self.cfg) if self.cfg.enabled else None
        self.say = say
        self._batches = 0
        self._new: list[str] = []

    def observe(self, rows: Mapping[str, Any]) -> dict[str, float]:
        if self.monitor is None:
            return {f"behaviour/{k}": float(np.mean(v)) for k, v in rows.items() if np.size(v)}
        out, started = self.monitor.update(self._batches, rows)
        self._batches += 1
        self._new += started
        return out

    def control(self, step: int) -> dict | None:
        if not self._new:
            return None
        events = {stat: shift for _, stat, shift in self.monitor.events}
        for stat in self._new:
            self.say(f"behaviour monitor at step {step}: {self.monitor.describe(stat, events[stat])}"
                     + ("; stopping" if self.cfg.action == "stop" else ""))
        self._new = []
        return {"stop": "behaviour"} if self.cfg.action == "stop" else None
