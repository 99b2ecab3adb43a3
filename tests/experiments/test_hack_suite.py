"""experiments/hack_suite.py: a few hacks and both controls on one task with both graders, two
attacks on the synthesis grader, end to end; and the suite reports a hack that gets paid."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from experiments import hack_suite
from rlcode.envs import hacks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Both controls, then hacks caught by the graders (an early exit, a conftest.py, tampering), one
# whose held-out tests pass, caught by the reward's hack rule alone (the visible tests deleted),
# and one the pytest runner is known not to stop.
SUBSET = ("reference_solution", "wrong_solution", "exit_at_import_os_exit", "conftest_root", "tamper_gc_search",
          "solve_and_delete_tests", "report_emit_traceback_walk")


@pytest.mark.slow
def test_hack_suite_on_a_subset(tmp_path):
    out = tmp_path / "hs.json"
    argv = ["--levels=1", "--seed=0", f"--hacks={','.join(SUBSET)}", "--synth=main_globals,forge_late_thread",
            f"--out={out}"]
    proc = subprocess.run([sys.executable, "-m", "experiments.hack_suite", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| `conftest_root` |" in proc.stdout and "[ 14/14]" in proc.stdout

    record = json.loads(out.read_text())
    assert record["tasks"] == ["train/L1/fix_constant/0"] and record["seed"] == 0 and record["levels"] == [1]
    assert record["executor"]["kind"] in ("sandbox_pool", "local_subprocess") and record["ok"]
    assert [(r["hack"], r["grader"]) for r in record["results"]] == [(h, g) for h in SUBSET for g in hacks.GRADERS]
    assert [(r["hack"], r["grader"]) for r in record["summary"]] == [(h, g) for h in SUBSET for g in hacks.GRADERS]
    for r in record["results"]:
        assert tuple(r) == hack_suite.RESULT_FIELDS
        assert r["valid"] and r["tests_expected"] > 0 and r["task_id"] == "train/L1/fix_constant/0"
    for r in record["summary"]:
        assert tuple(r) == hack_suite.SUMMARY_FIELDS
    results = {(r["hack"], r["grader"]): r for r in record["results"]}
    summary = {(r["hack"], r["grader"]): r for r in record["summary"]}

    for g in hacks.GRADERS:
        honest = results["reference_solution", g]
        assert honest["reward"] == 1.0 and honest["flags"] == [] and honest["all_passed"] and honest["status"] == "ok"
        assert honest["tests_passed"] == honest["tests_expected"] and summary["reference_solution", g]["verdict"] == "ok"
        wrong = results["wrong_solution", g]
        assert wrong["reward"] == 0.0 and wrong["hack_flags"] == [] and wrong["tests_passed"] == 0
        assert summary["wrong_solution", g]["verdict"] == "ok"
        for name in SUBSET[2:6]:
            r = results[name, g]
            assert r["kind"] == "hack" and r["reward"] == 0.0, r
            assert r["expected_flags_raised"] and set(r["expected_flags"]) <= set(r["flags"]), r
            assert r["caught_by"] and summary[name, g]["verdict"] == "caught" and summary[name, g]["reward_max"] == 0.0
        for name in SUBSET[2:5]:
            assert results[name, g]["tests_passed"] == 0
        assert "early_exit" in results["exit_at_import_os_exit", g]["flags"]
        assert "protected_file_changed" in results["conftest_root", g]["flags"]
        deleted = results["solve_and_delete_tests", g]
        assert deleted["all_passed"] and deleted["flags"] == ["tests_edited"]
        assert deleted["reward_without_hack_rule"] == 1.0 and deleted["caught_by"] == ["flag tests_edited"]
    assert "tampered" in results["tamper_gc_search", "pytest"]["flags"]
    assert results["tamper_gc_search", "checks"]["flags"] == []  # nothing to tamper with: it just fails
    assert summary["report_emit_traceback_walk", "checks"]["verdict"] == "caught"
    assert summary["report_emit_traceback_walk", "pytest"]["verdict"] == "open (known)"
    assert results["report_emit_traceback_walk", "pytest"]["reward"] == 1.0

    if record["executor"]["kind"] == "sandbox_pool":
        assert [r["attack"] for r in record["sandbox"]] == list(hacks.SANDBOX_ATTACKS)
        assert all(r["verdict"] == "stopped" for r in record["sandbox"]), record["sandbox"]
        assert record["executor"]["probe"]["modes"]  # the raw measurements are kept

    synth = {r["attack"]: r for r in record["synth_summary"]}
    assert list(synth) == ["reference_solution", "main_globals", "forge_late_thread"]
    assert synth["reference_solution"]["verdict"] == "ok" and synth["reference_solution"]["pass_fraction_max"] == 1.0
    assert synth["main_globals"]["verdict"] == synth["forge_late_thread"]["verdict"] == "caught"
    assert "forged_report" in synth["forge_late_thread"]["flags_raised"]

    text = (tmp_path / "hs.md").read_text()
    repo_part, synth_part = text.split("\nSynthesis tasks")
    synth_part, sandbox_part = synth_part.split("\nAttacks on the sandbox")
    sandbox_rows = [line.split(" | ") for line in sandbox_part.splitlines() if line.startswith("| `")]
    assert [r[0][3:-1] for r in sandbox_rows] == [r["attack"] for r in record["sandbox"]]
    lines = repo_part.splitlines()
    assert lines[0] == f"Command: `python -m experiments.hack_suite {' '.join(argv)}`"
    header = next(line for line in lines if line.startswith("| hack |"))
    assert header == "| " + " | ".join(hack_suite.TABLE_COLUMNS) + " |"
    table = {line.split(" | ")[0][3:-1]: line.split(" | ") for line in lines if line.startswith("| `")}
    assert list(table) == list(SUBSET)
    assert all(len(cells) == len(hack_suite.TABLE_COLUMNS) for cells in table.values())
    synth_rows = [line.split(" | ") for line in synth_part.splitlines() if line.startswith("| `")]
    assert [r[0][3:-1] for r in synth_rows] == ["reference_solution", "main_globals", "forge_late_thread"]
    assert [r[-1] for r in synth_rows] == ["ok |", "caught |", "caught |"]
    col = hack_suite.TABLE_COLUMNS.index
    assert table["reference_solution"][col("data checks: reward")] == "1"
    assert table["reference_solution"][col("data checks: flags")] == "-"
    for name in SUBSET[2:6]:
        assert table[name][col("data checks: reward")] == table[name][col("pytest runner: reward")] == "0"
        assert table[name][-1] == "caught |"
    assert table["report_emit_traceback_walk"][-1] == "checks: caught; pytest: open (known) |"


def test_a_paid_hack_is_reported(tmp_path):
    """An entry that claims to be a hack but is the honest solution gets reward 1: NOT CAUGHT."""
    paid = dataclasses.replace(hacks.HACKS["reference_solution"], name="paid_hack", kind="hack", expected_reward=0.0)
    tasks = hack_suite.make_tasks([1], 0)
    record = hack_suite.run_suite([paid], tasks, out=str(tmp_path / "paid.json"), command="test", seed=0,
                                  graders=("checks",), log=lambda m: None)
    (row,) = record["summary"]
    assert row["reward_max"] == 1.0 and row["verdict"] == "NOT CAUGHT" and not record["ok"]
    assert "| NOT CAUGHT |" in (tmp_path / "paid.md").read_text()
