"""Reward over-optimisation: GRPO against a learned reward, with the gold objective logged beside it.

    python -m experiments.reward_model --biases=1.5      # first: a reward model from biased users' choices
    python -m experiments.overoptimization               # the runs against it, the table and the figure (~40 min)
    python -m experiments.overoptimization --table_only  # the table and figure from finished runs

The main job (configs/grpo_synth.py: SFT warm start, then GRPO) with ``reward.source=reward_model``:
the reward is the score of the reward model in ``--reward_model`` (trained on simulated users'
choices by experiments/reward_model.py), while the held-out tests still run on every completion and
are logged as the gold objective (the fraction passed), which pays nothing. Every run keeps the start
policy and logs the KL from it per sequence (``rollout/kl_from_start``: the summed log-ratio of the
sampled tokens, whose mean estimates KL(pi || pi_start)).

Two sweeps through experiments.ablate (resumable: run the same command again), into ``--out``:

  1. ``loss.kl_coef`` over ``--kl_coefs``, with the over-optimisation monitor (`rlcode.feedback.monitor`)
     only logging where it would have flagged (``monitor.action=log``);
  2. ``monitor.action`` over ``--actions`` at ``loss.kl_coef=--monitor_kl``: the monitor acts when it
     flags (raise_kl: multiply the KL coefficient; refresh: label choices on current samples with
     the same simulated users and train the reward model further on them; stop: end the run).

The monitor sees the gold score of ``monitor.audit_size`` random rows per step only (a deployment
labels a small audit sample); the figure and table use the gold of every row. Per run the table
gives the gold peak (a moving average over ``--smooth`` steps) with its step and KL, the final proxy,
gold and KL, and the monitor's first flag and its actions. The figure draws proxy and gold against
sqrt(KL from the start policy), one line per run. JSON and PNG into ``--out`` (or ``--publish``:
results/overoptimization.json, docs/figures/overoptimization.png).
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

NAME = "overoptimization"
SYNTH_CONFIG = BYTE_LEVEL_MAIN_JOB
DEFAULT_REWARD_MODEL = os.path.join("runs", "reward_model", "bias=1.5", "model")
PROXY, GOLD, KL = "rollout/reward_preference", "rollout/pass_fraction", "rollout/kl_from_start"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.overoptimization", description=summary(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reward_model", default=DEFAULT_REWARD_MODEL,
                   help="a reward model directory (RewardModel.save; experiments/reward_model.py writes one per bias)")
    p.add_argument("--kl_coefs", default="0,0.2", help="loss.kl_coef of sweep 1 (comma-separated)")
    p.add_argument("--actions", default="raise_kl", help="monitor.action of sweep 2 (comma-separated; empty: none)")
    p.add_argument("--monitor_kl", type=float, default=0.0, help="loss.kl_coef of sweep 2")
    add_synth_grid_options(p, NAME, steps=50)
    args = p.parse_args(argv)
    try:
        args.kl_list = [float(x) for x in args.kl_coefs.split(",") if x.strip()]
    except ValueError:
        p.error(f"--kl_coefs={args.kl_coefs!r}: expected comma-separated numbers")
    args.action_list = [a.strip() for a in args.actions.split(",") if a.strip()]
    from rlcode.feedback.monitor import MONITOR_ACTIONS  # noqa: PLC0415

    bad = [a for a in args.action_list if a not in MONITOR_ACTIONS or a == "log"]
    if bad:
        p.error(f"--actions: {bad} not among {[a for a in MONITOR_ACTIONS if a != 'log']}")
    if any(k < 0 for k in args.kl_list) or args.monitor_kl < 0:
        p.error("KL coefficients must be >= 0")
    if not args.kl_list and not args.action_list:
        p.error("nothing to run: --kl_coefs and --actions are both empty")
    if args.steps < 1 or args.seeds < 1 or args.smooth < 1:
        p.error("--steps, --seeds and --smooth must be >= 1")
    if not args.table_only and not os.path.isdir(os.path.join(args.reward_model, "params")):
        p.error(f"--reward_model={args.reward_model}: no reward model there (train one with "
                "python -m experiments.reward_model --biases=1.5)")
    return args


def sweeps(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(ablate name, ablate arguments) of each sweep."""
    common = [f"--config={SYNTH_CONFIG}", f"--seeds={args.seeds}", f"--out_dir={args.out}", f"--results_dir={args.out}",
              "--metric=eval/pass@1", "--set=reward.source=reward_model",
              f"--set=reward.reward_model={os.path.abspath(args.reward_model)}", f"--set=train.steps={args.steps}",
              "--set=monitor.enabled=True", "--set=eval.every=0", "--set=eval.at_start=False",
              # Verdicts every 5 steps (the first after 20): the drift is fast without a KL penalty.
              "--set=monitor.window=5", "--set=monitor.cooldown=10", *[f"--set={s}" for s in args.sets]]
    out = []
    if args.kl_list:
        out.append(("kl", [*common, "--name=kl", "--set=monitor.action=log",
                           f"--sweep=loss.kl_coef:{','.join(repr(k) for k in args.kl_list)}"]))
    if args.action_list:
        out.append(("monitor", [*common, "--name=monitor", f"--set=loss.kl_coef={args.monitor_kl!r}",
                                f"--sweep=monitor.action:{','.join(args.action_list)}"]))
    return out


def smooth(values: Sequence[float], width: int) -> np.ndarray:
    """Trailing moving average (the first points average what there is)."""
    x = np.asarray(values, np.float64)
    c = np.cumsum(np.concatenate([[0.0], x]))
    lo = np.maximum(np.arange(1, len(x) + 1) - width, 0)
    return (c[1:] - c[lo]) / (np.arange(1, len(x) + 1) - lo)


def curves(workdir: str) -> dict[str, Any]:
    """Per step: proxy, gold, pass@1, KL, KL coefficient, monitor flags and actions of one run."""
    from rlcode.train.metrics import read_jsonl  # noqa: PLC0415

    rows = [r for r in read_jsonl(os.path.join(workdir, "tb")) if PROXY in r]
    # monitor/action: 1 + the action's index in rlcode.feedback.monitor.MONITOR_ACTIONS; 1 ("log") is a flag only.
    actions = {int(r["step"]) for r in read_jsonl(os.path.join(workdir, "tb")) if r.get("monitor/action", 1.0) > 1.0}
    get = lambda k: [float(r.get(k, float("nan"))) for r in rows]
    return {"step": [int(r["step"]) for r in rows], "proxy": get(PROXY), "gold": get(GOLD),
            "pass@1": get("rollout/pass@1"), "kl": get(KL), "kl_coef": get("rollout/kl_coef"),
            "diverged": get("monitor/diverged"), "actions": sorted(actions)}


def run_summary(label: str, run: dict, width: int) -> dict[str, Any]:
    c = curves(run["workdir"])
    out = {"label": label, "seed": run["seed"], "workdir": run["workdir"], "status": run["status"], "curves": c}
    if not c["step"]:
        return out
    gold, proxy, kl = smooth(c["gold"], width), smooth(c["proxy"], width), smooth(c["kl"], width)
    first = min(width, len(gold)) - 1  # the first full moving average: the peak is searched from there
    peak = first + int(np.argmax(gold[first:]))
    flags = [s for s, d in zip(c["step"], c["diverged"]) if d == 1.0]
    out.update({
        "gold_start": float(gold[first]), "gold_peak": float(gold[peak]),
        "gold_peak_step": c["step"][peak], "kl_at_gold_peak": float(kl[peak]), "gold_final": float(gold[-1]),
        "proxy_start": float(proxy[first]), "proxy_final": float(proxy[-1]),
        "kl_final": float(kl[-1]), "first_flag_step": flags[0] if flags else None, "action_steps": c["actions"],
        "kl_coef_final": c["kl_coef"][-1], "final_eval/pass@1": (run.get("final") or {}).get("metric")})
    return out


def plot(runs: list[dict], width: int, png: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax_p, ax_g) = plt.subplots(1, 2, figsize=(10, 4))
    for run in runs:
        c = run["curves"]
        if not c["step"]:
            continue
        x = np.sqrt(np.maximum(smooth(c["kl"], width), 0.0))
        name = f"{run['label']} s{run['seed']}"
        line, = ax_p.plot(x, smooth(c["proxy"], width), lw=1.2, label=name)
        ax_g.plot(x, smooth(c["gold"], width), lw=1.2, color=line.get_color(), label=name)
        for s in run.get("action_steps") or []:
            if s in c["step"]:
                i = c["step"].index(s)
                ax_g.plot(x[i], smooth(c["gold"], width)[i], marker="v", color=line.get_color(), ms=7)
        if run.get("first_flag_step") in c["step"]:
            i = c["step"].index(run["first_flag_step"])
            ax_g.plot(x[i], smooth(c["gold"], width)[i], marker="o", mfc="none", color=line.get_color(), ms=8)
    ax_p.set_ylabel("proxy: reward-model score")
    ax_g.set_ylabel("gold: fraction of held-out tests passed")
    for ax in (ax_p, ax_g):
        ax.set_xlabel("sqrt(KL from the start policy), nats per sequence")
        ax.grid(alpha=0.3)
    ax_g.legend(fontsize=7, loc="best")
    fig.suptitle(f"GRPO against a learned reward (moving averages of {width} steps; o: the monitor's first flag, "
                 "v: its actions)", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from experiments import ablate  # noqa: PLC0415

    status = 0
    runs = []
    for name, ablate_args in sweeps(args):
        if args.table_only:
            ablate_args = [*ablate_args, "--table_only"]
        status = max(status, ablate.main(ablate_args))
        path = os.path.join(args.out, f"ablate_{name}.json")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            for run in json.load(f)["runs"]:
                runs.append(run_summary(run["label"], run, args.smooth))
    json_path = os.path.join("results" if args.publish else args.out, f"{NAME}.json")
    png_path = os.path.join("docs/figures" if args.publish else args.out, f"{NAME}.png")
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    data = {"command": "python -m experiments.overoptimization " + " ".join(argv if argv is not None else sys.argv[1:]),
            "reward_model": args.reward_model, "smooth": args.smooth, "runs": runs}
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    plot(runs, args.smooth, png_path)
    print(f"| run | seed | gold start -> peak (step, KL) -> final | proxy start -> final | KL final | first flag | actions |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        if "gold_peak" not in r:
            print(f"| {r['label']} | {r['seed']} | (no steps logged: {r['status']}) | | | | |")
            continue
        print(f"| {r['label']} | {r['seed']} | {r['gold_start']:.3f} -> {r['gold_peak']:.3f} ({r['gold_peak_step']}, "
              f"{r['kl_at_gold_peak']:.2f}) -> {r['gold_final']:.3f} | {r['proxy_start']:.3f} -> {r['proxy_final']:.3f} | "
              f"{r['kl_final']:.2f} | {r['first_flag_step']} | {r['action_steps']} |")
    print(f"wrote {json_path}, {png_path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
