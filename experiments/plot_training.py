"""Plot logged training scalars of one or more runs (seeds) into a PNG, for the README.

    python -m experiments.plot_training --runs runs/grpo_synth/seed0,runs/grpo_synth/seed1 \\
        --tags eval/pass@1,eval/best_of_16 --out docs/figures/grpo_synth.png \\
        --title "GRPO on synth tasks" --caption "python -m experiments.train --config=..."

Reads each run's `metrics.jsonl` (written by `rlcode.train.metrics.EventWriter`, directly in the
run directory or in its `tb/` subdirectory), draws one panel per tag with x = step: each run as a
thin line and the mean over runs as a thick line. The mean is taken at the steps where every run
has the tag. The plotted series are also written as JSON next to the PNG (same path, `.json`)
so that numbers quoted in the README can be traced to the runs; `draw_series` draws the PNG from
that JSON alone (`python -m experiments.figures` redraws the README's figures with it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import textwrap
from collections.abc import Sequence

import numpy as np

from rlcode.train.metrics import JSONL_NAME, read_jsonl

from experiments.cli import summary

PANEL_COLUMNS = 3
DPI = 100  # the README's figures: a few hundred KB


def find_jsonl_dir(run_dir: str) -> str:
    """The directory holding the run's metrics.jsonl: `run_dir` itself or `run_dir/tb`."""
    for candidate in (run_dir, os.path.join(run_dir, "tb")):
        if os.path.isfile(os.path.join(candidate, JSONL_NAME)):
            return candidate
    raise FileNotFoundError(f"no {JSONL_NAME} in {run_dir} or {os.path.join(run_dir, 'tb')}")


def run_series(run_dir: str, tags: Sequence[str]) -> dict[str, tuple[list[int], list[float]]]:
    """tag -> (steps, values) of one run, for the tags it logged; non-finite values are NaN."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for record in read_jsonl(find_jsonl_dir(run_dir)):
        for tag in tags:
            if tag in record:
                steps, values = series.setdefault(tag, ([], []))
                steps.append(int(record["step"]))
                values.append(math.nan if record[tag] is None else float(record[tag]))
    return series


def mean_series(per_run: Sequence[tuple[list[int], list[float]]]) -> tuple[list[int], list[float]]:
    """Mean over runs at the steps every run has (NaN where any run's value is NaN)."""
    if not per_run:
        return [], []
    lookups = [dict(zip(steps, values)) for steps, values in per_run]
    common = sorted(set.intersection(*(set(lookup) for lookup in lookups)))
    return common, [float(np.mean([lookup[s] for lookup in lookups])) for s in common]


def short_labels(names: Sequence[str]) -> list[str]:
    """Run names without their common directory ('runs/x/seed0', 'runs/x/seed1' -> 'seed0', 'seed1')."""
    if len(names) < 2:
        return list(names)
    common = os.path.commonpath([os.path.abspath(n) for n in names])
    labels = [os.path.relpath(os.path.abspath(n), common) for n in names]
    return labels if all(label != "." for label in labels) else list(names)


def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    """values[i] replaced by the mean of values[max(0, i - window + 1) : i + 1]."""
    if window == 1:
        return list(values)
    a = np.asarray(values, dtype=np.float64)
    c = np.concatenate([[0.0], np.cumsum(a)])
    i = np.arange(len(a))
    lo = np.maximum(0, i - window + 1)
    return ((c[i + 1] - c[lo]) / (i + 1 - lo)).tolist()


def _json_values(values: Sequence[float]) -> list[float | None]:
    return [v if math.isfinite(v) else None for v in values]


def plot_runs(
    run_dirs: Sequence[str],
    tags: Sequence[str],
    out: str,
    title: str | None = None,
    caption: str | None = None,
    smooth: int | dict[str, int] = 1,
    mean: bool = True,
) -> str:
    """Plot `tags` of `run_dirs` into the PNG `out` and its series into `out` with `.json`.

    smooth: each run's series is replaced by its trailing mean over `smooth` logged points (1 =
    raw; for noisy per-step scalars such as rollout rewards); a dict gives it per tag (missing
    tags: 1). mean: draw the mean over runs
    (off to compare different configurations instead of seeds).
    Returns the path of the PNG. Raises ValueError for a tag that no run logged.
    """
    windows = dict(smooth) if isinstance(smooth, dict) else {tag: smooth for tag in tags}
    if any(w < 1 for w in windows.values()):
        raise ValueError(f"smooth must be >= 1, got {smooth}")
    if not run_dirs or not tags:
        raise ValueError("plot_runs needs at least one run and one tag")
    names = [os.path.normpath(d) for d in run_dirs]
    if len(set(names)) < len(names):
        raise ValueError(f"plot_runs: a run is listed twice in {names}")
    series = {name: {tag: (steps, trailing_mean(values, windows.get(tag, 1)))
                     for tag, (steps, values) in run_series(d, tags).items()}
              for name, d in zip(names, run_dirs)}
    missing = [tag for tag in tags if not any(tag in s for s in series.values())]
    if missing:
        logged = sorted({k for s in series.values() for k in s})
        raise ValueError(f"no run logged {missing}; requested tags logged: {logged}")

    record = {"runs": names, "title": title, "caption": caption, "smooth": windows, "tags": {}}
    for tag in tags:
        runs = {name: s[tag] for name, s in series.items() if tag in s}
        steps, avg = mean_series(list(runs.values())) if mean and len(runs) == len(names) else ([], [])
        record["tags"][tag] = {
            "runs": {name: {"steps": s, "values": _json_values(v)} for name, (s, v) in runs.items()},
            "mean": {"steps": steps, "values": _json_values(avg)},
        }
    draw_series(record, out)
    with open(os.path.splitext(out)[0] + ".json", "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, allow_nan=False)
    return out


def value_label(tag: str) -> str:
    """The y-axis label of a logged scalar: what it measures and in which unit, from its name."""
    name = tag.split(" ")[0].split("/")[-1]
    if name.startswith(("pass@", "best_of")) or "success" in name:
        return "fraction solved"
    if "bpb" in name:
        return "bits per byte"
    if name.startswith("kl"):
        return "KL (nats per token)"
    if "tokens_per_s" in name:
        return "tokens / s"
    if "reward" in name:
        return "mean reward"
    return name


def draw_series(record: dict, out: str, dpi: int = DPI) -> str:
    """Draw the PNG `out` from a series record (what `plot_runs` writes next to its PNG:
    {"runs", "title", "caption", "smooth", "tags": {tag: {"runs": {run: {"steps", "values"}},
    "mean": {"steps", "values"}}}}; values already smoothed, null for non-finite). One panel per
    tag: each run a thin line (a run keeps its colour in every panel), the mean a thick black line
    where the record has one. Redraws a committed figure from its JSON alone. Returns `out`."""
    # The Agg canvas renders without pyplot, so no global backend is chosen or changed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names, tags, caption = list(record["runs"]), list(record["tags"]), record.get("caption")
    windows = record.get("smooth") or {}
    if not names or not tags:
        raise ValueError("draw_series needs at least one run and one tag")
    labels = dict(zip(names, short_labels(names)))
    nan = lambda values: [math.nan if v is None else float(v) for v in values]
    columns = min(len(tags), PANEL_COLUMNS)
    rows = math.ceil(len(tags) / columns)
    fig = Figure(figsize=(4.8 * columns, 3.4 * rows + (0.5 if caption else 0)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax, tag in zip(axes, tags):
        entry = record["tags"][tag]
        for name, s in entry["runs"].items():
            ax.plot(s["steps"], nan(s["values"]), color=f"C{names.index(name) % 10}", lw=0.9, alpha=0.6,
                    label=labels[name])
        if entry["mean"]["steps"]:
            ax.plot(entry["mean"]["steps"], nan(entry["mean"]["values"]), color="black", lw=2.2,
                    label=f"mean of {len(names)}")
        window = windows.get(tag, 1)
        ax.set_title(tag if window == 1 else f"{tag} (mean of last {window})")
        ax.set_xlabel("step")
        ax.set_ylabel(value_label(tag))
        ax.grid(alpha=0.3)
    for ax in axes[len(tags):]:
        ax.set_visible(False)
    axes[0].legend(fontsize="small")
    if record.get("title"):
        fig.suptitle(record["title"])
    if caption:
        fig.supxlabel("\n".join(textwrap.wrap(caption, 70 * columns)), fontsize="small", family="monospace")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=dpi)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=summary(__doc__))
    parser.add_argument("--runs", required=True, help="comma-separated run directories")
    parser.add_argument("--tags", required=True,
                        help="comma-separated scalar tags, one panel each; tag:N smooths that tag over N points")
    parser.add_argument("--out", required=True, help="the PNG to write (its series go to .json)")
    parser.add_argument("--title", default=None)
    parser.add_argument("--caption", default=None, help="e.g. the command that produced the runs")
    parser.add_argument("--smooth", type=int, default=1, help="trailing mean over this many logged points")
    parser.add_argument("--no-mean", action="store_true", help="do not draw the mean over runs")
    args = parser.parse_args(argv)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]
    tags, windows = [], {}
    for item in split(args.tags):
        tag, _, window = item.rpartition(":") if item.rpartition(":")[2].isdigit() else (item, "", "")
        tags.append(tag)
        windows[tag] = int(window) if window else args.smooth
    print(plot_runs(split(args.runs), tags, args.out, title=args.title, caption=args.caption,
                    smooth=windows, mean=not args.no_mean))


if __name__ == "__main__":
    main()
