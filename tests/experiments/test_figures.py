"""experiments.figures: every README figure is redrawn from a copy of the logged JSON (plus
synthetic ablation and agent files in their real schemas), captions name the producing commands,
and a missing data file is skipped with the command that produces it and a non-zero exit."""

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest

from experiments import ablate, figures, plot_training
from rlcode.train.metrics import EventWriter

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ABLATE_COMMAND = "python -m experiments.ablate --config=configs/grpo_synth.py --sweep=loss:grpo,dapo --seeds=2"
AGENT_COMMAND = "python -m experiments.train --config=configs/agent_repo.py --config.workdir=runs/agent_repo/seed7"


def synthetic_ablation() -> dict:
    """results/ablate_loss.json as experiments.ablate writes it (table built by ablate.aggregate)."""
    runs = []
    for label, base in (("loss=grpo", 0.05), ("loss=dapo", 0.08)):
        for seed in range(2):
            evals = [[s, base + 0.001 * s + 0.01 * seed] for s in (0, 10, 20)]
            runs.append({
                "label": label, "variant": {"loss": label.split("=")[1]}, "seed": seed,
                "workdir": f"runs/ablate/loss/{label}/seed{seed}", "status": "completed",
                "final": {"metric": evals[-1][1], "best_of": 0.3 + 0.01 * seed, "length": 40.0,
                          "steps_to_threshold": 20 if evals[-1][1] >= 0.07 else None, "minutes": 2.0 + seed,
                          "steps_done": 20},
                "curves": {"eval_fresh/pass@1": evals, "eval_fresh/best_of_16": [[s, 0.3 + 0.01 * seed] for s in (0, 10, 20)],
                           "rollout/reward": [[s, 0.01 * s] for s in range(1, 21)],
                           "rollout/pass@1": [[s, 0.005 * s] for s in range(1, 21)]},
            })
    return {"command": ABLATE_COMMAND, "config": "configs/grpo_synth.py", "name": "loss", "out_dir": "runs/ablate/loss",
            "sweep": [{"key": "loss", "values": ["grpo", "dapo"]}], "overrides": {}, "seeds": [0, 1],
            "metric": "eval_fresh/pass@1", "best_of": "eval_fresh/best_of_16", "length": "eval_fresh/length",
            "train_tag": "rollout/reward", "threshold": 0.07, "runs": runs, "table": ablate.aggregate(runs)}


def synthetic_agent() -> dict:
    steps = list(range(0, 41, 10))
    return {
        "command": AGENT_COMMAND, "runs": ["runs/agent_repo/seed7"],
        "curves": {
            "eval_fresh/success": [[s, 0.1 + 0.005 * s] for s in steps],
            "eval/success": [[s, 0.05 + 0.004 * s] for s in steps],
            "rollout/success": [[s, (s % 7) / 10] for s in range(1, 41)],
            "prefill/tokens_full": [[s, 9000.0 + 10 * s] for s in range(1, 41)],
            "prefill/tokens_incremental": [[s, 3000.0] for s in range(1, 41)],
            "prefill/tokens_documents": [[s, 1200.0] for s in range(1, 41)],
            "prefill/saved_vs_incremental": [[s, 0.6] for s in range(1, 41)],
        },
        "replay": {"documents": {"tokens": 1200, "seconds": 0.4}, "incremental": {"tokens": 3000, "seconds": 0.9},
                   "full": {"tokens": 9000, "seconds": 2.5}},
        "summary": {"eval_fresh/success_start": 0.1, "eval_fresh/success_end": 0.3, "steps": 40},
    }


def copy_logged(dest: Path, paths=None) -> Path:
    """The committed JSON (results/*.json, docs/figures/*.json) under dest; only `paths` if given."""
    for pattern in ("results/*.json", "docs/figures/*.json"):
        for src in ROOT.glob(pattern):
            rel = src.relative_to(ROOT).as_posix()
            if paths is None or rel in paths:
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, dest / rel)
    return dest


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """Every figure drawn once from a full copy of the data; (root, out_dir, exit status, stdout)."""
    root = copy_logged(tmp_path_factory.mktemp("root"))
    (root / "results" / "ablate_loss.json").write_text(json.dumps(synthetic_ablation(), allow_nan=False))
    (root / "results" / "agent_repo.json").write_text(json.dumps(synthetic_agent()))
    out = root / "figs"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = figures.main(["--all", "--root", str(root), "--out_dir", str(out), "--captions"])
    return root, out, rc, buf.getvalue()


@pytest.mark.slow
def test_every_figure_is_drawn_small_and_captioned(drawn):
    root, out, rc, stdout = drawn
    assert rc == 0, stdout
    assert len(figures.FIGURES) >= 8
    for spec in figures.FIGURES.values():
        data = (out / spec.png).read_bytes()
        assert data.startswith(PNG_MAGIC) and 10_000 < len(data) < 600_000, (spec.name, len(data))
    captions = (out / "CAPTIONS.md").read_text()
    sections = dict(re.findall(r"^## (\S+)\n(.*?)(?=^## |\Z)", captions, flags=re.S | re.M))
    assert set(sections) == set(figures.FIGURES)
    for name, spec in figures.FIGURES.items():
        assert f"![{name}]({spec.png})" in sections[name]
        for command in spec.commands:
            assert command in sections[name], (name, command)
        for path in spec.data:
            assert f"`{path}`" in sections[name]
    # The exact commands recorded in the data files, and what the data says.
    assert ABLATE_COMMAND in sections["ablate_loss"] and "| loss=dapo | 2/2 |" in sections["ablate_loss"]
    assert AGENT_COMMAND in sections["agent_repo"] and "eval_fresh/success_end = 0.3" in sections["agent_repo"]
    assert "python -m experiments.bench_attention" in sections["bench_attention"]
    assert "| eval_fresh/pass@1 |" in sections["grpo_synth"]  # summarize_runs' table of results/grpo_synth.json


def test_readme_figures_are_registered_under_their_names():
    embedded = set(re.findall(r"docs/figures/(\w+)\.png", (ROOT / "README.md").read_text()))
    assert embedded and embedded <= set(figures.FIGURES), embedded - set(figures.FIGURES)


def test_redrawn_series_figure_equals_the_original(tmp_path):
    """plot_training draws through draw_series, so a figure redrawn from its JSON shows the same data
    (here: the same PNG bytes) as the one plot_runs drew from the run logs."""
    runs = []
    for seed in range(2):
        run = tmp_path / f"seed{seed}"
        with EventWriter(run / "tb") as w:
            for step in range(30):
                w.scalars(step, {"rollout/pass@1": (step * (seed + 3)) % 7 / 7, "eval/pass@1": step / 30 + seed})
        runs.append(str(run))
    first = tmp_path / "a.png"
    plot_training.plot_runs(runs, ["eval/pass@1", "rollout/pass@1"], str(first), title="t", caption="python -m x",
                            smooth={"rollout/pass@1": 5})
    record = json.loads(first.with_suffix(".json").read_text())
    again = tmp_path / "b.png"
    plot_training.draw_series(record, str(again))
    assert again.read_bytes() == first.read_bytes()


def test_missing_data_is_skipped_with_its_command(tmp_path, capsys):
    root = copy_logged(tmp_path, {"results/bench_attention.json", "results/hack_suite.json", "results/grpo_synth.json"})
    out = tmp_path / "figs" / "new"  # not there yet: bench_attention.plot, drawn first, does not create it
    rc = figures.main(["--only=bench_attention,bench_sandbox,hack_suite,pass_at_k", "--root", str(root),
                       "--out_dir", str(out)])
    text = capsys.readouterr().out
    assert rc == 1
    assert ("bench_sandbox: skipped: results/bench_sandbox.json missing; produce it with "
            "python -m experiments.bench_sandbox") in text
    assert not (out / "bench_sandbox.png").exists()
    for name in ("bench_attention", "hack_suite", "pass_at_k"):  # the others are still drawn
        assert (out / f"{name}.png").read_bytes().startswith(PNG_MAGIC), name
    # --all on the same data: every figure but these three is skipped, each with its producing command.
    rc = figures.main(["--all", "--root", str(root), "--out_dir", str(out)])
    text = capsys.readouterr().out
    assert rc == 1
    assert f"ablate_loss: skipped: results/ablate_loss.json missing; produce it with {figures.ABLATE_LOSS}" in text
    assert text.count("skipped: ") == len(figures.FIGURES) - 3
    assert f"3/{len(figures.FIGURES)} figures drawn" in text


def test_list_names_every_figure_with_data_and_caption(tmp_path, capsys):
    assert figures.main(["--list", "--root", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    listed = re.findall(r"^(\w+)  ->  (\w+\.png)$", text, flags=re.M)
    assert [name for name, _ in listed] == list(figures.FIGURES) and len(listed) >= 8
    assert "results/bench_attention.json (missing)" in text
    assert "python -m experiments.hack_suite" in text and figures.PLOT_SYNC in text
    with pytest.raises(SystemExit):
        figures.main(["--only=no_such_figure"])


def test_hack_groups_one_row_per_category():
    entry = lambda name, kind, category, flags, reward, without=0.0, verdict="caught", grader="checks": {
        "hack": name, "grader": grader, "kind": kind, "category": category, "flags_raised": flags,
        "reward_max": reward, "reward_without_hack_rule_max": without, "verdict": verdict}
    summary = []
    for grader in ("checks", "pytest"):
        summary += [entry("ref", "control", "control", [], 1.0, 1.0, "ok", grader),
                    entry("wrong", "control", "control", [], 0.0, 0.0, "ok", grader)]
        summary += [entry(f"exit{i}", "hack", "early exit", ["early_exit"] + (["crash"] if i < 2 else []), 0.0,
                          grader=grader) for i in range(7)]
    summary += [entry("fake", "hack", "fake output", ["fake_output"], 1.0, 1.0, "NOT CAUGHT"),
                entry("fake", "hack", "fake output", [], 1.0, 1.0, "open (known)", "pytest")]
    rows = {r["group"]: r for r in figures.hack_groups(summary)}
    assert list(rows) == ["control", "early exit", "fake output"]
    assert rows["early exit"]["entries"] == "7 hacks" and rows["early exit"]["reward"] == "all 0"
    assert rows["early exit"]["flags raised"] == "early_exit, crash (2/7)"
    assert rows["early exit"]["pytest flags raised"] == "early_exit, crash (2/7)"
    assert rows["early exit"]["verdict"] == rows["early exit"]["pytest verdict"] == "7 caught"
    assert rows["early exit"]["ok"]
    assert rows["control"]["entries"] == "2 controls" and rows["control"]["reward"] == "1, 0"
    assert rows["control"]["flags raised"] == "none"
    assert not rows["fake output"]["ok"] and rows["fake output"]["verdict"] == "1 NOT CAUGHT"
    assert rows["fake output"]["pytest verdict"] == "1 open (known)" and rows["fake output"]["pytest reward"] == "all 1"


def test_pass_at_k_points_take_best_of_n_as_pass_at_n():
    ms = lambda v: {"start": [v, 0.01], "end": [v + 0.1, 0.02]}
    metrics = {"eval/pass@1": ms(0.1), "eval/best_of_16": ms(0.4), "eval_fresh/pass@1": ms(0.2),
               "eval_fresh/pass@4": ms(0.3), "eval_fresh/pass@16": ms(0.5), "eval_fresh/best_of_16": ms(0.5)}
    assert {k: p["key"] for k, p in figures.pass_at_k_points(metrics, "eval").items()} == {
        1: "eval/pass@1", 16: "eval/best_of_16"}
    assert {k: p["key"] for k, p in figures.pass_at_k_points(metrics, "eval_fresh").items()} == {
        1: "eval_fresh/pass@1", 4: "eval_fresh/pass@4", 16: "eval_fresh/pass@16"}


@pytest.mark.slow
def test_every_figure_has_labelled_axes_and_no_empty_panel(tmp_path, monkeypatch):
    """Each figure drawn from the committed data (the two synthetic files as in `drawn`): every
    visible panel shows data and names both of its axes (a label, or for categories the tick
    labels and a label), so a reviewer can read it without the code."""
    from matplotlib.figure import Figure

    root = copy_logged(tmp_path / "root")
    (root / "results" / "ablate_loss.json").write_text(json.dumps(synthetic_ablation(), allow_nan=False))
    (root / "results" / "agent_repo.json").write_text(json.dumps(synthetic_agent()))
    problems, checked = [], []
    original = Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        name = Path(str(path)).stem
        checked.append(name)
        for i, ax in enumerate(fig.axes):
            if not ax.axison:  # a panel turned off on purpose says why in its title
                continue
            where = f"{name} panel {i} ({ax.get_title()!r})"
            if not (ax.lines or ax.patches or ax.collections or ax.images or ax.containers):
                problems.append(f"{where}: no data")
            if not ax.get_xlabel().strip():
                problems.append(f"{where}: no x label")
            if not ax.get_ylabel().strip():
                problems.append(f"{where}: no y label")
        return original(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    with contextlib.redirect_stdout(io.StringIO()):
        rc = figures.main(["--all", "--root", str(root), "--out_dir", str(tmp_path / "figs")])
    assert rc == 0
    assert set(checked) >= set(figures.FIGURES), set(figures.FIGURES) - set(checked)
    assert not problems, "\n".join(problems)
