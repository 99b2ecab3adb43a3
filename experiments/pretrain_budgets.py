"""Does pretraining help RL here? Pretraining budgets -> the same SFT -> the same GRPO run.

    python -m experiments.pretrain_budgets                         # budgets 0, 300, 1200 steps; seeds 0-2
    python -m experiments.pretrain_budgets --budgets=0,300 --seeds=1 --set=train.steps=50

For each budget B, in steps of configs/pretrain_code.py (``--pretrain_config``; its other fields as
given, or changed with ``--pretrain_set FIELD=VALUE``):

* B = 0: that config's freshly initialised model (its seed), exported as a checkpoint with the
  tokenizer: the same architecture and tokens, no pretraining;
* B = the steps of the committed base (``checkpoints/code_base/pretrain.json``, same config): the
  committed base itself;
* otherwise ``python -m experiments.pretrain --config.train.steps=B`` into ``<out>/pretrain_<B>``
  (a run that started before is resumed, a finished one reused): a full schedule of B steps.

Each base's held-out code loss is measured here, the same way for every budget: bits per byte on
the corpus's held-out split (`rlcode.train.pretrain.heldout_bpb`). Then every base starts the
synthesis job (configs/grpo_synth.py with ``base=<its directory>``: SFT on the demonstrations, then
GRPO, as the main job), for every seed, through ``experiments.ablate`` into ``<out>/rl`` (completed
runs are skipped, started ones resumed; ``--set FIELD=VALUE`` changes every run, e.g. the steps).

Writes ``<out>/pretrain_budgets.json`` (per budget: its directory, steps, held-out bpb; per seed
the SFT start's and the final evaluation's ``eval/`` and ``eval_fresh/`` pass@1 and best-of-n,
from each run's summary.json) and ``<out>/pretrain_budgets.png``: held-out bits per byte against
post-RL pass@1 and best-of-n (n = 16 by default), a point per seed, the seeds' mean joined across
budgets, the SFT start as hollow markers; ``<out>/pretrain_budgets.md``, the table (mean ± std over
the seeds, start -> after RL, every metric). ``--publish`` writes them into results/ and docs/figures/
instead (committed evidence).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from experiments.cli import summary

PRETRAIN_CONFIG = "configs/pretrain_code.py"
SYNTH_CONFIG = "configs/grpo_synth.py"
COMMITTED = os.path.join("checkpoints", "code_base")
NAME = "pretrain_budgets"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.pretrain_budgets", description=summary(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", default="0,300,1200", help="pretraining steps, comma-separated (0 = none)")
    p.add_argument("--seeds", type=int, default=3, help="RL seeds 0..N-1")
    p.add_argument("--out", default=os.path.join("runs", NAME), help="run directory")
    p.add_argument("--pretrain_config", default=PRETRAIN_CONFIG, help="the pretraining config file[:argument]")
    p.add_argument("--pretrain_set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override of configs/pretrain_code.py for every budget (repeatable)")
    p.add_argument("--set", action="append", default=[], dest="sets", metavar="FIELD=VALUE",
                   help="override of configs/grpo_synth.py for every RL run (repeatable)")
    p.add_argument("--committed", default=COMMITTED, help="a published base reused for the budget it was trained for")
    p.add_argument("--publish", action="store_true", help="write the JSON and figure to results/ and docs/figures/")
    args = p.parse_args(argv)
    try:
        args.budget_steps = sorted({int(b) for b in args.budgets.split(",") if b.strip()})
    except ValueError:
        p.error(f"--budgets={args.budgets!r}: expected comma-separated integers")
    if not args.budget_steps or args.budget_steps[0] < 0:
        p.error("--budgets: at least one budget, each >= 0")
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    return args


def pretrain_config(spec: str, overrides: Sequence[str]) -> Any:
    """The pretraining config `spec` (file[:argument]) with `overrides` applied as
    experiments.pretrain applies them."""
    from absl import flags  # noqa: PLC0415

    from experiments.train import parse_config  # noqa: PLC0415

    argv = ["pretrain_budgets", f"--config={spec}", *[f"--config.{o}" for o in overrides]]
    return parse_config(argv, flags.FlagValues(), default=spec)


# The fields of a pretraining config that decide the model it produces.
DECIDING = ("seed", "tokenizer", "model", "data", "optim")


def _same_run(report: dict, cfg: Any, steps: int) -> bool:
    """The base of pretrain.json `report` was trained by `cfg` for `steps` steps: the same
    deciding fields, the same steps and micro-batches (run directory, resumes and checkpointing
    aside)."""
    from rlcode.train.workdir import config_changes  # noqa: PLC0415

    saved = report.get("config") or {}
    want = cfg.to_dict()
    train = saved.get("train") or {}

    def deciding(c: dict) -> dict:
        out = {k: c.get(k) for k in DECIDING}
        out["optim"] = dict(out.get("optim") or {}, total_steps=steps)
        return out

    # Fields added to the config since the base was trained count as the same at their neutral
    # values (`rlcode.train.workdir.ADDED_FIELDS`, as for resuming a run).
    return (report.get("step") == steps and train.get("steps") == steps
            and train.get("microbatches") == want["train"]["microbatches"]
            and not config_changes(deciding(saved), deciding(want)))


def _data_differs(report: dict, committed: str, cfg: Any) -> str | None:
    """Why the committed base in `committed` (its pretrain.json: `report`) was not trained on the
    corpus and tokenizer `cfg` names as they are prepared here, or None when they are the same:
    the splits' files and bytes of the corpus report against the base's, and the tokenizer's
    content. (The same config paths hold a different corpus when, e.g., it was prepared without
    the mined projects.)"""

    def load(path: str) -> Any:
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError) as e:
            return f"unreadable ({e})"

    ours = load(os.path.join(cfg.data.corpus_dir, "report.json"))
    ours = ours.get("splits") if isinstance(ours, dict) else ours
    theirs = (report.get("corpus") or {}).get("splits")
    if ours != theirs:
        return f"the corpus in {cfg.data.corpus_dir} has splits {ours}, the committed base's had {theirs}"
    if cfg.tokenizer != "byte":
        # A directory holds its tokenizer.json, as `rlcode.tokenizer.load_tokenizer` reads it.
        path = os.path.join(cfg.tokenizer, "tokenizer.json") if os.path.isdir(cfg.tokenizer) else cfg.tokenizer
        if load(path) != load(os.path.join(committed, "tokenizer.json")):
            return f"the tokenizer {path} differs from the committed base's"
    return None


def _completed(summary_path: str) -> bool:
    """The run whose summary.json is `summary_path` finished (a missing or torn file: no)."""
    try:
        with open(summary_path, encoding="utf-8") as f:
            return bool(json.load(f).get("completed"))
    except (OSError, ValueError):
        return False


def make_base(steps: int, args: argparse.Namespace, cfg: Any, say=print) -> str:
    """The base directory of budget `steps` (module docstring), created when missing."""
    from rlcode.models.hf import initial_model  # noqa: PLC0415
    from rlcode.tokenizer import job_tokenizer  # noqa: PLC0415
    from rlcode.train import pretrain  # noqa: PLC0415

    report_path = os.path.join(args.committed, pretrain.REPORT)
    if steps > 0 and os.path.exists(report_path):
        with open(report_path, encoding="utf-8") as f:
            report = json.load(f)
        if _same_run(report, cfg, steps):
            why = _data_differs(report, args.committed, cfg)
            if why is not None:
                # Every budget must see the same tokens: the others would be trained and
                # measured on this corpus, the committed base was not.
                raise SystemExit(f"budget {steps}: {why}; prepare the corpus the base was trained on "
                                 "(python -m experiments.prepare_mined, then python -m experiments.prepare_corpus)")
            say(f"budget {steps}: the committed base {args.committed}")
            return args.committed
    workdir = os.path.join(args.out, f"pretrain_{steps}")
    base = os.path.join(workdir, pretrain.BASE_DIR)
    if steps == 0:
        if not os.path.exists(os.path.join(base, pretrain.REPORT)):
            tokenizer = job_tokenizer(cfg.tokenizer, cfg.model.get("init_from", ""))
            pretrain.export_model(initial_model(cfg.model, cfg.seed), tokenizer, base,
                                  {"step": 0, "steps": 0, "tokens": 0.0, "config": cfg.to_dict()})
        say(f"budget 0: the fresh model {base}")
        return base
    summary = os.path.join(workdir, "summary.json")
    if _completed(summary):
        say(f"budget {steps}: pretrained before, {base}")
        return base
    cmd = [sys.executable, "-m", "experiments.pretrain", f"--config={args.pretrain_config}",
           *[f"--config.{o}" for o in args.pretrain_set], f"--config.train.steps={steps}",
           f"--config.workdir={workdir}"]
    if os.path.exists(os.path.join(workdir, "config.json")):
        cmd.append("--config.resume=True")
    say(f"budget {steps}: {shlex.join(cmd)}")
    done = subprocess.run(cmd)
    if done.returncode != 0 or not _completed(summary):
        raise SystemExit(f"budget {steps}: pretraining did not finish (exit {done.returncode}); rerun to resume")
    return base


def measure(base: str, cfg: Any) -> dict[str, float]:
    """The held-out bits per byte of the checkpoint in `base` (float32), on `cfg`'s corpus."""
    from rlcode.models.hf import load_checkpoint  # noqa: PLC0415
    from rlcode.tokenizer import load_tokenizer  # noqa: PLC0415
    from rlcode.train.pretrain import heldout_bpb  # noqa: PLC0415

    model = load_checkpoint(base, dtype="float32")
    return heldout_bpb(model, load_tokenizer(base), cfg.data.corpus_dir, cfg.data.seq_len, cfg.data.eval_batch)


def collect(args: argparse.Namespace, budgets: list[dict], rl_data: dict) -> dict:
    """The JSON: per budget its base, loss and the seeds' start and final evaluations (pass@1 and
    best-of-n, n the evaluation's samples, on eval/ and eval_fresh/)."""
    best = rl_data["best_of"].split("/", 1)[1]  # best_of_<n>
    metrics = [f"{p}/{k}" for p in ("eval", "eval_fresh") for k in ("pass@1", best)]
    by_base = {}
    for run in rl_data["runs"]:
        summary_path = os.path.join(run["workdir"], "summary.json")
        summary = {}
        if os.path.exists(summary_path):
            with open(summary_path, encoding="utf-8") as f:
                summary = json.load(f)
        first, last = summary.get("first_eval") or {}, summary.get("last_eval") or {}
        by_base.setdefault(run["variant"]["base"], []).append({
            "seed": run["seed"], "workdir": run["workdir"], "completed": bool(summary.get("completed")),
            "start": {k: first.get(k) for k in metrics}, "final": {k: last.get(k) for k in metrics},
            "minutes": (summary.get("seconds") or 0.0) / 60})
    for b in budgets:
        b["runs"] = by_base.get(b["base"], [])
    return {"command": "python -m experiments.pretrain_budgets " + shlex.join(args.argv), "budgets": budgets,
            "rl_command": rl_data.get("command"), "metrics": metrics, "best_of": best}


def table(data: dict) -> str:
    """Markdown: per budget its held-out bpb, completed seeds and, for each metric, the mean ± sample
    std over those seeds of the SFT start -> after RL (one seed: its values; none: "—")."""
    from experiments.ablate import mean_std_text  # noqa: PLC0415

    head = ["pretraining steps", "held-out bpb", "seeds"] + [f"{m} start -> end" for m in data["metrics"]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in data["budgets"]:
        done = [r for r in b["runs"] if r["completed"]]
        cells = [str(b["steps"]), f"{b['heldout_bpb']:.3f}", str(len(done))]
        cells += [f"{mean_std_text([r['start'][m] for r in done])} -> {mean_std_text([r['final'][m] for r in done])}"
                  for m in data["metrics"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(data: dict, path: str) -> str:
    """Held-out bpb (x) against post-RL pass@1 and best-of-n (y) on eval/ and eval_fresh/."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    budgets = [b for b in data["budgets"] if any(r["completed"] for r in b["runs"])]
    seeds = max((sum(r["completed"] for r in b["runs"]) for b in budgets), default=0)
    for ax, kind in zip(axes, ("pass@1", data["best_of"])):
        for prefix, color in (("eval", "C0"), ("eval_fresh", "C1")):
            key = f"{prefix}/{kind}"
            xs, means = [], []
            for b in budgets:
                done = [r for r in b["runs"] if r["completed"] and r["final"][key] is not None]
                if not done:
                    continue
                x = b["heldout_bpb"]
                ax.scatter([x] * len(done), [r["final"][key] for r in done], color=color, s=18, alpha=0.6)
                ax.scatter([x] * len(done), [r["start"][key] for r in done], facecolors="none", edgecolors=color,
                           s=18, alpha=0.6)
                xs.append(x)
                means.append(float(np.mean([r["final"][key] for r in done])))
                ax.annotate(f"{b['steps']} steps", (x, means[-1]), textcoords="offset points", xytext=(4, 4),
                            fontsize=7)
            ax.plot(xs, means, color=color, label=f"{prefix}/ after RL (mean)")
        ax.scatter([], [], facecolors="none", edgecolors="grey", label="SFT start (per seed)")
        ax.set_xlabel("held-out code loss of the base (bits per byte)")
        ax.set_ylabel(f"{kind.replace('_', '-')} (fraction of tasks)")
        ax.set_title(f"{kind.replace('_', '-')} after GRPO, {seeds} seed(s) per budget", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = argv
    from experiments import ablate  # noqa: PLC0415
    from rlcode.checks import ConfigError  # noqa: PLC0415

    try:
        cfg = pretrain_config(args.pretrain_config, args.pretrain_set)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    budgets = []
    for steps in args.budget_steps:
        base = make_base(steps, args, cfg)
        loss = measure(base, cfg)
        print(f"budget {steps}: held-out {loss['bpb']:.4f} bits per byte")
        budgets.append({"steps": steps, "base": base, "heldout_bpb": loss["bpb"], "heldout_nll": loss["nll"]})
    rl_dir = os.path.join(args.out, "rl")
    status = ablate.main([f"--config={SYNTH_CONFIG}", f"--sweep=base:{','.join(b['base'] for b in budgets)}",
                          f"--seeds={args.seeds}", f"--name={NAME}", f"--out_dir={rl_dir}", f"--results_dir={rl_dir}",
                          "--metric=eval/pass@1", *[f"--set={s}" for s in args.sets]])
    with open(os.path.join(rl_dir, f"ablate_{NAME}.json"), encoding="utf-8") as f:
        data = collect(args, budgets, json.load(f))
    json_path = os.path.join("results" if args.publish else args.out, f"{NAME}.json")
    png_path = os.path.join("docs/figures" if args.publish else args.out, f"{NAME}.png")
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    plot(data, png_path)
    md = table(data)
    md_path = json_path[:-len(".json")] + ".md"
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(md + "\n")
    print(md)
    print(f"wrote {json_path}, {md_path}, {png_path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
