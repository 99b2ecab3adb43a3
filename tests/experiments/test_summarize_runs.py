"""summarize_runs reads finished runs' logs and reports start / end / change / lowest value."""

import json

import numpy as np
import pytest

from experiments import summarize_runs
from rlcode.train.metrics import EventWriter


def fake_run(path, series, seconds=600.0, completed=True):
    path.mkdir(parents=True)
    with EventWriter(path / "tb") as w:
        w.scalars(-5, {"sft/nll": 1.0})
        for step, values in series:
            w.scalars(step, values)
    json.dump({"completed": completed, "seconds": seconds, "steps_done": 4}, open(path / "summary.json", "w"))


def test_summary_per_metric(tmp_path):
    fake_run(tmp_path / "a", [(0, {"eval/pass@1": 0.1, "eval/best_of_16": 0.5}), (2, {"eval/pass@1": 0.2, "eval/best_of_16": 0.4}),
                             (4, {"eval/pass@1": 0.3, "eval/best_of_16": 0.6})], seconds=600)
    fake_run(tmp_path / "b", [(0, {"eval/pass@1": 0.2, "eval/best_of_16": 0.5}), (2, {"eval/pass@1": 0.2, "eval/best_of_16": 0.5}),
                             (4, {"eval/pass@1": 0.2, "eval/best_of_16": 0.7})], seconds=720)
    out = summarize_runs.summarize([str(tmp_path / "a"), str(tmp_path / "b")])
    p1 = out["metrics"]["eval/pass@1"]
    assert np.allclose(p1["start"], (0.15, np.std([0.1, 0.2], ddof=1)))
    assert np.allclose(p1["delta"][0], (0.2 + 0.0) / 2)
    assert np.allclose(out["metrics"]["eval/best_of_16"]["min_after_start"][0], (0.4 + 0.5) / 2)
    assert "eval_fresh/pass@1" not in out["metrics"]
    assert np.allclose(out["minutes"][0], 11.0)
    table = summarize_runs.markdown(out)
    assert "| eval/pass@1 | 0.150" in table and "2 runs" in table


def test_unfinished_run_is_refused(tmp_path):
    fake_run(tmp_path / "a", [(0, {"eval/pass@1": 0.1})], completed=False)
    with pytest.raises(ValueError, match="did not complete"):
        summarize_runs.summarize([str(tmp_path / "a")])


def test_timing_medians_and_idle_shares(tmp_path):
    steps = [(s, {"time/step_s": 2.0, "time/sample_s": 0.5, "time/execute_s": 0.5, "time/train_s": 1.0,
                  "time/wait_for_rollout_s": 1.0}) for s in range(1, 8)]
    steps[0] = (1, {**steps[0][1], "time/step_s": 30.0, "time/train_s": 29.0})  # a compiling step, left out
    steps[4] = (5, {**steps[4][1], "time/step_s": 4.0, "time/wait_for_rollout_s": 3.0})
    fake_run(tmp_path / "a", steps)
    (row,) = summarize_runs.step_times([str(tmp_path / "a")], skip=1)
    assert row["steps"] == 6 and row["step_s"] == 2.0 and row["train_s"] == 1.0 and row["wait_for_rollout_s"] == 1.0
    assert row["idle"] == {"trainer": 0.5, "sampling": 0.75, "grading": 0.75, "sampler": 0.5}
    assert "| 6 | 2.000 | 0.500 | 0.500 | 1.000 | 1.000 | 50% / 75% / 75% / 50% |" in summarize_runs.timing_markdown([row])
    with pytest.raises(ValueError, match="no step after step 7"):
        summarize_runs.step_times([str(tmp_path / "a")], skip=7)
