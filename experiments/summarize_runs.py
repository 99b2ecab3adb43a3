"""Summarise finished runs of the main job (seeds) into a markdown table and JSON, from their logs.

    python -m experiments.summarize_runs --runs runs/grpo_synth/seed0,runs/grpo_synth/seed1,runs/grpo_synth/seed2 \\
        --out results/grpo_synth.json

For each evaluated metric (default: eval/pass@1, eval/best_of_16, eval_fresh/pass@1,
eval_fresh/best_of_16) it reports the value at the first evaluation (the SFT starting point), at
the last one, their difference, and the smallest value between them (the non-collapse check: did
best-of-16 ever fall below its start?), each as mean ± sample std over the runs, plus the runs'
wall time. Reads only `summary.json` and `tb/metrics.jsonl`; never trains.

    python -m experiments.summarize_runs --timing --runs runs/sync,runs/async

`--timing` instead reports each run's step time split into its stages (medians over the steps
after the first `--skip`, which compile): step, sampling, grading (``time/execute_s``), train and
the trainer's wait for a rollout, and the share of the step each stage is idle (median over
steps): the trainer (waiting), sampling, grading, and the sampler as a whole (sampling + grading;
in async mode, the background thread waiting for the trainer to take its batch).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

import numpy as np

from rlcode.train.metrics import read_jsonl

from experiments.cli import summary

DEFAULT_KEYS = ("eval/pass@1", "eval/best_of_16", "eval_fresh/pass@1", "eval_fresh/best_of_16")


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    a = np.asarray(values, np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def summarize(run_dirs: Sequence[str], keys: Sequence[str] = DEFAULT_KEYS) -> dict:
    """{"runs": [...], "metrics": {key: {"start", "end", "delta", "min_after_start": [mean, std],
    "per_run": {...}}}, "minutes": [mean, std]}. A key some run never logged is skipped."""
    per_key: dict[str, dict[str, list[float]]] = {}
    minutes = []
    for d in run_dirs:
        summary = json.load(open(os.path.join(d, "summary.json")))
        if not summary.get("completed"):
            raise ValueError(f"{d} did not complete (steps_done={summary.get('steps_done')})")
        minutes.append(summary["seconds"] / 60)
        records = [r for r in read_jsonl(os.path.join(d, "tb")) if r["step"] >= 0]
        for key in keys:
            series = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if not series:
                continue
            values = [v for _, v in sorted(series)]
            entry = per_key.setdefault(key, {"start": [], "end": [], "delta": [], "min_after_start": []})
            entry["start"].append(values[0])
            entry["end"].append(values[-1])
            entry["delta"].append(values[-1] - values[0])
            entry["min_after_start"].append(min(values[1:]) if len(values) > 1 else values[0])
    metrics = {}
    for key, entry in per_key.items():
        if len(entry["start"]) != len(run_dirs):
            continue
        metrics[key] = {name: _mean_std(vals) for name, vals in entry.items()}
        metrics[key]["per_run"] = {name: vals for name, vals in entry.items()}
    return {"runs": list(run_dirs), "metrics": metrics, "minutes": _mean_std(minutes)}


TIMES = ("step_s", "sample_s", "execute_s", "train_s", "wait_for_rollout_s")


def step_times(run_dirs: Sequence[str], skip: int = 3) -> list[dict]:
    """Per run: the medians of `TIMES` (seconds) over steps > `skip` and the idle shares."""
    out = []
    for d in run_dirs:
        recs = [r for r in read_jsonl(os.path.join(d, "tb"))
                if r["step"] > skip and all(r.get(f"time/{k}") is not None for k in TIMES)]
        if not recs:
            raise ValueError(f"{d}: no step after step {skip} logged {', '.join('time/' + k for k in TIMES)}")
        t = {k: np.array([r[f"time/{k}"] for r in recs]) for k in TIMES}
        share = lambda x: float(np.median(x / t["step_s"]))
        out.append({"run": d, "steps": len(recs), **{k: float(np.median(v)) for k, v in t.items()},
                    "idle": {"trainer": share(t["wait_for_rollout_s"]),
                             "sampling": 1 - share(t["sample_s"]), "grading": 1 - share(t["execute_s"]),
                             "sampler": float(np.median(np.maximum(0.0, 1 - (t["sample_s"] + t["execute_s"]) / t["step_s"])))}})
    return out


def timing_markdown(rows: list[dict]) -> str:
    lines = ["| run | steps | step s | sample s | grade s | train s | trainer waits s | idle: trainer / sampling / "
             "grading / sampler |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        i = r["idle"]
        lines.append(f"| {r['run']} | {r['steps']} | {r['step_s']:.3f} | {r['sample_s']:.3f} | {r['execute_s']:.3f} | "
                     f"{r['train_s']:.3f} | {r['wait_for_rollout_s']:.3f} | {i['trainer']:.0%} / {i['sampling']:.0%} / "
                     f"{i['grading']:.0%} / {i['sampler']:.0%} |")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    fmt = lambda ms: f"{ms[0]:.3f} ± {ms[1]:.3f}"
    lines = ["| metric | start (SFT) | end | change | lowest after start |", "|---|---|---|---|---|"]
    for key, m in result["metrics"].items():
        lines.append(f"| {key} | {fmt(m['start'])} | {fmt(m['end'])} | {m['delta'][0]:+.3f} ± {m['delta'][1]:.3f} "
                     f"| {fmt(m['min_after_start'])} |")
    mean, std = result["minutes"]
    lines.append(f"\n{len(result['runs'])} runs; wall time {mean:.1f} ± {std:.1f} min each (mean ± std over runs).")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=summary(__doc__))
    parser.add_argument("--runs", required=True, help="comma-separated run directories")
    parser.add_argument("--keys", default=",".join(DEFAULT_KEYS), help="comma-separated eval metrics")
    parser.add_argument("--out", default=None, help="write the summary as JSON here")
    parser.add_argument("--timing", action="store_true", help="report the stages of the step time instead")
    parser.add_argument("--skip", type=int, default=3, help="with --timing: leave out steps up to this one")
    args = parser.parse_args(argv)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]
    if args.timing:
        result = step_times(split(args.runs), args.skip)
        print(timing_markdown(result))
    else:
        result = summarize(split(args.runs), split(args.keys))
        print(markdown(result))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
