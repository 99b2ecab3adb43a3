"""experiments.plot_training: two fake runs logged with EventWriter become a PNG and a JSON whose
mean is the hand-computed mean over runs at the steps both runs logged."""

import json

import numpy as np
import pytest

from experiments import plot_training
from rlcode.train.metrics import EventWriter


def write_runs(tmp_path):
    seed0, seed1 = tmp_path / "runs" / "seed0", tmp_path / "runs" / "seed1"
    with EventWriter(seed0) as writer:  # metrics.jsonl directly in the run directory
        for step in range(0, 40, 10):
            writer.scalars(step, {"loss": 1.0 / (step + 1), "eval/pass@1": step / 100})
    with EventWriter(seed1 / "tb") as writer:  # ... or in its tb/ subdirectory
        for step in range(0, 60, 10):
            writer.scalars(step, {"loss": 2.0 / (step + 1)})
            if step % 20 == 0:
                writer.scalars(step, {"eval/pass@1": step / 50})
    return str(seed0), str(seed1)


def test_plot_runs_png_and_traced_series(tmp_path):
    runs = write_runs(tmp_path)
    out = tmp_path / "figures" / "grpo_synth.png"
    path = plot_training.plot_runs(runs, ["eval/pass@1", "loss"], str(out), title="GRPO", caption="python -m x")
    assert path == str(out)
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    series = json.loads(out.with_suffix(".json").read_text())
    assert series["runs"] == list(runs) and series["caption"] == "python -m x"
    # pass@1: seed0 at 0, 10, 20, 30; seed1 at 0, 20, 40 -> common steps 0, 20.
    mean = series["tags"]["eval/pass@1"]["mean"]
    assert mean["steps"] == [0, 20]
    assert mean["values"] == pytest.approx([0.0, (0.20 + 0.40) / 2])
    assert series["tags"]["eval/pass@1"]["runs"][runs[1]] == {"steps": [0, 20, 40], "values": [0.0, 0.4, 0.8]}
    mean = series["tags"]["loss"]["mean"]
    assert mean["steps"] == [0, 10, 20, 30]
    assert mean["values"] == pytest.approx([1.5 / (s + 1) for s in (0, 10, 20, 30)])


def test_main_and_unknown_tag(tmp_path, capsys):
    runs = write_runs(tmp_path)
    out = tmp_path / "fig.png"
    plot_training.main(["--runs", ",".join(runs), "--tags", "loss", "--out", str(out)])
    assert capsys.readouterr().out.strip() == str(out)
    assert out.stat().st_size > 0 and out.with_suffix(".json").exists()
    with pytest.raises(ValueError, match="no run logged"):
        plot_training.plot_runs(runs, ["eval/typo"], str(out))
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_training.plot_runs([str(tmp_path / "nowhere")], ["loss"], str(out))
    with pytest.raises(ValueError, match="twice"):
        plot_training.plot_runs([runs[0], runs[0]], ["loss"], str(out))
    assert plot_training.short_labels(list(runs)) == ["seed0", "seed1"]  # the legend's labels


def test_trailing_mean_matches_a_loop():
    from experiments.plot_training import trailing_mean

    values = [1.0, 5.0, 2.0, 8.0, 3.0]
    for w in (1, 2, 3, 10):
        expect = [sum(values[max(0, i - w + 1): i + 1]) / len(values[max(0, i - w + 1): i + 1]) for i in range(5)]
        assert np.allclose(trailing_mean(values, w), expect)


def test_per_tag_smoothing_from_the_command_line(tmp_path):
    run = tmp_path / "seed0"
    with EventWriter(run / "tb") as w:
        for step in range(1, 5):
            w.scalars(step, {"rollout/pass@1": float(step), "eval/pass@1": float(step)})
    out = tmp_path / "fig.png"
    plot_training.main(["--runs", str(run), "--tags", "rollout/pass@1:2,eval/pass@1", "--out", str(out)])
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["tags"]["rollout/pass@1"]["mean"]["values"] == [1.0, 1.5, 2.5, 3.5]
    assert data["tags"]["eval/pass@1"]["mean"]["values"] == [1.0, 2.0, 3.0, 4.0]
