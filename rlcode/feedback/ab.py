"""A/B comparison of two served versions from the usage log, with confidence intervals.

While a new version B is rolled out, the previous version A still serves a share of the requests
(`rlcode.feedback.deployment`: each request is assigned at random). Over the requests of that
period the comparison reports, per version and as the difference B - A:

* acceptance rate: interactions with an ``accepted`` outcome / interactions;
* edit persistence: accepted interactions that were ``kept`` (not reverted) / accepted ones;
* follow-up rate: interactions with a dissatisfied ``followup`` / interactions;
* mean latency (seconds; a normal interval).

A rate's interval is Wilson's score interval; the difference's is Newcombe's hybrid score interval
(method 10 of Newcombe, Statistics in Medicine 1998), which unlike the Wald interval keeps its
coverage at small counts and rates near 0 or 1. Both assume independent rows, which holds for
per-request assignment (a test that assigns by user needs intervals clustered by user).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rlcode.feedback.usage_log import Interaction, Outcome

__all__ = ["wilson", "newcombe", "compare", "rollout_periods"]

Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a proportion of k successes in n trials ((0, 1) when n = 0)."""
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    den = 1 + z * z / n
    return max(0.0, (centre - half) / den), min(1.0, (centre + half) / den)


def newcombe(k1: int, n1: int, k2: int, n2: int, z: float = Z95) -> tuple[float, float, float]:
    """(difference, low, high) for p2 - p1 = k2/n2 - k1/n1 by Newcombe's hybrid score interval."""
    if n1 == 0 or n2 == 0:
        return math.nan, -1.0, 1.0
    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = wilson(k1, n1, z)
    l2, u2 = wilson(k2, n2, z)
    d = p2 - p1
    low = d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2)
    high = d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2)
    return d, low, high


def _version_stats(rows: Sequence[tuple[Interaction, Sequence[Outcome]]]) -> dict[str, float]:
    n = len(rows)
    kinds = [{o.kind for o in outs} for _, outs in rows]
    latency = [next(o.value for o in outs if o.kind == "latency") for _, outs in rows
               if any(o.kind == "latency" for o in outs)]
    accepted = sum("accepted" in k for k in kinds)
    kept = sum("accepted" in k and "kept" in k and "reverted" not in k for k in kinds)
    followup = sum("followup" in k for k in kinds)
    mean = sum(latency) / len(latency) if latency else math.nan
    var = sum((x - mean) ** 2 for x in latency) / (len(latency) - 1) if len(latency) > 1 else math.nan
    return {"n": n, "accepted": accepted, "kept": kept, "followup": followup, "latency_mean": mean,
            "latency_se": math.sqrt(var / len(latency)) if latency else math.nan}


def compare(rows_a: Sequence[tuple[Interaction, Sequence[Outcome]]],
            rows_b: Sequence[tuple[Interaction, Sequence[Outcome]]], z: float = Z95) -> dict[str, dict]:
    """Per metric: {"a", "b" (rates), "a_ci", "b_ci", "diff", "diff_ci"} for B - A (module docstring)."""
    a, b = _version_stats(rows_a), _version_stats(rows_b)
    out: dict[str, dict] = {"n": {"a": a["n"], "b": b["n"]}}
    for name, num, den in (("acceptance", "accepted", "n"), ("persistence", "kept", "accepted"),
                           ("followup", "followup", "n")):
        k1, n1, k2, n2 = a[num], a[den], b[num], b[den]
        d, lo, hi = newcombe(k1, n1, k2, n2, z)
        out[name] = {"a": k1 / n1 if n1 else math.nan, "b": k2 / n2 if n2 else math.nan,
                     "a_ci": wilson(k1, n1, z), "b_ci": wilson(k2, n2, z), "diff": d, "diff_ci": (lo, hi)}
    d = b["latency_mean"] - a["latency_mean"]
    se = math.sqrt(a["latency_se"] ** 2 + b["latency_se"] ** 2)
    out["latency"] = {"a": a["latency_mean"], "b": b["latency_mean"], "diff": d, "diff_ci": (d - z * se, d + z * se)}
    return out


def rollout_periods(rows: Sequence[tuple[Interaction, Sequence[Outcome]]]) -> list[dict]:
    """The A/B periods in a log: for each version B after the first, the requests from B's first
    interaction until the next version's first one, split into those B served and those its
    predecessor A served. [{"a", "b", "start", "end", "rows_a", "rows_b"}]."""
    rows = sorted(rows, key=lambda r: (r[0].time, r[0].id))
    first: dict[int, float] = {}
    for it, _ in rows:
        first.setdefault(it.version, it.time)
    order = sorted(first, key=lambda v: (first[v], v))
    out = []
    for i in range(1, len(order)):
        a, b = order[i - 1], order[i]
        start, end = first[b], first[order[i + 1]] if i + 1 < len(order) else math.inf
        inside = [r for r in rows if start <= r[0].time < end]
        out.append({"a": a, "b": b, "start": start, "end": end, "rows_a": [r for r in inside if r[0].version == a],
                    "rows_b": [r for r in inside if r[0].version == b]})
    return out
