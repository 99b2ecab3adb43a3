"""The reward-model experiment runs end to end at a tiny size, with simulated users and with a
preference file of people's choices; bad flags are one-line errors."""

import json
import os
import subprocess
import sys

import pytest

from rlcode.feedback.preferences import PreferencePair, read_preferences, write_preferences

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--init_from=", "--d_model=32", "--layers=1", "--max_len=256"]


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "experiments.reward_model", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_simulated_users_quick_writes_preferences_models_table_and_figure(tmp_path):
    out = tmp_path / "rm.json"
    proc = run("--quick", "--tasks=10", "--biases=0,2", *TINY, f"--workdir={tmp_path / 'runs'}", f"--out={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| bias=2 |" in proc.stdout
    record = json.loads(out.read_text())
    assert [r["run"] for r in record["rows"]] == ["bias=0", "bias=2"]
    for row in record["rows"]:
        assert 0 <= row["accuracy"] <= 1 and 0 <= row["gold_accuracy"] <= 1 and row["verbose_pairs"] > 0
        train = read_preferences(tmp_path / "runs" / row["run"] / "train.jsonl")
        held = read_preferences(tmp_path / "runs" / row["run"] / "heldout.jsonl")
        assert len(train) == row["train_pairs"] and len(held) == row["heldout_pairs"]
        assert not {p.prompt for p in train} & {p.prompt for p in held}
        assert os.path.isdir(tmp_path / "runs" / row["run"] / "model" / "params")
    # Same candidates and user seed, different bias: the labels differ only through the bias.
    labels = [[(p.chosen, p.rejected) for p in read_preferences(tmp_path / "runs" / r / "train.jsonl")]
              for r in ("bias=0", "bias=2")]
    assert labels[0] != labels[1] and len(labels[0]) == len(labels[1])
    assert record["runs"]["bias=0"]["history"][-1]["step"] == 10
    assert (tmp_path / "rm.png").stat().st_size > 5_000


@pytest.mark.slow
def test_a_preference_file_of_peoples_choices_trains_a_model(tmp_path):
    pairs = [PreferencePair(f"def f{i}(x):\n", "    return x + 1\n", "    return None\n", weight=1.0 + i % 2)
             for i in range(40)]
    write_preferences(tmp_path / "prefs.jsonl", pairs)
    out = tmp_path / "rm.json"
    proc = run("--quick", f"--prefs={tmp_path / 'prefs.jsonl'}", "--batch_pairs=4", *TINY,
               f"--workdir={tmp_path / 'runs'}", f"--out={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["run"] == "prefs" and row["train_pairs"] + row["heldout_pairs"] == 40 and row["heldout_pairs"] > 0
    assert "gold_accuracy" not in row  # people's choices have no gold here


@pytest.mark.parametrize("args, message", [
    (["--heldout_prefs=x.jsonl"], "--heldout_prefs needs --prefs"),
    (["--prefs=missing.jsonl"], "no preference file missing.jsonl"),
    (["--biases=0,lots"], "--biases must be numbers"),
])
def test_bad_flags_are_one_line_errors(args, message, tmp_path):
    proc = run(*args, f"--out={tmp_path / 'x.json'}", timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
