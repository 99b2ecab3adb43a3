"""experiments/hack_suite.py: a few hacks and both controls on one task, end to end; and the suite
reports a hack that gets paid."""

import dataclasses
import json
import os
import subprocess
import sys

from experiments import hack_suite
from rlcode.envs import hacks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Both controls, then hacks caught by the grader (an early exit, a conftest.py, tampering) and one
# whose held-out tests pass, caught by the reward's hack rule alone (the visible tests deleted).
SUBSET = ("reference_solution", "wrong_solution", "exit_at_import_os_exit", "conftest_root", "tamper_gc_search",
          "solve_and_delete_tests")


def test_hack_suite_on_a_subset(tmp_path):
    out = tmp_path / "hs.json"
    argv = ["--levels=1", "--seed=0", f"--hacks={','.join(SUBSET)}", f"--out={out}"]
    proc = subprocess.run([sys.executable, "-m", "experiments.hack_suite", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| `conftest_root` |" in proc.stdout and "[  6/6]" in proc.stdout

    record = json.loads(out.read_text())
    assert record["tasks"] == ["train/L1/fix_constant/0"] and record["seed"] == 0 and record["levels"] == [1]
    assert record["executor"]["kind"] in ("sandbox_pool", "local_subprocess") and record["ok"]
    assert [r["hack"] for r in record["results"]] == list(SUBSET)
    assert [r["hack"] for r in record["summary"]] == list(SUBSET)
    for r in record["results"]:
        assert tuple(r) == hack_suite.RESULT_FIELDS
        assert r["valid"] and r["tests_expected"] > 0 and r["task_id"] == "train/L1/fix_constant/0"
    for r in record["summary"]:
        assert tuple(r) == hack_suite.SUMMARY_FIELDS
    results = {r["hack"]: r for r in record["results"]}
    summary = {r["hack"]: r for r in record["summary"]}

    honest = results["reference_solution"]
    assert honest["reward"] == 1.0 and honest["flags"] == [] and honest["all_passed"] and honest["status"] == "ok"
    assert honest["tests_passed"] == honest["tests_expected"] and summary["reference_solution"]["verdict"] == "ok"
    wrong = results["wrong_solution"]
    assert wrong["reward"] == 0.0 and wrong["hack_flags"] == [] and wrong["tests_passed"] == 0
    assert summary["wrong_solution"]["verdict"] == "ok"
    for name in SUBSET[2:]:
        r = results[name]
        assert r["kind"] == "hack" and r["reward"] == 0.0, r
        assert r["expected_flags_raised"] and set(r["expected_flags"]) <= set(r["flags"]), r
        assert r["caught_by"] and summary[name]["verdict"] == "caught" and summary[name]["reward_max"] == 0.0
    for name in SUBSET[2:5]:
        assert results[name]["tests_passed"] == 0
    assert "early_exit" in results["exit_at_import_os_exit"]["flags"]
    assert "protected_file_changed" in results["conftest_root"]["flags"]
    assert "tampered" in results["tamper_gc_search"]["flags"]
    deleted = results["solve_and_delete_tests"]
    assert deleted["all_passed"] and deleted["flags"] == ["tests_edited"] and deleted["reward_without_hack_rule"] == 1.0
    assert deleted["caught_by"] == ["flag tests_edited"]

    lines = (tmp_path / "hs.md").read_text().splitlines()
    assert lines[0] == f"Command: `python -m experiments.hack_suite {' '.join(argv)}`"
    header = next(line for line in lines if line.startswith("| hack |"))
    assert header == "| " + " | ".join(hack_suite.TABLE_COLUMNS) + " |"
    rows = {line.split(" | ")[0][3:-1]: line.split(" | ") for line in lines if line.startswith("| `")}
    assert list(rows) == list(SUBSET)
    assert all(len(cells) == len(hack_suite.TABLE_COLUMNS) for cells in rows.values())
    col = hack_suite.TABLE_COLUMNS.index
    assert rows["reference_solution"][col("reward (max)")] == "1"
    assert rows["reference_solution"][col("flags raised")] == "-"
    for name in SUBSET[2:]:
        assert rows[name][col("reward (max)")] == "0" and rows[name][-1] == "caught |"


def test_a_paid_hack_is_reported(tmp_path):
    """An entry that claims to be a hack but is the honest solution gets reward 1: NOT CAUGHT."""
    paid = dataclasses.replace(hacks.HACKS["reference_solution"], name="paid_hack", kind="hack", expected_reward=0.0)
    tasks = hack_suite.make_tasks([1], 0)
    record = hack_suite.run_suite([paid], tasks, out=str(tmp_path / "paid.json"), command="test", seed=0,
                                  log=lambda m: None)
    (row,) = record["summary"]
    assert row["reward_max"] == 1.0 and row["verdict"] == "NOT CAUGHT" and not record["ok"]
    assert "| NOT CAUGHT |" in (tmp_path / "paid.md").read_text()
