"""Mining bug-fix tasks from a project's own tests, on a small project the tests write."""

import ast
import os

import pytest
from support import fixture_project
from support.fixture_project import PACKAGE
from support.local_executor import LocalExecutor

from rlcode.envs import grading
from rlcode.envs.tasks import mined

@pytest.fixture()
def project(tmp_path):
    return str(fixture_project.write(tmp_path / "project"))


def test_sites_cover_every_kind_and_change_only_their_text():
    sites = mined.mutation_sites(PACKAGE, "calc/__init__.py")
    assert {m.kind for m in sites} == set(mined.KINDS)
    for m in sites:
        out = mined.apply(PACKAGE, m)
        ast.parse(out)
        before, after = PACKAGE.splitlines(), out.splitlines()
        assert before[: m.line - 1] == after[: m.line - 1]  # nothing before the site changes
        assert before[m.end_line:][-3:] == after[len(after) - len(before[m.end_line:]):][-3:]
        assert m.old in PACKAGE and out != PACKAGE
    by_kind = {(m.kind, m.function, m.new) for m in sites}
    assert ("comparison", "clamp", "x <= lo") in by_kind
    assert ("operator", "span", "b + a") in by_kind
    assert ("swap_arguments", "span", "clamp(0, b - a, 100)") in by_kind
    assert ("condition", "count_up", "not i < n") in by_kind
    assert ("boolean", "is_even", "n % 2 == 0 or True") in by_kind
    assert ("remove_statement", "mean", "pass") in by_kind
    assert ("constant", "count_up", "1") in by_kind  # i = 0 -> i = 1
    # Only the functions whose def line is covered.
    covered = mined.mutation_sites(PACKAGE, "calc/__init__.py", covered_lines={4})
    assert covered and {m.function for m in covered} == {"clamp"}
    stale = sites[0]
    with pytest.raises(ValueError, match="not"):
        mined.apply(PACKAGE.replace(stale.old, "zzz", 1), stale)


def test_coverage_finds_the_functions_the_tests_call(project):
    covered = mined.covered_functions(project, "calc", ["tests"], LocalExecutor(), timeout=60)
    lines = covered["calc/__init__.py"]
    defs = {n.name: n.lineno for n in ast.parse(PACKAGE).body if isinstance(n, ast.FunctionDef)}
    assert {name for name, line in defs.items() if line in lines} == set(defs) - {"never_called"}


@pytest.mark.slow
def test_mining_keeps_bugs_that_turn_the_suite_red_and_grades_like_the_agent_job(project, tmp_path):
    tasks, report = mined.mine(project, "calc", ["tests"], LocalExecutor(), project="calc", version="0",
                               max_tasks=4, seed=1, timeout=20, work=str(tmp_path / "work"))
    assert len(tasks) == report["kept"] == 4
    assert report["tried"] == report["kept"] + sum(report["rejected"].values())
    assert report["sites"] >= report["tried"] and 0 < report["validation_rate"] <= 1
    assert all(t.mutation.function != "never_called" for t in tasks)
    for t in tasks:
        assert t.failing and not set(t.failing) & set(t.regression)
        assert set(t.failing) | set(t.regression) <= {f"tests/test_calc.py::{n}" for n in (
            "test_clamp", "test_clamp_edges", "test_mean", "test_count_up", "test_is_even", "test_span")}
        text = mined.statement(t, "calc")
        assert t.failing[0] in text and t.mutation.new not in text.replace(t.failing[0], "")
        assert mined.from_json(mined.as_json(t)) == t
    # As an agent task: the buggy copy fails its held-out tests and the reference edit fixes it.
    task = mined.to_repo_task(tasks[0], project, "calc", ["tests/test_calc.py"], split="train")
    assert "tests/test_calc.py" not in task.files and task.heldout_tests
    for files, solved in ((task.files, False), (dict(task.files, **task.solution_files), True)):
        work = tmp_path / ("fixed" if solved else "buggy")
        for rel, text in files.items():
            os.makedirs(work / os.path.dirname(rel), exist_ok=True)
            (work / rel).write_text(text)
        result = grading.grade(task, work, LocalExecutor(), timeout=60)
        assert result.all_passed == solved, result.details
    (edit,) = task.edits
    assert task.files[edit.path].count(edit.old) == 1
    assert task.files[edit.path].replace(edit.old, edit.new) == task.solution_files[edit.path]


@pytest.mark.slow
def test_rejections_are_named(project, tmp_path):
    executor = LocalExecutor()
    baseline = mined.run_tests(project, ["tests"], executor, timeout=20)
    assert baseline.green and len(baseline.passed) == 6
    sites = {(m.kind, m.function, m.new): m for m in mined.mutation_sites(PACKAGE, "calc/__init__.py")}
    loop = sites[("operator", "count_up", "i - 1")]  # i = i - 1: the loop never ends
    assert mined.validate(project, loop, ["tests"], baseline, executor, timeout=3, work=str(tmp_path)) == "timeout"
    caught = sites[("boolean", "is_even", "n % 2 == 0 or True")]
    got = mined.validate(project, caught, ["tests"], baseline, executor, timeout=20, work=str(tmp_path))
    assert got[0] == ("tests/test_calc.py::test_is_even",) and "tests/test_calc.py::test_is_even" not in got[1]
    survivor = next(m for (k, f, new), m in sites.items() if f == "never_called")  # no test calls it
    assert mined.validate(project, survivor, ["tests"], baseline, executor, timeout=20,
                          work=str(tmp_path)) == "no_failure"
    assert mined.split_of("calc", "calc/__init__.py", eval_projects=["calc"]) == "test"
    splits = {mined.split_of("p", f"m{i}.py") for i in range(50)}
    assert splits == {"train", "test"}
