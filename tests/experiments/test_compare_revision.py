"""experiments/compare_revision.py: the graders and the sandbox of the revision before the trusted
verdicts, against this tree's, in one run (skipped where the clone lacks that revision)."""

import json
import os
import subprocess
import sys

import pytest

from experiments import compare_revision

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _has_revision() -> bool:
    return subprocess.run(["git", "-C", ROOT, "cat-file", "-e", compare_revision.BEFORE + "^{commit}"],
                          capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _has_revision(), reason=f"revision {compare_revision.BEFORE[:12]} is not in this "
                                "clone's history (shallow clone)")


def _run(tmp_path, *args):
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "experiments.compare_revision", *args, f"--out={out}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_the_old_graders_pay_attacks_that_the_new_ones_do_not(tmp_path):
    record = _run(tmp_path, "--what=graders", "--quick")
    attacks = {a["attack"]: a for a in record["synthesis_attacks"]}
    assert set(attacks) == {"main_globals", "forge_at_exit"}
    for a in attacks.values():
        assert a["old_mean"] == 1.0 and a["old_full"] == a["tasks"] == 2 and a["new_max"] == 0.0, a
    assert record["ordinary_candidates"] == 4 and record["disagreements"] == []
    repo = {r["hack"]: r for r in record["repository_attacks"]}
    assert repo["report_emit_main"]["old"] == 1.0 and repo["report_emit_main"]["checks"] == 0.0
    assert repo["report_emit_main"]["pytest"] == 0.0
    assert repo["report_emit_traceback_walk"]["checks"] == 0.0 and repo["report_emit_traceback_walk"]["pytest"] == 1.0


@pytest.mark.slow
def test_sandbox_latency_of_both_trees(tmp_path):
    record = _run(tmp_path, "--what=sandbox", "--rounds=2", "--executions=5")
    assert [len(record["rounds"][w]) for w in ("before", "now")] == [2, 2]
    assert set(record["now_over_before"]) == {"true", "python_inprocess", "python_exec"}
    assert all(0 < v for v in record["now_over_before"].values())
    worktrees = subprocess.run(["git", "-C", ROOT, "worktree", "list"], capture_output=True, text=True).stdout
    assert "rlcode_rev_" not in worktrees  # the revision's worktree was removed
