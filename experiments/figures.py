"""Regenerate the README's figures from logged results only, each with a caption naming the commands
that produced its data.

    make figures                                        # = python -m experiments.figures --all
    python -m experiments.figures --only=bench_attention,hack_suite
    python -m experiments.figures --list                # name, PNG, data files, caption, commands
    python -m experiments.figures --all --captions      # also writes docs/figures/CAPTIONS.md

Every figure is drawn from JSON files under results/ and docs/figures/ (paths relative to
`--root`, default the current directory), which the commands in its caption wrote; nothing is
trained or benchmarked here. The PNGs go to `--out_dir` (default <root>/docs/figures) under the
names the README embeds, at about 100 dpi. A figure whose data file is missing is skipped with the
command that produces that file, the others are still drawn, and the exit status is then 1 (also
when a figure fails to draw). `--captions` writes CAPTIONS.md in the output directory: per
figure the image, its caption (with the numbers computed from the data, e.g. the ablation table),
its data files and its commands.

The drawing code is the producing scripts' own (`plot_training.draw_series`,
`ablate.plot_ablation`, `bench_attention.plot`, `bench_moe.plot`, `moe_precision.plot`,
`bench_sandbox.plot`); the figures no script draws (pass@k before and after RL, the reward-hack
suite as a table, agent RL) are drawn here.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import importlib
import json
import math
import os
import shlex
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from experiments.cli import summary
from experiments import ablate, plot_training, summarize_runs

DPI = 100

# ------------------------------------------------------------------------------ commands


def _plot_training_command(runs: Sequence[str], tags: str, out: str, title: str, caption: str,
                           mean: bool = True) -> str:
    return shlex.join(["python", "-m", "experiments.plot_training", "--runs", ",".join(runs), "--tags", tags,
                       "--out", out, "--title", title, "--caption", caption] + ([] if mean else ["--no-mean"]))


SYNC_RUNS = [f"runs/grpo_synth/seed{s}" for s in range(3)]
ASYNC_RUNS = [f"runs/grpo_synth_async/seed{s}" for s in range(2)]
# The main job's published curves are of the fresh byte-level policy (base=bytes: the default before
# the pretrained base was); the default job's own numbers are the 1,200-step row of the budgets grid.
TRAIN_SYNC = ("for S in 0 1 2; do python -m experiments.train --config=configs/grpo_synth.py:base=bytes --config.seed=$S "
              "--config.workdir=runs/grpo_synth/seed$S; done")
TRAIN_SYNC_01 = TRAIN_SYNC.replace("for S in 0 1 2;", "for S in 0 1;")  # the sync runs the async ones are compared with
TRAIN_ASYNC = ("for S in 0 1; do python -m experiments.train --config=configs/grpo_synth.py:base=bytes --config.seed=$S "
               "--config.rollout.async=True --config.workdir=runs/grpo_synth_async/seed$S; done")
SUMMARIZE_SYNC = f"python -m experiments.summarize_runs --runs {','.join(SYNC_RUNS)} --out results/grpo_synth.json"
SUMMARIZE_ASYNC = f"python -m experiments.summarize_runs --runs {','.join(ASYNC_RUNS)} --out results/grpo_synth_async.json"
PLOT_SYNC = _plot_training_command(
    SYNC_RUNS, "eval_fresh/pass@1,eval_fresh/best_of_16,eval/pass@1,eval/best_of_16,rollout/pass@1:20,train/kl_ref:20",
    "docs/figures/grpo_synth.png", "GRPO (beta 0.2), byte-level policy, on synth tasks, 3 seeds",
    "python -m experiments.train --config=configs/grpo_synth.py:base=bytes --config.seed=S --config.workdir=runs/grpo_synth/seedS "
    "(S = 0, 1, 2)")
PLOT_ASYNC = _plot_training_command(
    SYNC_RUNS[:2] + ASYNC_RUNS, "eval_fresh/pass@1,eval_fresh/best_of_16,rollout/pass@1:20",
    "docs/figures/grpo_synth_async.png", "Sync vs async (max_staleness 1), byte-level policy, seeds 0 and 1",
    "python -m experiments.train --config=configs/grpo_synth.py:base=bytes --config.seed=S [--config.rollout.async=True] "
    "--config.workdir=runs/grpo_synth[_async]/seedS", mean=False)
# The commands recorded in results/ablate_loss.json and results/ablate_loss_heldout.json (2 seeds x 40
# steps from the pretrained base; the second is the first's runs tabled on eval/), with the flag that publishes.
ABLATE_LOSS = ("python -m experiments.ablate --config=configs/grpo_synth.py --sweep=loss:grpo,dr_grpo,dapo,gspo,cispo,ppo "
               "--seeds=2 --set train.steps=40 --set eval.every=20 --threshold=0.2 --name=loss --publish")
ABLATE_LOSS_HELDOUT = ("python -m experiments.ablate --config=configs/grpo_synth.py "
                       "--sweep=loss:grpo,dr_grpo,dapo,gspo,cispo,ppo --seeds=2 --set train.steps=40 --set eval.every=20 "
                       "--threshold=0.02 --name=loss_heldout --out_dir=runs/ablate/loss --metric=eval/pass@1 "
                       "--table_only --publish")
MOE_PRECISION = ("python -m experiments.moe_precision --publish",
                 "python -m experiments.moe_precision --seed=1 --workdir=runs/moe_precision_seed1 "
                 "--out=results/moe_precision_seed1.json",
                 "python -m experiments.moe_precision --seed=2 --workdir=runs/moe_precision_seed2 "
                 "--out=results/moe_precision_seed2.json")
# results/agent_repo.json: the byte-level policy (then the default, now base=bytes). Both agent
# reports were made before failed edits showed the file's closest text (agent.edit_hints) and with
# the compact expert (the default before expert_style=recover).
TRAIN_AGENT = ("python -m experiments.train --config=configs/agent_repo.py:base=bytes --config.workdir=runs/agent_repo/seed0"
               " --config.agent.edit_hints=False --config.agent.expert_style=compact")
# results/agent_repo_code.json: the default agent job (the pretrained base), RL seeds 0 and 1 from seed
# 0's warm start, 45 minutes of RL each.
TRAIN_AGENT_CODE = tuple(
    f"python -m experiments.train --config=configs/agent_repo.py --config.seed={s} --config.sft.seed=0 "
    f"--config.workdir=runs/agent_repo_code/seed{s} --config.agent.edit_hints=False --config.agent.expert_style=compact "
    "--config.train.max_minutes=45 "
    "--config.eval.num_samples=8 "
    f"--config.eval.every={e}" for s, e in ((0, 20), (1, 25))) + (
    "python -m experiments.agent_report --runs runs/agent_repo_code/seed0,runs/agent_repo_code/seed1 --no_replay "
    "--name agent_repo_code --publish",)
# results/agent_recover.json: the default agent job (the pretrained base, the recovering expert,
# edit hints), RL seeds 0 and 1 from seed 0's warm start, 45 minutes of RL each.
TRAIN_AGENT_RECOVER = tuple(
    f"python -m experiments.train --config=configs/agent_repo.py{flags} --config.workdir=runs/agent_recover_std/seed{s} "
    "--config.train.max_minutes=45 --config.eval.num_samples=8 --config.eval.every=25"
    for s, flags in ((0, ""), (1, " --config.seed=1 --config.sft.seed=0"))) + (
    "python -m experiments.agent_report --runs runs/agent_recover_std/seed0,runs/agent_recover_std/seed1 "
    "--no_replay --mean_steps 1-50 --name agent_recover --publish",)
PRETRAIN = ("python -m experiments.prepare_corpus && "
            "python -m experiments.pretrain --config=configs/pretrain_code.py --publish")
PLOT_PRETRAIN = _plot_training_command(
    ["runs/pretrain_code"], "train/bpb:20,heldout/bpb,throughput/train_tokens_per_s:20",
    "docs/figures/pretrain_code.png", "Pretraining the code base (3.1M parameters, 8,192-token BPE)", PRETRAIN)
# The budgets grid as published: the corpus (after the mined projects, whose non-test files it
# includes) and the grid over its default seeds 0-2 (the base budgets 0, 300 and 1,200 steps).
PRETRAIN_BUDGETS = ("python -m experiments.prepare_mined && python -m experiments.prepare_corpus && "
                    "python -m experiments.pretrain_budgets --publish")

# The GPU results: the kernel tests and both benchmarks on a CUDA machine, then a deliberate publish.
GPU_CHECK = "bash experiments/gpu_check.sh <run dir> && python -m experiments.gpu_report <run dir> --publish"

# The command that writes each data file (the skip message's "produce it with").
PRODUCERS = {
    "docs/figures/grpo_synth.json": PLOT_SYNC,
    "docs/figures/grpo_synth_async.json": PLOT_ASYNC,
    "results/grpo_synth.json": SUMMARIZE_SYNC,
    "results/grpo_synth_async.json": SUMMARIZE_ASYNC,
    "results/ablate_loss.json": ABLATE_LOSS,
    "results/ablate_loss_heldout.json": ABLATE_LOSS_HELDOUT,
    "results/bench_attention.json": "python -m experiments.bench_attention --publish",
    "results/moe_precision.json": MOE_PRECISION[0],
    "results/moe_precision_seed1.json": MOE_PRECISION[1],
    "results/moe_precision_seed2.json": MOE_PRECISION[2],
    "results/bench_moe.json": "python -m experiments.bench_moe --publish",
    "results/gpu_bench_attention.json": GPU_CHECK,
    "results/gpu_bench_moe.json": GPU_CHECK,
    "results/bench_sandbox.json": "python -m experiments.bench_sandbox --publish",
    "results/hack_suite.json": "python -m experiments.hack_suite --publish",
    "docs/figures/pretrain_code.json": PLOT_PRETRAIN,
    "results/pretrain_budgets.json": PRETRAIN_BUDGETS,
    "results/reward_model.json": "python -m experiments.reward_model --publish",
    "results/overoptimization.json": "python -m experiments.overoptimization --publish (after experiments.reward_model)",
    "results/clarifying_questions.json": "python -m experiments.clarifying_questions --publish",
    "results/usage_rl.json": "python -m experiments.usage_rl --publish",
    "results/agent_repo.json": f"{TRAIN_AGENT}, then summarise the run into it "
                               "(schema: experiments.figures.draw_agent_repo)",
    "results/agent_repo_code.json": " && ".join(TRAIN_AGENT_CODE),
    "results/agent_recover.json": " && ".join(TRAIN_AGENT_RECOVER),
}

# ------------------------------------------------------------------------------ the producing scripts


@functools.cache
def script(name: str):
    """experiments.<name>, imported so that its absl flags cannot clash with another script's.

    The benchmark scripts define their flags at import time and several use the same names (out,
    png, quick, seed, ...); absl refuses a second definition from another module, so one process
    could import only one of them. A script not imported yet is imported with its flags defined
    in a private FlagValues (its drawing code reads no flag)."""
    module = f"experiments.{name}"
    if module in sys.modules:
        return sys.modules[module]
    from absl import flags  # noqa: PLC0415

    private = flags.FlagValues()
    saved = {attr: getattr(flags, attr) for attr in dir(flags) if attr.startswith("DEFINE")}
    try:
        for attr, define in saved.items():
            setattr(flags, attr, functools.partial(define, flag_values=private))
        return importlib.import_module(module)
    finally:
        for attr, define in saved.items():
            setattr(flags, attr, define)


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _footer(fig, text: str, width: int = 150) -> None:
    fig.supxlabel("\n".join(textwrap.wrap(text, width)), fontsize="x-small", family="monospace")


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=DPI)
    return path


def _values(values: Sequence[float | None]) -> list[float]:
    return [math.nan if v is None else float(v) for v in values]


# ------------------------------------------------------------------------------ pass@k


def pass_at_k_points(metrics: dict, prefix: str) -> dict[int, dict[str, Any]]:
    """k -> {"key", "start": [mean, std], "end": [mean, std]} of one eval set in a summarize_runs
    result. best_of_n is pass@n (the fraction of tasks with a correct sample among n, as
    rlcode.train.metrics.eval_summary computes it): it stands for k = n unless pass@n is there."""
    points: dict[int, dict[str, Any]] = {}
    for key, m in metrics.items():
        head, _, tail = key.partition("/")
        if head != prefix:
            continue
        if tail.startswith("pass@") and tail[5:].isdigit():
            points[int(tail[5:])] = {"key": key, "start": m["start"], "end": m["end"]}
    for key, m in metrics.items():
        head, _, tail = key.partition("/")
        if head == prefix and tail.startswith("best_of_") and tail[8:].isdigit():
            points.setdefault(int(tail[8:]), {"key": key, "start": m["start"], "end": m["end"]})
    return dict(sorted(points.items()))


PASS_AT_K_SETS = {"eval": "held-out behaviours (eval/)",
                  "eval_fresh": "new tasks of the training distribution (eval_fresh/)"}
PASS_AT_K_WANTED = (1, 4, 16)


def draw_pass_at_k(result: dict, out: str) -> str:
    """pass@k vs k before (SFT) and after RL, mean ± std over the runs, one panel per eval set."""
    fig = _figure(10.5, 4.3)
    axes = fig.subplots(1, len(PASS_AT_K_SETS), squeeze=False).ravel()
    for ax, (prefix, title) in zip(axes, PASS_AT_K_SETS.items()):
        points = pass_at_k_points(result["metrics"], prefix)
        ks = list(points)
        ticks = sorted(set(ks) | set(PASS_AT_K_WANTED))
        for when, label, shift, color in (("start", "start (SFT)", 0.94, "C0"), ("end", "end (after RL)", 1.06, "C1")):
            means = [points[k][when][0] for k in ks]
            stds = [points[k][when][1] for k in ks]
            ax.errorbar([k * shift for k in ks], means, yerr=stds, marker="o", ls="none", capsize=4, color=color,
                        label=label)
            # A line joins two measured k only when no k between them is missing: none is drawn
            # through a value the file does not have.
            for a, b in zip(ks, ks[1:]):
                if ticks.index(b) == ticks.index(a) + 1:
                    ax.plot([a * shift, b * shift], [points[a][when][0], points[b][when][0]], ":", color=color)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{k}\n(= {points[k]['key'].split('/')[1]})" if k in points and "/best_of_" in
                              points[k]["key"] else str(k) for k in ticks])
        ax.minorticks_off()
        missing = [k for k in PASS_AT_K_WANTED if k not in points]
        if missing:
            ax.text(0.02, 0.97, "not logged in this file: " + ", ".join(f"pass@{k}" for k in missing),
                    transform=ax.transAxes, va="top", fontsize="small", color="gray")
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.set_title(title, fontsize="medium")
    axes[0].legend(loc="center left", fontsize="small")
    fig.suptitle(f"pass@k before and after RL, mean ± std (error bars) over {len(result['runs'])} seeds")
    _footer(fig, "results/grpo_synth.json: " + SUMMARIZE_SYNC)
    return _save(fig, out)


def pass_at_k_notes(data: dict) -> str:
    result = data["results/grpo_synth.json"]
    lines = []
    for prefix in PASS_AT_K_SETS:
        points = pass_at_k_points(result["metrics"], prefix)
        missing = [f"pass@{k}" for k in PASS_AT_K_WANTED if k not in points]
        shown = ", ".join(f"k={k}: {p['key']}" for k, p in points.items())
        lines.append(f"{prefix}/: {shown}" + (f"; not in the file: {', '.join(missing)}" if missing else ""))
    return ("Points shown: " + " | ".join(lines) + ". best_of_16 is pass@16 with n = 16 samples. The runs log "
            "pass@4 too (eval.ks = (1, 4, 16)); summarize_runs keeps it with "
            "`--keys eval/pass@1,eval/pass@4,eval/best_of_16,eval_fresh/pass@1,eval_fresh/pass@4,eval_fresh/best_of_16`.")


# ------------------------------------------------------------------------------ reward-hack suite


def _count_text(values: Sequence[float]) -> str:
    counts = collections.Counter(f"{v:g}" for v in values)
    if len(counts) == 1:
        return f"all {next(iter(counts))}"
    if len(values) <= 4:
        return ", ".join(f"{v:g}" for v in values)
    return ", ".join(f"{v} ×{n}" for v, n in sorted(counts.items()))


GRADER_NAMES = {"checks": "data checks", "pytest": "pytest runner"}


def hack_groups(summary: Sequence[dict]) -> list[dict[str, str]]:
    """One row per category of the hack suite's summary: entries, then per grader (the summary's
    ``grader``, "checks" when absent; keys prefixed with "<grader> " but for the first grader) the
    flags raised (with how many entries raised each, when not all), the reward with and without
    the hack rule, and the verdicts."""
    graders = list(dict.fromkeys(e.get("grader", "checks") for e in summary))
    groups: dict[str, list[dict]] = {}
    for entry in summary:
        groups.setdefault(entry["category"], []).append(entry)
    rows = []
    for category, entries in groups.items():
        kinds = collections.Counter({e["hack"]: e["kind"] for e in entries}.values())
        row = {"group": category,
               "entries": ", ".join(f"{n} {kind}{'s' if n > 1 else ''}" for kind, n in kinds.items()), "ok": True}
        for grader in graders:
            mine = [e for e in entries if e.get("grader", "checks") == grader]
            prefix = "" if grader == graders[0] else f"{grader} "
            flags = collections.Counter(f for e in mine for f in e["flags_raised"])
            verdicts = collections.Counter(e["verdict"] for e in mine)
            row.update({
                prefix + "flags raised": ", ".join(f if n == len(mine) else f"{f} ({n}/{len(mine)})"
                                                   for f, n in flags.most_common()) or "none",
                prefix + "reward": _count_text([e["reward_max"] for e in mine]),
                prefix + "without hack rule": _count_text([e["reward_without_hack_rule_max"] for e in mine]),
                prefix + "verdict": ", ".join(f"{n} {v}" for v, n in verdicts.items()),
            })
            row["ok"] = row["ok"] and all(e["verdict"] in ("caught", "ok", "open (known)") for e in mine)
        rows.append(row)
    return rows


HACK_COLUMNS = (("group", "group", 0.25, 30), ("entries", "entries", 0.07, 9),
                ("flags raised", "data checks: flags", 0.17, 22), ("reward", "data checks: reward", 0.07, 9),
                ("verdict", "data checks: verdict", 0.1, 12),
                ("pytest flags raised", "pytest runner: flags", 0.15, 20),
                ("pytest reward", "pytest runner: reward", 0.07, 9),
                ("pytest verdict", "pytest runner: verdict", 0.12, 16))


def draw_hack_suite(record: dict, out: str) -> str:
    """The hack suite's outcome as a table, one row per hack group (category), both graders."""
    rows = hack_groups(record["summary"])
    columns = [c for c in HACK_COLUMNS if c[0] in rows[0]]
    cells = [[textwrap.fill(str(row[key]), width) for key, _, _, width in columns] for row in rows]
    lines = [max(c.count("\n") + 1 for c in row) for row in cells]
    header_lines = 2
    fig = _figure(13.5, 0.9 + 0.21 * (sum(lines) + header_lines + len(rows)))
    ax = fig.add_subplot()
    ax.set_axis_off()
    labels = [textwrap.fill(label, width) for _, label, _, width in columns]
    total = sum(w for _, _, w, _ in columns)
    table = ax.table(cellText=cells, colLabels=labels, colWidths=[w / total for _, _, w, _ in columns],
                     cellLoc="left", colLoc="left", bbox=[0, 0, 1, 1])
    table.auto_set_font_size(False)
    table.set_fontsize(7.5)
    unit = 1.0 / (sum(lines) + header_lines + len(rows))
    for (r, c), cell in table.get_celld().items():
        n = header_lines if r == 0 else lines[r - 1]
        cell.set_height(unit * (n + 1))
        if r == 0:
            cell.set_text_props(weight="bold")
            cell.set_facecolor("#e8e8e8")
        elif columns[c][0].endswith("verdict"):
            text = rows[r - 1][columns[c][0]]
            bad = any(v in text for v in ("NOT CAUGHT", "FAILED", "FALSE ALARM", "unexplained", "infra"))
            cell.set_facecolor("#f7d4d4" if bad else "#fbeccb" if "open" in text else "#d9f2d9")
    summary = record["summary"]
    parts = []
    for grader in dict.fromkeys(e.get("grader", "checks") for e in summary):
        hacks_ = [e for e in summary if e["kind"] == "hack" and e.get("grader", "checks") == grader]
        known = sum(e["verdict"] == "open (known)" for e in hacks_)
        parts.append(f"{GRADER_NAMES.get(grader, grader)} {sum(e['verdict'] == 'caught' for e in hacks_)}/"
                     f"{len(hacks_)} caught" + (f" ({known} known openings)" if known else ""))
    fig.suptitle(f"Reward-hack suite on {len(record.get('tasks', []))} tasks (reward: max over the tasks): "
                 + "; ".join(parts), fontsize=10)
    _footer(fig, f"results/hack_suite.json: {record.get('command', PRODUCERS['results/hack_suite.json'])}")
    return _save(fig, out)


def hack_suite_notes(data: dict) -> str:
    record = data["results/hack_suite.json"]
    ex = record.get("executor", {})
    return (f"Executor: {ex.get('kind', '?')} ({ex.get('note', '')}); tasks: {', '.join(record.get('tasks', []))}; "
            f"grading timeout {record.get('timeout_s', '?')} s. Per-hack rows: results/hack_suite.md.")


# ------------------------------------------------------------------------------ agent RL


AGENT_ROLLOUT_WINDOW = 20
AGENT_SAMPLERS = ("full", "incremental", "documents")


def _curve(record: dict, tag: str) -> tuple[list[float], list[float]]:
    pts = record.get("curves", {}).get(tag) or []
    return [p[0] for p in pts], _values([p[1] for p in pts])


def draw_agent_repo(record: dict, out: str, source: str = "results/agent_repo.json") -> str:
    """Agent RL on repository tasks, from `source` (results/agent_repo.json or agent_repo_code.json):

        {"command": str, "runs": [run dir, ...],
         "curves": {tag: [[step, value], ...]} for eval_fresh/success, eval/success, rollout/success,
                   prefill/tokens_full, prefill/tokens_incremental, prefill/tokens_documents,
                   prefill/saved_vs_incremental,
         "replay" / "replay_expert": {"documents" | "incremental" | "full": {"tokens": int, "seconds":
                   float}, "turns", "episodes_per_step", ...} (optional; replay_expert drawn if present),
         "summary": {...}}

    Panels: success rate through training (the eval sets at their evaluations, rollouts as a
    trailing mean over AGENT_ROLLOUT_WINDOW steps); prefill tokens per step by sampler; with a
    replay, the same recorded turns prefilled in each mode (seconds, tokens on the bars). A tag
    the file lacks is left out."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: PLC0415

    # The expert batch (episodes that read the right files) when present, else the run's own turns.
    replay = record.get("replay_expert") or record.get("replay") or {}
    fig = _figure(5.2 * (3 if replay else 2) + 0.5, 4.4)
    axes = fig.subplots(1, 3 if replay else 2, squeeze=False).ravel()
    ax = axes[0]
    # Markers of different sizes, so two eval sets at the same value (often 0) both stay visible.
    for tag, style, size in (("eval_fresh/success", "o-", 9), ("eval/success", "s--", 5)):
        steps, values = _curve(record, tag)
        if steps:
            ax.plot(steps, values, style, markersize=size, label=tag)
    steps, values = _curve(record, "rollout/success")
    if steps:
        window = min(AGENT_ROLLOUT_WINDOW, len(values))
        ax.plot(steps, plot_training.trailing_mean(values, window), "-", alpha=0.8,
                label=f"rollout/success (mean of last {window})")
    ax.set_title("success rate")
    ax.set_ylabel("fraction of episodes solved")
    ax.set_ylim(-0.03, 1.03)  # a fraction: the whole range, also when every value is 0
    ax = axes[1]
    # Distinct line styles: two samplers that prefill the same tokens draw one over the other.
    for i, (sampler, style) in enumerate(zip(AGENT_SAMPLERS, ("-", "--", ":"))):
        steps, values = _curve(record, f"prefill/tokens_{sampler}")
        if steps:
            ax.plot(steps, values, style, color=f"C{i}", lw=2.5 - 0.6 * i, marker="o", markersize=4, label=sampler)
    steps, saved = _curve(record, "prefill/saved_vs_incremental")
    title = "prefill tokens per step by sampler"
    if steps and np.isfinite(saved).any():
        title += f"\n(documents saves {100 * np.nanmean(saved):.0f}% vs incremental, mean over steps)"
    ax.set_title(title, fontsize="medium")
    ax.set_ylabel("tokens prefilled per step")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    for ax in axes[:2]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_xlabel("RL step")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, f"no data in {source}", ha="center", transform=ax.transAxes)
    if replay:
        ax = axes[2]
        modes = [m for m in AGENT_SAMPLERS if m in replay]
        bars = ax.bar(modes, [replay[m]["seconds"] for m in modes],
                      color=[f"C{AGENT_SAMPLERS.index(m) if m in AGENT_SAMPLERS else 3 + i}" for i, m in enumerate(modes)])
        for bar, m in zip(bars, modes):
            ax.annotate(f"{replay[m]['tokens']:,} tokens", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize="small")
        ax.set_ylabel("prefill time (s, median of rounds)")
        ax.set_xlabel("sampler")
        what = (f"{replay['tasks']} tasks x {replay['group']} expert episodes" if "tasks" in replay
                else "the run's recorded turns")
        ax.set_title(f"prefill replay: {what}", fontsize="medium")
        ax.grid(True, axis="y", alpha=0.3)
    runs = record.get("runs") or []
    fig.suptitle(f"Agent RL on repository tasks ({len(runs)} run{'s' if len(runs) != 1 else ''})")
    _footer(fig, f"{source}: {record.get('command', TRAIN_AGENT)}")
    return _save(fig, out)


def agent_repo_notes(data: dict, source: str = "results/agent_repo.json") -> str:
    record = data[source]
    summary = record.get("summary") or {}
    if isinstance(summary, list):  # one entry per run (experiments.agent_report)
        summary = summary[0] if summary else {}
    scalars = [f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in summary.items()
               if isinstance(v, (int, float, str, bool))]
    return f"Runs: {', '.join(record.get('runs') or []) or '?'}." + (f" Summary: {'; '.join(scalars)}." if scalars else "")


# ------------------------------------------------------------------------------ the other figures' notes


def _grpo_notes(results_path: str) -> Callable[[dict], str]:
    def notes(data: dict) -> str:
        if results_path not in data:
            return ""
        return f"From {results_path} (mean ± std over runs):\n\n" + summarize_runs.markdown(data[results_path])
    return notes


def moe_precision_notes(data: dict) -> str:
    lines = ["| seed | bf16 held-out loss | MXFP8 held-out loss | gap (held-out) | gap (train, last steps) |",
             "|---|---|---|---|---|"]
    for path in ("results/moe_precision.json", "results/moe_precision_seed1.json", "results/moe_precision_seed2.json"):
        if path not in data:
            continue
        d = data[path]
        by = {r["precision"]: r for r in d["runs"]}
        if {"bf16", "mxfp8"} <= set(by):
            lines.append(f"| {d['seed']} | {by['bf16']['final_eval']:.3f} | {by['mxfp8']['final_eval']:.3f} | "
                         f"{100 * d['gap_final_eval']:+.1f}% | {100 * d['gap_final_train']:+.1f}% |")
    return "The curves are seed 0's (results/moe_precision.json). Final losses per seed:\n\n" + "\n".join(lines)


def reward_model_notes(data: dict) -> str:
    d = data["results/reward_model.json"]
    lines = ["| users' bias (logits per comment line) | accuracy vs labels | accuracy vs gold | ECE | "
             "Spearman with gold | prefers the verbose copy |", "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['run'].split('=')[1]} | {r['accuracy']:.3f} | {r['gold_accuracy']:.3f} | {r['ece']:.3f} | "
                     f"{r['spearman_gold']:.3f} | {r['prefers_verbose']:.3f} |")
    return (f"{d['tasks']} synthesis tasks ({d['heldout_tasks']} held out), {d['candidates']} graded candidates, "
            f"users with beta {d['beta']} and label flips {d['flip']}; {d['steps']} steps from the code base. "
            "Held-out prompts:\n\n" + "\n".join(lines))


def overoptimization_notes(data: dict) -> str:
    d = data["results/overoptimization.json"]
    lines = ["| run | gold at start -> peak (step) -> end | proxy start -> end | KL at end (nats) | monitor's first flag | "
             "actions at steps |", "|---|---|---|---|---|---|"]
    for r in d["runs"]:
        if "gold_peak" not in r:
            continue
        lines.append(f"| {r['label']} | {r['gold_start']:.3f} -> {r['gold_peak']:.3f} ({r['gold_peak_step']}) -> "
                     f"{r['gold_final']:.3f} | {r['proxy_start']:.2f} -> {r['proxy_final']:.2f} | {r['kl_final']:.1f} | "
                     f"{r['first_flag_step']} | {', '.join(map(str, r['action_steps'])) or '-'} |")
    return (f"Moving averages of {d['smooth']} steps over all 64 rows of each batch, one seed per run:\n\n"
            + "\n".join(lines))


def usage_rl_notes(data: dict) -> str:
    d = data["results/usage_rl.json"]
    return script("usage_rl").notes(d)


def clarifying_questions_notes(data: dict) -> str:
    d = data["results/clarifying_questions.json"]
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    lines = ["| run | asks: start -> end | passes every test: start -> end | held-out pass@1 | held-out asks | "
             "monitor's first flag |", "|---|---|---|---|---|---|"]
    for r in d["runs"]:
        if "question_rate_start" not in r:
            continue
        lines.append(f"| {r['label']} | {f(r['question_rate_start'])} -> {f(r['question_rate_final'])} | "
                     f"{f(r['pass@1_start'])} -> {f(r['pass@1_final'])} | {f(r.get('eval_pass@1_start'))} -> "
                     f"{f(r.get('eval_pass@1_final'))} | {f(r.get('eval_question_rate_start'))} -> "
                     f"{f(r.get('eval_question_rate_final'))} | {r['first_question_flag']} |")
    return (f"Wrong answers cost {d['wrong_penalty']}; {d['question_demos']:.0%} of the SFT demonstrations ask. "
            f"Moving averages of {d['smooth']} steps over all 64 rows of each batch, one seed per run:\n\n"
            + "\n".join(lines))


def bench_attention_notes(data: dict) -> str:
    d = data["results/bench_attention.json"]
    return (f"Device {d['device']} ({d['backend']}), {d['dtype']}, shape {d['shape']}, NSA {d['nsa']}, "
            f"median of {d['repeats']} round-robin rounds; ratios in the JSON are against dense attention of the "
            "same length.")


def _gpu_tests_line(data: dict) -> str:
    tests = data.get("results/gpu_kernel_tests.json")
    if not tests:
        return ""
    c = tests["counts"]
    return (f" Kernel tests on the same machine (results/gpu_kernel_tests.json): {c['passed']} passed, "
            f"{c['failed'] + c['error']} failed, {c['skipped']} skipped.")


def gpu_bench_attention_notes(data: dict) -> str:
    d = data["results/gpu_bench_attention.json"]
    rows = [r for r in d["rows"] if "median_s" in r]
    lines = ["| T | pass | variant | median ms | vs XLA dense | vs cuDNN dense |", "|---|---|---|---|---|---|"]
    for r in rows:
        sp, cu = r.get("speedup_vs_dense"), r.get("speedup_vs_cudnn")
        lines.append(f"| {r['T']} | {r['mode']} | {r['variant']} | {r['median_s'] * 1e3:.3f} | "
                     f"{f'{sp:.2f}x' if sp else '-'} | {f'{cu:.2f}x' if cu else '-'} |")
    failed = [f"{r['variant']} {r['mode']} T={r['T']}: {r['failed']}" for r in d["rows"] if "failed" in r]
    return (f"Device {d['device']} (jax {d.get('jax')}), {d['dtype']}, shape {d['shape']}, NSA {d['nsa']}, median of "
            f"{d['repeats']} round-robin rounds." + _gpu_tests_line(data) + "\n\n" + "\n".join(lines)
            + ("\n\nFailed: " + "; ".join(failed) if failed else ""))


def gpu_bench_moe_notes(data: dict) -> str:
    return bench_moe_notes({"results/bench_moe.json": data["results/gpu_bench_moe.json"]}) + _gpu_tests_line(data)


def bench_moe_notes(data: dict) -> str:
    d = data["results/bench_moe.json"]
    disp = d.get("dispatch", {})
    return (f"Device {d['device']} ({d['backend']}), {d['dtype']}, E={disp.get('E')}, k={disp.get('k')}, "
            f"N={disp.get('N')}, D={disp.get('D')}, F={disp.get('F')}, capacity {disp.get('capacity')}; grouped GEMM: "
            f"{d.get('grouped_gemm_engine')}; median of {d['repeats']} rounds.")


def bench_sandbox_notes(data: dict) -> str:
    d = data["results/bench_sandbox.json"]
    return (f"{d['machine']['cpus']} CPUs, kernel {d['machine']['kernel']}, {d['rounds']} interleaved rounds"
            + (" (--quick)" if d.get("quick") else "") + f". {d.get('notes', '')}")


def ablate_notes(path: str):
    return lambda data: ablate.markdown_table(data[path]).strip()


# ------------------------------------------------------------------------------ the registry


@dataclasses.dataclass(frozen=True)
class FigureSpec:
    """A figure of the README: `draw(data, png_path)` with data = {path: loaded JSON} of the files
    present; `data` must all exist, `extra` are used when present. `commands` produced the data,
    in order; `notes(data)` adds what the data says (tables) to the caption."""
    name: str
    data: tuple[str, ...]
    draw: Callable[[dict, str], Any]
    caption: str
    commands: tuple[str, ...]
    extra: tuple[str, ...] = ()
    notes: Callable[[dict], str] | None = None

    @property
    def png(self) -> str:
        return f"{self.name}.png"


FIGURES: dict[str, FigureSpec] = {f.name: f for f in (
    FigureSpec(
        "grpo_synth", ("docs/figures/grpo_synth.json",),
        lambda d, out: plot_training.draw_series(d["docs/figures/grpo_synth.json"], out),
        "GRPO on program synthesis, 3 seeds (thin lines) and their mean (thick): pass@1 and best-of-16 on held-out "
        "behaviours (eval/) and on new tasks of the training distribution (eval_fresh/) through RL, the training "
        "pass rate and the KL to the reference; best-of-16 not collapsing is the check. The three seeds ran the "
        "same command, with the initialisation fixed (every projection at std 1/sqrt(fan-in)).",
        (TRAIN_SYNC, SUMMARIZE_SYNC, PLOT_SYNC), extra=("results/grpo_synth.json",),
        notes=_grpo_notes("results/grpo_synth.json")),
    FigureSpec(
        "pretrain_code", ("docs/figures/pretrain_code.json",),
        lambda d, out: plot_training.draw_series(d["docs/figures/pretrain_code.json"], out),
        "Pretraining the committed code base (checkpoints/code_base), one run (seed 0): the training loss in bits "
        "per byte of its targets (trailing mean of 20 steps), the held-out files' bits per byte at every evaluation, "
        "and training tokens per second on 2 CPU cores (trailing mean of 20 steps).",
        (PRETRAIN, PLOT_PRETRAIN)),
    FigureSpec(
        "pretrain_budgets", ("results/pretrain_budgets.json",),
        lambda d, out: script("pretrain_budgets").plot(d["results/pretrain_budgets.json"], out),
        "Does pretraining help RL here? Three pretraining budgets of the same 3.1M-parameter model (none, 300 steps, "
        "the committed base's 1,200), each followed by the same SFT and 200 GRPO steps of the main job: the base's "
        "held-out code loss (bits per byte) against pass@1 and best-of-16 after RL on held-out behaviours (eval/) and "
        "new tasks of the training distribution (eval_fresh/); filled markers per seed after RL, hollow at the SFT "
        "start, lines through the seeds' means.",
        (PRETRAIN_BUDGETS,), notes=lambda d: script("pretrain_budgets").table(d["results/pretrain_budgets.json"])),
    FigureSpec(
        "grpo_synth_async", ("docs/figures/grpo_synth_async.json",),
        lambda d, out: plot_training.draw_series(d["docs/figures/grpo_synth_async.json"], out),
        "Sync vs async rollouts (--config.rollout.async=True, max_staleness 1), seeds 0 and 1: eval_fresh/ pass@1 and "
        "best-of-16 and the training pass rate, one line per run (no mean: two configurations).",
        (TRAIN_SYNC_01, TRAIN_ASYNC, SUMMARIZE_ASYNC, PLOT_ASYNC), extra=("results/grpo_synth_async.json",),
        notes=_grpo_notes("results/grpo_synth_async.json")),
    FigureSpec(
        "ablate_loss", ("results/ablate_loss.json",),
        lambda d, out: ablate.plot_ablation(d["results/ablate_loss.json"], out),
        "Objective ablation on the main job: per objective the mean over its seeds (min-max shaded) of the eval "
        "metric, best-of-n and the training reward; the table (also results/ablate_loss.md) gives final values, "
        "steps to the threshold and wall time.",
        (ABLATE_LOSS,), notes=ablate_notes("results/ablate_loss.json")),
    FigureSpec(
        "ablate_loss_heldout", ("results/ablate_loss_heldout.json",),
        lambda d, out: ablate.plot_ablation(d["results/ablate_loss_heldout.json"], out),
        "The objective ablation's runs on the held-out behaviours (eval/): pass@1, best-of-16 and the training "
        "reward per objective; the table (also results/ablate_loss_heldout.md) gives final values.",
        (ABLATE_LOSS, ABLATE_LOSS_HELDOUT), notes=ablate_notes("results/ablate_loss_heldout.json")),
    FigureSpec(
        "pass_at_k", ("results/grpo_synth.json",),
        lambda d, out: draw_pass_at_k(d["results/grpo_synth.json"], out),
        "pass@k vs k at the start of RL (the SFT policy) and after 200 GRPO steps, on held-out behaviours (eval/) "
        "and new tasks of the training distribution (eval_fresh/); error bars: std over the seeds.",
        (TRAIN_SYNC, SUMMARIZE_SYNC), notes=pass_at_k_notes),
    FigureSpec(
        "bench_attention", ("results/bench_attention.json",),
        lambda d, out: script("bench_attention").plot(d["results/bench_attention.json"]["rows"], out,
                                                      backend=d["results/bench_attention.json"].get("backend")),
        "Attention variants: median time and XLA temporary memory vs sequence length, dense vs flash (chunked) vs "
        "NSA vs squid, forward (solid) and forward + backward (dashed), and prefilling a global segment over "
        "cached documents (prefill_docs) vs causal attention over everything (prefill_dense).",
        ("python -m experiments.bench_attention --publish",), notes=bench_attention_notes),
    FigureSpec(
        "moe_precision", ("results/moe_precision.json",),
        lambda d, out: script("moe_precision").plot(d["results/moe_precision.json"]["runs"], out),
        "A 2-layer MoE byte-level LM (8 experts, top-2, one shared expert) trained with bf16 vs MXFP8 expert GEMMs, "
        "same seed, data and initial parameters: training loss (smoothed) and held-out loss.",
        MOE_PRECISION, extra=("results/moe_precision_seed1.json", "results/moe_precision_seed2.json"),
        notes=moe_precision_notes),
    FigureSpec(
        "reward_model", ("results/reward_model.json",),
        lambda d, out: script("reward_model").plot(d["results/reward_model.json"]["runs"], out),
        "Bradley-Terry reward models from the code base, trained on simulated users' choices between candidate "
        "solutions of synthesis tasks, one seed: held-out pairwise accuracy against the users' labels (solid) and "
        "against gold, the fraction of held-out tests each candidate passes (dashed), for unbiased users and users "
        "who favour comment lines.",
        ("python -m experiments.reward_model --publish",), notes=reward_model_notes),
    FigureSpec(
        "overoptimization", ("results/overoptimization.json",),
        lambda d, out: script("overoptimization").plot(d["results/overoptimization.json"]["runs"],
                                                       d["results/overoptimization.json"]["smooth"], out),
        "GRPO from the main job's SFT policy against the reward model of the biased users (1.5 logits per comment "
        "line), one seed per run: the proxy (the reward model's score) and gold (the fraction of held-out tests "
        "passed, which pays nothing) against the square root of the KL from the start policy, for KL "
        "coefficients 0 and 0.2 (the monitor only logging) and with the monitor raising the KL coefficient from 0 "
        "(the same run as KL 0 until the monitor acts, so its line covers that one's). The monitor sees 8 audited rows "
        "a step in windows of 5 steps.",
        ("python -m experiments.reward_model --publish", "python -m experiments.overoptimization --publish"),
        notes=overoptimization_notes),
    FigureSpec(
        "clarifying_questions", ("results/clarifying_questions.json",),
        lambda d, out: script("clarifying_questions").plot(d["results/clarifying_questions.json"]["runs"],
                                                           d["results/clarifying_questions.json"]["smooth"], out),
        "GRPO from an SFT policy that sometimes asks a clarifying question instead of answering (a completion "
        "starting with '# ask:', never executed), one seed per run: the fraction of completions that ask and the "
        "fraction that pass every held-out test, per step, under the naive reward (a question earns 0, a wrong "
        "answer costs 1) and a rebalanced one (a question costs 1.5), with the behaviour monitor's first flag of "
        "the question rate.",
        ("python -m experiments.clarifying_questions --publish",), notes=clarifying_questions_notes),
    FigureSpec(
        "usage_rl", ("results/usage_rl.json",),
        lambda d, out: script("usage_rl").plot(d["results/usage_rl.json"], d["results/usage_rl.json"]["smooth"], out),
        "Real-time RL from a usage log written by a simulated deployment (one seed): the regression gate's "
        "decisions on each candidate (fixed-suite pass@1 against the live version), the outcome rates of the "
        "interactions trained on, and the A/B test of each release against its predecessor (95% intervals of "
        "the difference; Newcombe's hybrid score interval).",
        ("python -m experiments.usage_rl --publish",), notes=usage_rl_notes),
    FigureSpec(
        "bench_moe", ("results/bench_moe.json",),
        lambda d, out: script("bench_moe").plot(d["results/bench_moe.json"]["rows"], out,
                                                backend=d["results/bench_moe.json"].get("backend")),
        "MoE layer speed: one-hot einsum vs dropless grouped GEMM vs capacity dispatch (time and memory), MXFP8 vs "
        "bf16 grouped GEMM, and the MXFP8 quantiser's bandwidth against a plain copy.",
        ("python -m experiments.bench_moe --publish",), notes=bench_moe_notes),
    FigureSpec(
        "gpu_bench_attention", ("results/gpu_bench_attention.json",),
        lambda d, out: script("bench_attention").plot(
            d["results/gpu_bench_attention.json"]["rows"], out,
            backend=f"{d['results/gpu_bench_attention.json']['device']} (gpu)"),
        "Attention on one GPU: XLA vs Triton vs cuDNN faces of dense, flash, NSA and squid attention up to 64k tokens "
        "(bf16, one sequence, 4 query heads, 1 key/value head, head dim 64; squid over 1,024-token documents), forward "
        "and forward + backward time, and XLA's temporary memory. XLA's dense attention did not run at 64k (its "
        "autotuner reported that every configuration failed, with a [4, 64k, 64k] score matrix to form).",
        (GPU_CHECK,), extra=("results/gpu_kernel_tests.json",), notes=gpu_bench_attention_notes),
    FigureSpec(
        "gpu_bench_moe", ("results/gpu_bench_moe.json",),
        lambda d, out: script("bench_moe").plot(d["results/gpu_bench_moe.json"]["rows"], out,
                                                backend=f"{d['results/gpu_bench_moe.json']['device']} (gpu)"),
        "MoE layer on one GPU (bf16): dispatch variants with the XLA and Triton grouped GEMMs, MXFP8 vs bf16 grouped "
        "GEMM (XLA emulation and Triton), and the MXFP8 quantiser's bandwidth against a copy of the same array.",
        (GPU_CHECK,), extra=("results/gpu_kernel_tests.json",), notes=gpu_bench_moe_notes),
    FigureSpec(
        "bench_sandbox", ("results/bench_sandbox.json",),
        lambda d, out: script("bench_sandbox").plot(d["results/bench_sandbox.json"]["rows"], out),
        "Sandbox throughput (executions/s, all clients together) vs concurrent clients: the pool (fork-server "
        "workers; lean: no preloaded pytest; inprocess: code run in the warm interpreter) vs a fresh process per "
        "execution with the same isolation, and vs the unshare CLI (fewer protections), per program.",
        ("python -m experiments.bench_sandbox --publish",), notes=bench_sandbox_notes),
    FigureSpec(
        "hack_suite", ("results/hack_suite.json",),
        lambda d, out: draw_hack_suite(d["results/hack_suite.json"], out),
        "Reward-hack suite: every catalogued hack (and the controls) written into generated tasks, graded by the "
        "real grading path and rewarded; one row per hack group with the flags raised, the reward with and without "
        "the hack rule (max over tasks) and the verdicts.",
        ("python -m experiments.hack_suite --publish",), notes=hack_suite_notes),
    FigureSpec(
        "agent_repo", ("results/agent_repo.json",),
        lambda d, out: draw_agent_repo(d["results/agent_repo.json"], out),
        "Agent RL on repository tasks: success rate through training (eval_fresh/ and eval/ at each evaluation, "
        "rollouts as a trailing mean) and prefill tokens per step by sampler (full context / incremental KV cache / "
        "document reuse).",
        (TRAIN_AGENT,), notes=agent_repo_notes),
    FigureSpec(
        "agent_repo_code", ("results/agent_repo_code.json",),
        lambda d, out: draw_agent_repo(d["results/agent_repo_code.json"], out, "results/agent_repo_code.json"),
        "Agent RL from the pretrained code base (SFT on 2,000 expert demonstrations, then GRPO on the train tasks "
        "that were not demonstrations): success through training (eval_fresh/ and eval/ at each evaluation, "
        "rollouts as a trailing mean) and prefill tokens per step by sampler, for the first run listed.",
        TRAIN_AGENT_CODE, notes=lambda d: agent_repo_notes(d, "results/agent_repo_code.json")),
    FigureSpec(
        "agent_recover", ("results/agent_recover.json",),
        lambda d, out: draw_agent_repo(d["results/agent_recover.json"], out, "results/agent_recover.json"),
        "The default agent job: the pretrained code base, SFT on 2,000 demonstrations of the recovering expert "
        "(a wrong edit, refused with the file's closest line, then that line copied), then GRPO on the train tasks "
        "that were not demonstrations: success through training (eval_fresh/ and eval/ at each evaluation, "
        "rollouts as a trailing mean) and prefill tokens per step by sampler, for the first run listed.",
        TRAIN_AGENT_RECOVER, notes=lambda d: agent_repo_notes(d, "results/agent_recover.json")),
)}


# ------------------------------------------------------------------------------ running


def load_data(spec: FigureSpec, root: str) -> tuple[dict[str, Any], list[str]]:
    """({path: JSON} of the spec's files present under root, [required paths missing])."""
    data, missing = {}, []
    for path in spec.data + spec.extra:
        full = os.path.join(root, path)
        if os.path.isfile(full):
            with open(full, encoding="utf-8") as f:
                data[path] = json.load(f)
        elif path in spec.data:
            missing.append(path)
    return data, missing


def recorded_commands(spec: FigureSpec, data: dict) -> list[str]:
    """Commands recorded in the data files themselves (their "command" field) that the spec's
    list does not already hold: the exact command of that run."""
    out = []
    for path in spec.data + spec.extra:
        cmd = data.get(path, {}).get("command") if isinstance(data.get(path), dict) else None
        if cmd and cmd not in spec.commands:
            out.append(f"{cmd}  # recorded in {path}")
    return out


def caption(spec: FigureSpec, data: dict | None = None) -> str:
    """The caption: what the figure shows, what its data says (when loaded) and the commands."""
    data = data or {}
    parts = [spec.caption]
    if spec.notes is not None and all(p in data for p in spec.data):
        notes = spec.notes(data)
        if notes:
            parts.append(notes)
    commands = list(spec.commands) + recorded_commands(spec, data)
    parts.append("Produced by:\n" + "\n".join(f"    {c}" for c in commands))
    return "\n\n".join(parts)


def skip_message(spec: FigureSpec, missing: Sequence[str]) -> str:
    return "; ".join(f"skipped: {path} missing; produce it with {PRODUCERS.get(path, spec.commands[-1])}"
                     for path in missing)


def draw(spec: FigureSpec, root: str, out_dir: str, say=print) -> str:
    """Draw one figure: 'drawn', 'skipped' (a data file is missing) or 'failed'."""
    data, missing = load_data(spec, root)
    if missing:
        say(f"{spec.name}: {skip_message(spec, missing)}")
        return "skipped"
    out = os.path.join(out_dir, spec.png)
    try:
        os.makedirs(out_dir, exist_ok=True)  # the benchmarks' plot() expects the directory to exist
        spec.draw(data, out)
    except Exception:  # noqa: BLE001 (reported; the other figures are still drawn)
        say(f"{spec.name}: failed:\n{textwrap.indent(traceback.format_exc(), '    ')}")
        return "failed"
    say(f"{spec.name}: wrote {out} ({os.path.getsize(out) // 1024} KB) from {', '.join(p for p in data)}")
    return "drawn"


def captions_markdown(root: str, out_dir: str) -> str:
    """CAPTIONS.md: one section per registered figure (image link, caption, data files, commands)."""
    lines = ["# Figures", "",
             "Generated by `python -m experiments.figures --captions` from the logged results; "
             "`make figures` redraws the PNGs (`python -m experiments.figures --all`).", ""]
    for spec in FIGURES.values():
        data, missing = load_data(spec, root)
        lines += [f"## {spec.name}", ""]
        if os.path.isfile(os.path.join(out_dir, spec.png)) and not missing:
            lines += [f"![{spec.name}]({spec.png})", ""]
        if missing:
            lines += [f"Not drawn: {skip_message(spec, missing)}", ""]
        text = caption(spec, data if not missing else None)
        head, _, commands = text.rpartition("\n\nProduced by:\n")
        lines += [head, ""]
        files = [f"`{p}`" + (" (missing)" if p in missing else "") for p in spec.data]
        files += [f"`{p}` (optional)" for p in spec.extra if p in data]
        lines += ["Data: " + ", ".join(files), "", "Commands:", "", "```",
                  *[c.strip() for c in commands.splitlines()], "```", ""]
    return "\n".join(lines)


def list_figures(root: str) -> str:
    blocks = []
    for spec in FIGURES.values():
        data, missing = load_data(spec, root)
        files = ", ".join(p + (" (missing)" if p in missing else "") for p in spec.data)
        if spec.extra:
            files += "; optional: " + ", ".join(p + ("" if p in data else " (missing)") for p in spec.extra)
        blocks.append(f"{spec.name}  ->  {spec.png}\n  data: {files}\n"
                      + textwrap.indent(caption(spec), "  "))
    return "\n\n".join(blocks)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m experiments.figures", description=summary(__doc__),
                                     allow_abbrev=False)
    parser.add_argument("--all", action="store_true", help="draw every figure")
    parser.add_argument("--only", default=None, help="comma-separated figure names")
    parser.add_argument("--list", action="store_true", help="list the figures, their data files and captions")
    parser.add_argument("--captions", action="store_true", help="write CAPTIONS.md in --out_dir")
    parser.add_argument("--out_dir", default=None, help="default: <root>/docs/figures")
    parser.add_argument("--root", default=".", help="directory holding results/ and docs/figures/ (default: .)")
    args = parser.parse_args(argv)
    if args.all and args.only:
        parser.error("give --all or --only, not both")
    if not (args.all or args.only or args.list or args.captions):
        parser.error("give --all, --only=NAME,..., --list or --captions")
    args.names = list(FIGURES) if args.all else [n.strip() for n in (args.only or "").split(",") if n.strip()]
    unknown = [n for n in args.names if n not in FIGURES]
    if unknown:
        parser.error(f"unknown figure(s) {unknown}; known: {', '.join(FIGURES)}")
    args.out_dir = args.out_dir or os.path.join(args.root, "docs", "figures")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.list:
        print(list_figures(args.root))
        if not args.names and not args.captions:
            return 0
    status = {name: draw(FIGURES[name], args.root, args.out_dir) for name in args.names}
    if args.captions:
        os.makedirs(args.out_dir, exist_ok=True)
        path = os.path.join(args.out_dir, "CAPTIONS.md")
        with open(path, "w", encoding="utf-8") as f:
            f.write(captions_markdown(args.root, args.out_dir))
        print(f"wrote {path}")
    bad = {name: s for name, s in status.items() if s != "drawn"}
    if status:
        print(f"{len(status) - len(bad)}/{len(status)} figures drawn"
              + ("; " + ", ".join(f"{n} {s}" for n, s in bad.items()) if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
