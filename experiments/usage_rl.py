"""Real-time RL from usage logs, on a simulated deployment: gated releases and their A/B tests.

    python -m experiments.usage_rl                 # the run, the table and the figure
    python -m experiments.usage_rl --report_only   # the table and figure from the finished run

Runs the usage job (configs/usage_rl.py, `rlcode.train.usage`) into ``<out>/run``: the main job's
SFT policy is served to simulated users with hidden preferences; every step the trainer reads the
settled interactions of the usage log (torn and duplicated records, late and out-of-order
outcome events included), rewards them from their outcomes, corrects for the served version with
truncated importance sampling, updates, and every 5 steps evaluates the candidate on the fixed
held-out suite and publishes it only if it passes the regression gate.

Then it reads the log as an analyst would and reports:

* the gate: each evaluated candidate's fixed-suite pass@1, the live version's, and whether it was
  published;
* the A/B test of each release: the requests served while the new version and its predecessor
  were both live (assigned at random per request), with acceptance rate, edit persistence
  (accepted edits kept), follow-up rate and latency per version and the difference with 95%
  intervals (Newcombe's hybrid score interval for the rates);
* the log's hygiene: torn and duplicate records skipped, late and orphan outcomes, stale rows
  rejected.

JSON and PNG into ``--out`` (or ``--publish``: results/usage_rl.json, docs/figures/usage_rl.png).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments.cli import PUBLISH_HELP, fail, summary
from experiments.overoptimization import smooth

NAME = "usage_rl"
CONFIG = "configs/usage_rl.py"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.usage_rl", description=summary(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=80, help="RL steps (one batch of settled interactions each)")
    p.add_argument("--smooth", type=int, default=5, help="steps per moving average in the figure")
    p.add_argument("--set", action="append", default=[], dest="sets", metavar="FIELD=VALUE",
                   help=f"override of {CONFIG} (repeatable), e.g. --set usage.gate_margin=0.02")
    p.add_argument("--out", default=os.path.join("runs", NAME), help="directory of the run, table and figure")
    p.add_argument("--report_only", action="store_true", help="no run: report the finished run in <out>/run")
    p.add_argument("--publish", action="store_true", help=PUBLISH_HELP)
    args = p.parse_args(argv)
    if args.steps < 1 or args.smooth < 1:
        p.error("--steps and --smooth must be >= 1")
    for s in args.sets:
        if "=" not in s:
            p.error(f"--set {s!r}: expected FIELD=VALUE")
    return args


def train(workdir: str, args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "experiments.train", f"--config={CONFIG}", f"--config.workdir={workdir}",
           f"--config.train.steps={args.steps}", *[f"--config.{s}" for s in args.sets]]
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)


# ------------------------------------------------------------------------------ the report


def _ci(x: tuple[float, float]) -> list[float]:
    return [float(x[0]), float(x[1])]


def report(workdir: str) -> dict[str, Any]:
    from rlcode.feedback import ab, registry  # noqa: PLC0415
    from rlcode.train.metrics import read_jsonl  # noqa: PLC0415
    from rlcode.feedback.usage_log import read_log  # noqa: PLC0415
    from rlcode.train.usage import log_key, paths  # noqa: PLC0415

    import ml_collections  # noqa: PLC0415

    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
        cfg = ml_collections.ConfigDict(json.load(f))
    cfg.workdir = workdir  # where the run is now
    log_path, root = paths(cfg)
    records = list(read_jsonl(os.path.join(workdir, "tb")))
    steps = [r for r in records if "usage/reward" in r]
    get = lambda rs, k: [float(r.get(k, float("nan"))) for r in rs]  # noqa: E731
    curves = {"step": [int(r["step"]) for r in steps], "reward": get(steps, "usage/reward"),
              "accepted": get(steps, "usage/accepted_rate"), "kept": get(steps, "usage/kept_rate"),
              "followup": get(steps, "usage/followup_rate"), "staleness": get(steps, "usage/staleness_mean"),
              "is_weight_max": get(steps, "train/is_weight_max"), "hours": get(steps, "deployment/time_h")}
    gates = [{"step": int(r["step"]), "score": r["gate/score"], "live_version": int(r["gate/live_version"]),
              "live_score": r["gate/live_score"], "published": bool(r["gate/published"])}
             for r in records if "gate/score" in r]
    rows, counts = read_log(log_path, float(cfg.usage.settle_s), log_key(cfg))
    tests = []
    for period in ab.rollout_periods(rows):
        c = ab.compare(period["rows_a"], period["rows_b"])
        tests.append({"a": period["a"], "b": period["b"], "start_h": period["start"] / 3600,
                      "end_h": period["end"] / 3600 if math.isfinite(period["end"]) else None,
                      "n_a": c["n"]["a"], "n_b": c["n"]["b"],
                      **{m: {"a": c[m]["a"], "b": c[m]["b"], "diff": c[m]["diff"], "diff_ci": _ci(c[m]["diff_ci"])}
                         for m in ("acceptance", "persistence", "followup", "latency")}})
    last = steps[-1] if steps else {}
    hygiene = {"records": counts["records"], "interactions": counts["interactions"], "torn": counts["torn"],
               "duplicates": counts["duplicates"], "unsettled_at_end": counts["unsettled_at_end"],
               **{k: last.get(f"usage/{k}") for k in ("late_outcomes", "orphan_outcomes", "stale_rejected")}}
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        run = json.load(f)
    return {"workdir": workdir, "completed": run["completed"], "steps": run["steps_done"], "curves": curves,
            "gates": gates, "releases": [{k: h[k] for k in ("version", "score", "delta")} for h in registry.history(root)],
            "ab_tests": tests, "log": hygiene, "minutes": round(run["seconds"] / 60, 1)}


def plot(data: dict, width: int, png: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax_g, ax_u, ax_ab) = plt.subplots(1, 3, figsize=(15, 4.2))
    g = data["gates"]
    if g:
        ax_g.plot([x["step"] for x in g], [x["live_score"] for x in g], drawstyle="steps-post", color="0.4",
                  label="live version")
        for ok, marker, label in ((True, "o", "candidate: published"), (False, "x", "candidate: kept out by the gate")):
            pts = [x for x in g if x["published"] == ok]
            if pts:
                ax_g.plot([x["step"] for x in pts], [x["score"] for x in pts], marker, ms=7, mfc="none" if ok else None,
                          label=label)
    ax_g.set_xlabel("RL step")
    ax_g.set_ylabel("fixed-suite pass@1 (fresh tasks, 8 samples each)")
    ax_g.set_title("Regression gate", fontsize=9)
    ax_g.legend(fontsize=7)
    c = data["curves"]
    if c["step"]:
        for key, label in (("accepted", "accepted"), ("kept", "kept after 30 min"), ("followup", "dissatisfied follow-up")):
            ax_u.plot(c["step"], smooth(c[key], width), lw=1.4, label=label)
    ax_u.set_xlabel("RL step")
    ax_u.set_ylabel(f"fraction of the batch's interactions ({width}-step mean)")
    ax_u.set_ylim(-0.02, 1.02)
    ax_u.set_title("Outcomes of the interactions trained on", fontsize=9)
    ax_u.legend(fontsize=7)
    tests = data["ab_tests"]
    for j, (metric, label) in enumerate((("acceptance", "acceptance"), ("persistence", "persistence"),
                                         ("followup", "follow-up"))):
        xs = np.arange(len(tests)) + (j - 1) * 0.25
        d = [t[metric]["diff"] for t in tests]
        lo = [t[metric]["diff"] - t[metric]["diff_ci"][0] for t in tests]
        hi = [t[metric]["diff_ci"][1] - t[metric]["diff"] for t in tests]
        ax_ab.errorbar(xs, d, yerr=[lo, hi], fmt="o", ms=4, capsize=3, label=label)
    ax_ab.axhline(0, color="0.5", lw=0.8)
    ax_ab.set_xticks(np.arange(len(tests)), [f"v{t['a']}->v{t['b']}" for t in tests], fontsize=7, rotation=30)
    ax_ab.set_xlabel("release (A -> B)")
    ax_ab.set_ylabel("B - A, with 95% interval")
    ax_ab.set_title("A/B test of each release", fontsize=9)
    ax_ab.legend(fontsize=7)
    for ax in (ax_g, ax_u, ax_ab):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def _f(x: Any, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def table(data: dict) -> str:
    lines = ["| release | requests A / B | acceptance A -> B (diff, 95% CI) | persistence A -> B (diff, 95% CI) | "
             "follow-up A -> B (diff, 95% CI) |", "|---|---|---|---|---|"]
    for t in data["ab_tests"]:
        cell = lambda m: (f"{_f(t[m]['a'], 2)} -> {_f(t[m]['b'], 2)} ({_f(t[m]['diff'], 2)}, "  # noqa: E731
                          f"[{_f(t[m]['diff_ci'][0], 2)}, {_f(t[m]['diff_ci'][1], 2)}])")
        lines.append(f"| v{t['a']} -> v{t['b']} | {t['n_a']} / {t['n_b']} | {cell('acceptance')} | "
                     f"{cell('persistence')} | {cell('followup')} |")
    return "\n".join(lines)


def notes(data: dict) -> str:
    """What the run says, for the figure's caption: the gate's decisions, the A/B table, the log."""
    gates = data["gates"]
    kept_out = [g["step"] for g in gates if not g["published"]]
    released = [g["step"] for g in gates if g["published"] and g["step"] > 0]
    return (f"{data['steps']} steps; released at steps {released or 'none'}, kept out at steps {kept_out or 'none'}; "
            f"fixed-suite pass@1 {_f(gates[0]['score']) if gates else '-'} at the start, "
            f"{_f(gates[-1]['live_score']) if gates else '-'} live at the end.\n\n" + table(data) + "\n\nLog: "
            + ", ".join(f"{k} {v}" for k, v in data["log"].items()))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.publish and (args.sets or args.out != os.path.join("runs", NAME)):
        fail("--publish writes the documented run's results: drop --set/--out (or drop --publish)")
    workdir = os.path.join(args.out, "run")
    if not args.report_only:
        if os.path.exists(os.path.join(workdir, "summary.json")):
            print(f"{workdir} holds a finished run: reporting it (remove it to run again)")
        elif os.path.exists(workdir):
            fail(f"{workdir} holds an unfinished run, which the usage job cannot resume: remove it to run again")
        elif train(workdir, args) != 0:
            fail(f"the usage job failed (see its output above); {workdir} keeps what it wrote")
    if not os.path.exists(os.path.join(workdir, "summary.json")):
        fail(f"no finished run in {workdir}")
    data = report(workdir)
    data["command"] = "python -m experiments.usage_rl " + " ".join(argv if argv is not None else sys.argv[1:])
    data["smooth"] = args.smooth
    json_path = os.path.join("results" if args.publish else args.out, f"{NAME}.json")
    png_path = os.path.join("docs/figures" if args.publish else args.out, f"{NAME}.png")
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    plot(data, args.smooth, png_path)
    print("gate: " + ", ".join(f"step {x['step']}: {_f(x['score'])} vs live {_f(x['live_score'])} "
                               f"{'published' if x['published'] else 'kept out'}" for x in data["gates"]))
    print(table(data))
    print("log: " + ", ".join(f"{k} {v}" for k, v in data["log"].items()))
    print(f"wrote {json_path}, {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
