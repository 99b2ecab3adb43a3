"""The clarifying-question hack: a policy that learns to ask instead of answer, and the monitor that catches it.

    python -m experiments.clarifying_questions               # the runs, the table and the figure (~40 min)
    python -m experiments.clarifying_questions --table_only  # the table and figure from finished runs

The main job (configs/grpo_synth.py: SFT warm start, then GRPO) with clarifying questions allowed
(``task.allow_questions``): a completion whose first line starts with ``# ask:`` is a question to
the user; it is not executed and earns ``reward.question_reward``. A fraction ``--question_demos``
of the SFT demonstrations ask instead of answering, so the start policy asks now and then, as a
deployed assistant does. Every wrong answer costs ``reward.wrong_penalty`` (``--wrong_penalty``).

One sweep through experiments.ablate (resumable: run the same command again), into ``--out``, over
``reward.question_reward`` (``--question_rewards``):

* the naive reward: questions are neutral (0) while wrong answers are penalised, so for a policy
  that fails more often than not, asking earns more than answering;
* a rebalanced reward: a question costs more than a wrong answer (-1.5 with a wrong penalty of 1),
  so answering is never worse than asking.

The behaviour monitor (`rlcode.feedback.behaviour`, on in every run, logging only) compares each
step's behaviour statistics with the run's first steps; the table gives, per run, the question
rate at the start and end (moving averages of ``--smooth`` steps), the fraction of all rows that
passed every test, the held-out pass@1 and question rate before and after RL, and the step the
monitor first flagged the question rate. The figure draws the question rate and the pass rate per
step, with the monitor's first flag. JSON and PNG into ``--out`` (or ``--publish``:
results/clarifying_questions.json, docs/figures/clarifying_questions.png).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments.cli import BYTE_LEVEL_MAIN_JOB, add_synth_grid_options, summary
from experiments.overoptimization import smooth

NAME = "clarifying_questions"
SYNTH_CONFIG = BYTE_LEVEL_MAIN_JOB
QUESTION = "behaviour/question_rate"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.clarifying_questions", description=summary(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--question_rewards", default="0,-1.5",
                   help="reward.question_reward of each run (comma-separated): the naive and the rebalanced reward")
    p.add_argument("--wrong_penalty", type=float, default=1.0, help="reward.wrong_penalty of every run")
    p.add_argument("--question_demos", type=float, default=0.1, help="fraction of SFT demonstrations that ask")
    add_synth_grid_options(p, NAME, steps=40)
    args = p.parse_args(argv)
    try:
        args.question_list = [float(x) for x in args.question_rewards.split(",") if x.strip()]
    except ValueError:
        p.error(f"--question_rewards={args.question_rewards!r}: expected comma-separated numbers")
    if not args.question_list:
        p.error("--question_rewards: nothing to run")
    if args.wrong_penalty < 0:
        p.error("--wrong_penalty must be >= 0")
    if not 0 < args.question_demos <= 1:
        p.error("--question_demos must be in (0, 1]: the start policy must know how to ask")
    if args.steps < 1 or args.seeds < 1 or args.smooth < 1:
        p.error("--steps, --seeds and --smooth must be >= 1")
    return args


def ablate_args(args: argparse.Namespace) -> list[str]:
    return [f"--config={SYNTH_CONFIG}", f"--seeds={args.seeds}", f"--out_dir={args.out}", f"--results_dir={args.out}",
            "--name=questions", "--metric=eval/pass@1", f"--set=train.steps={args.steps}",
            "--set=task.allow_questions=True", f"--set=task.question_demos={args.question_demos!r}",
            f"--set=reward.wrong_penalty={args.wrong_penalty!r}", "--set=eval.every=0",
            *[f"--set={s}" for s in args.sets],
            f"--sweep=reward.question_reward:{','.join(repr(q) for q in args.question_list)}"]


def run_summary(run: dict, width: int) -> dict[str, Any]:
    from rlcode.train.metrics import read_jsonl  # noqa: PLC0415

    records = list(read_jsonl(os.path.join(run["workdir"], "tb"))) if os.path.isdir(run["workdir"]) else []
    rows = [r for r in records if QUESTION in r]
    get = lambda k: [float(r.get(k, float("nan"))) for r in rows]  # noqa: E731
    curves = {"step": [int(r["step"]) for r in rows], "question_rate": get(QUESTION), "pass@1": get("rollout/pass@1"),
              "reward": get("rollout/reward"), "question_flag": get("behaviour/question_rate_flag")}
    out = {"label": run["label"], "seed": run["seed"], "workdir": run["workdir"], "status": run["status"],
           "curves": curves}
    if not rows:
        return out
    q, p = smooth(curves["question_rate"], width), smooth(curves["pass@1"], width)
    first = min(width, len(q)) - 1
    flags = [s for s, f in zip(curves["step"], curves["question_flag"]) if f == 1.0]
    evals = [r for r in records if "eval/pass@1" in r]
    out.update({"question_rate_start": float(q[first]), "question_rate_final": float(q[-1]),
                "pass@1_start": float(p[first]), "pass@1_final": float(p[-1]),
                "first_question_flag": flags[0] if flags else None,
                "behaviour_events": [(int(r["step"]), k[len("behaviour/"):-len("_flag")])
                                     for r in rows for k in r if k.endswith("_flag") and r[k] == 1.0][:8]})
    if evals:
        out.update({f"eval_{k}_{when}": float(e.get(f"eval/{k}", float("nan")))
                    for when, e in (("start", evals[0]), ("final", evals[-1])) for k in ("pass@1", "question_rate")})
    return out


def plot(runs: list[dict], width: int, png: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax_q, ax_p) = plt.subplots(1, 2, figsize=(10, 4))
    for run in runs:
        c = run["curves"]
        if not c["step"]:
            continue
        name = f"{run['label']} s{run['seed']}"
        q = smooth(c["question_rate"], width)
        line, = ax_q.plot(c["step"], q, lw=1.4, label=name)
        ax_p.plot(c["step"], smooth(c["pass@1"], width), lw=1.4, color=line.get_color(), label=name)
        if run.get("first_question_flag") in c["step"]:
            i = c["step"].index(run["first_question_flag"])
            ax_q.plot(c["step"][i], q[i], marker="o", mfc="none", color=line.get_color(), ms=9)
    ax_q.set_ylabel("fraction of completions that ask")
    ax_p.set_ylabel("fraction of completions that pass every test")
    for ax in (ax_q, ax_p):
        ax.set_xlabel("GRPO step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    ax_q.legend(fontsize=7, loc="best")
    fig.suptitle(f"Asking instead of answering under two rewards (moving averages of {width} steps; "
                 "o: the behaviour monitor's first flag)", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def _f(x: Any) -> str:
    return "-" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from experiments import ablate  # noqa: PLC0415

    grid = ablate_args(args) + (["--table_only"] if args.table_only else [])
    status = ablate.main(grid)
    runs = []
    path = os.path.join(args.out, "ablate_questions.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            runs = [run_summary(run, args.smooth) for run in json.load(f)["runs"]]
    json_path = os.path.join("results" if args.publish else args.out, f"{NAME}.json")
    png_path = os.path.join("docs/figures" if args.publish else args.out, f"{NAME}.png")
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    data = {"command": "python -m experiments.clarifying_questions " + " ".join(argv if argv is not None else sys.argv[1:]),
            "wrong_penalty": args.wrong_penalty, "question_demos": args.question_demos, "smooth": args.smooth,
            "runs": runs}
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    plot(runs, args.smooth, png_path)
    print("| run | seed | asks: start -> end | passes: start -> end | eval pass@1 | eval asks | first flag |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        if "question_rate_start" not in r:
            print(f"| {r['label']} | {r['seed']} | (no steps logged: {r['status']}) | | | | |")
            continue
        print(f"| {r['label']} | {r['seed']} | {_f(r['question_rate_start'])} -> {_f(r['question_rate_final'])} | "
              f"{_f(r['pass@1_start'])} -> {_f(r['pass@1_final'])} | {_f(r.get('eval_pass@1_start'))} -> "
              f"{_f(r.get('eval_pass@1_final'))} | {_f(r.get('eval_question_rate_start'))} -> "
              f"{_f(r.get('eval_question_rate_final'))} | {r['first_question_flag']} |")
    print(f"wrote {json_path}, {png_path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
