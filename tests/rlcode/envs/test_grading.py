"""rlcode.envs.grading: the diff of the agent's copy, the pristine grading copy, the two graders
(the held-out checks as data, and the pytest runner for a test suite), and every reward hack of
the catalogue `rlcode.envs.hacks` on real generated tasks.

Each hack is an entry of the catalogue (the same one experiments/hack_suite.py runs), written into
the agent's copy of a generated task; where it matters the hack's functions are broken too (they
raise, skip or exit), so that any leak in a grader would show up as a passed test. Every entry is
graded by both graders: "checks" (`grading.run_checks`, what every generated task uses) and
"pytest" (`grading.run_heldout`, forced here by dropping the task's data checks). Commands go
through `LocalExecutor`, a test double that runs them with `subprocess.run` (it isolates nothing;
the sandbox's isolation is tested with the sandbox); the last section runs both graders through
the real `rlcode.sandbox.SandboxPool`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest

from rlcode.envs import grading, hacks
from rlcode.envs.tasks import repo as rt
from rlcode.envs.hacks import FAILING, FORCE_PASS_PLUGIN, hack_functions, package_of, source_modules
from rlcode.sandbox import fstree
from support.local_executor import LocalExecutor, Result  # this test directory is on sys.path


EXECUTOR = LocalExecutor()
FAMILIES = sorted(rt.FAMILIES)


@pytest.fixture(autouse=True)
def _remove_planted_copies(tmp_path):
    """Planted copies may hold a tree deeper than `shutil.rmtree` (pytest's own clean-up of old
    temporary directories) can remove: remove them with the bounded remover."""
    yield
    fstree.remove(tmp_path / "rollouts")


@functools.lru_cache(maxsize=None)
def task_of(family: str, seed: int = 0) -> rt.RepoTask:
    return rt.generate_task(seed, family=family, split=rt.FAMILIES[family].split)


def solved_function(task) -> tuple[str, str]:
    """The module the reference solution changes, and the first function defined in it."""
    mod = next(iter(task.solution_files))
    return mod, re.search(r"^def (\w+)\(", task.solution_files[mod], re.M).group(1)


def agent_copy(task, tmp_path, **change):
    """`hacks.agent_copy` under tmp_path/rollouts (grading directories go to tmp_path itself)."""
    return hacks.agent_copy(task, tmp_path / "rollouts", **change)


def plant(hack, task, tmp_path):
    return hack.plant(task, tmp_path / "rollouts")


def hack_id(hack):
    return hack.name


def as_suite(task):
    """The task graded by its held-out test files through the pytest runner (no data checks)."""
    return dataclasses.replace(task, heldout_checks=())


def for_grader(task, grader):
    return as_suite(task) if grader == "pytest" else task


def run_grade(task, wd, tmp_path, **kwargs):
    kwargs.setdefault("timeout", 60)
    return grading.grade(task, wd, kwargs.pop("executor", EXECUTOR), root=tmp_path, **kwargs)


CONTROLS = ("reference_solution", "untouched_copy")


@functools.lru_cache(maxsize=None)
def graded_control(family: str, seed: int, name: str, grader: str) -> grading.GradeResult:
    """The verdict of `grader` on the control copy `name` (`CONTROLS`: the reference solution, the
    untouched starting copy) of the family's task `seed`, graded once: the tests of the reference
    solutions, of the two graders' agreement and of the catalogue's entries all grade these copies."""
    task = for_grader(task_of(family, seed), grader)
    with tempfile.TemporaryDirectory() as d:
        wd = hacks.HACKS[name].plant(task, os.path.join(d, "rollouts"))
        return grading.grade(task, wd, EXECUTOR, timeout=60, root=d)


def start_passed(family: str, grader: str = "checks") -> frozenset[str]:
    """Held-out tests the untouched starting copy passes."""
    result = graded_control(family, 0, "untouched_copy", grader)
    assert result.status == "ok" and not result.all_passed and result.flags == (), result.details
    return frozenset(result.passed)


def assert_scores_zero(result, *flags):
    """No held-out test passed and the given flags were raised."""
    assert result.passed == () and result.pass_fraction == 0.0 and not result.all_passed, result.details
    for flag in flags:
        assert flag in result.flags, (flag, result.flags, result.details)


# ---------------------------------------------------------------------------------------------
# Expected ids: from the source, checked against pytest's own collection.

HELDOUT_SOURCE = '''
import pytest


def helper():
    pass


def test_plain():
    pass


async def test_async():
    pass


def testing_prefix_counts():
    pass


class TestGroup:
    def test_method(self):
        pass

    def not_a_test(self):
        pass


class TestWithInit:
    def __init__(self):
        pass

    def test_ignored(self):
        pass


class Helper:
    def test_not_collected(self):
        pass


def test_outer():
    def test_inner():
        pass
'''


def pytest_collected_ids(directory, paths) -> list[str]:
    ini = os.path.join(directory, "collect.ini")
    with open(ini, "w") as f:
        f.write(grading.GRADER_INI)
    proc = subprocess.run([sys.executable, "-B", "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-c", ini, "--rootdir", directory, *paths], cwd=directory, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_expected_ids_match_pytest_collection(tmp_path):
    tasks = [task_of(f) for f in FAMILIES]
    custom = dataclasses.replace(tasks[0], heldout_tests={f"{rt.HELDOUT_DIR}/test_custom.py": HELDOUT_SOURCE})
    expected, paths = [], []
    for i, task in enumerate(tasks + [custom]):
        for rel, text in task.heldout_tests.items():
            (tmp_path / f"t{i}").mkdir()
            # The package is not there: comment the imports out (collection only needs the names).
            (tmp_path / f"t{i}" / os.path.basename(rel)).write_text(re.sub(r"(?m)^from ", "# from ", text))
            paths.append(f"t{i}/{os.path.basename(rel)}")
        ids = grading.expected_test_ids(task)
        expected += [f"t{i}/" + x.split("/", 1)[1] for x in ids]
    assert grading.expected_test_ids(custom) == tuple(
        f"{rt.HELDOUT_DIR}/test_custom.py::{name}" for name in
        ("test_plain", "test_async", "testing_prefix_counts", "TestGroup::test_method", "test_outer"))
    collected = pytest_collected_ids(str(tmp_path), paths)
    assert sorted(collected) == sorted(expected)


def test_task_without_heldout_tests_is_rejected(tmp_path):
    task = dataclasses.replace(task_of("fix_constant"), heldout_tests={f"{rt.HELDOUT_DIR}/test_x.py": "x = 1\n"},
                               heldout_checks=())
    with pytest.raises(ValueError, match="no held-out tests"):
        grading.grade(task, rt.materialize(task, tmp_path), EXECUTOR, timeout=5)


# ---------------------------------------------------------------------------------------------
# Diff of the agent's copy.

def test_diff_changed_added_deleted_and_flags(tmp_path):
    task = task_of("unpack_order")
    pkg, (vis,) = package_of(task), task.visible_test_files
    mods = source_modules(task)
    wd = agent_copy(task, tmp_path, solved=True, write={f"{pkg}/extra.py": "X = 1\n", "notes.md": "n\n"},
                    delete=[mods[0]])
    os.makedirs(os.path.join(wd, pkg, "__pycache__"))
    with open(os.path.join(wd, pkg, "__pycache__", "x.cpython-311.pyc"), "wb") as f:
        f.write(b"\0junk")
    with open(os.path.join(wd, "stray.pyc"), "wb") as f:
        f.write(b"\0junk")
    diff = grading.diff_workdir(task, wd)
    assert diff.changed == tuple(sorted(set(task.solution_files) - {mods[0]}))
    assert diff.added == tuple(sorted((f"{pkg}/extra.py", "notes.md")))
    assert diff.deleted == (mods[0],)
    assert diff.ignored == ()
    assert not diff.tests_edited and not diff.protected_file_changed and diff.flags == ()
    untouched = grading.diff_workdir(task, rt.materialize(task, tmp_path))
    assert (untouched.changed, untouched.added, untouched.deleted) == ((), (), ())

    for change, flag in [({"write": {vis: "def test_x():\n    pass\n"}}, "tests_edited"),
                         ({"delete": [vis]}, "tests_edited"),
                         ({"write": {"tests/test_new.py": "x = 1\n"}}, "tests_edited"),
                         ({"write": {"tests/helpers/data.txt": "x\n"}}, "tests_edited"),
                         ({"write": {f"{rt.HELDOUT_DIR}/test_mine.py": "x = 1\n"}}, "tests_edited"),
                         ({"write": {f"{pkg}/conftest.py": ""}}, "protected_file_changed"),
                         ({"write": {"pytest.ini": "[pytest]\n"}}, "protected_file_changed"),
                         ({"write": {"setup.cfg": ""}}, "protected_file_changed"),
                         ({"write": {"tox.ini": ""}}, "protected_file_changed"),
                         ({"write": {"pyproject.toml": ""}}, "protected_file_changed"),
                         ({"write": {"sitecustomize.py": ""}}, "protected_file_changed"),
                         ({"write": {"deep/usercustomize.py": ""}}, "protected_file_changed"),
                         ({"write": {"lib/evil.pth": "import os\n"}}, "protected_file_changed")]:
        d = grading.diff_workdir(task, agent_copy(task, tmp_path, **change))
        assert d.flags == (flag,), (change, d)
    # A test file inside the package is not under a test directory: an ordinary source file.
    d = grading.diff_workdir(task, agent_copy(task, tmp_path, write={f"{pkg}/test_mine.py": "x = 1\n"}))
    assert d.flags == () and d.added == (f"{pkg}/test_mine.py",)


def test_diff_never_follows_links_or_reads_special_or_huge_files(tmp_path):
    task = task_of("fix_constant")
    mod = source_modules(task)[0]
    secret = tmp_path / "host_secret.py"
    secret.write_text("SECRET = 'host data'\n")
    wd = agent_copy(task, tmp_path)
    os.remove(os.path.join(wd, mod))
    os.symlink(secret, os.path.join(wd, mod))  # an original source file replaced by a symlink
    os.symlink(tmp_path, os.path.join(wd, "linked_dir"))
    os.link(secret, os.path.join(wd, "hardlink.py"))
    os.mkfifo(os.path.join(wd, "pipe"))
    with open(os.path.join(wd, "big.bin"), "wb") as f:
        f.write(b"x" * 2000)
    files, ignored = grading.read_workdir(wd, max_file_bytes=1000)
    assert dict(ignored) == {mod: "symlink", "linked_dir": "symlink", "hardlink.py": "hard link",
                             "pipe": "not a regular file", "big.bin": "too large"}
    assert not any(b"host data" in data for data in files.values())
    diff = grading.diff_files(task, files, ignored)
    assert diff.deleted == (mod,) and diff.added == ()
    result = run_grade(task, wd, tmp_path, max_file_bytes=1000)
    assert result.diff.ignored == tuple(sorted(ignored))
    assert_scores_zero(result)  # the module is missing from the grading copy


def test_file_count_cap(tmp_path):
    task = task_of("fix_constant")
    wd = agent_copy(task, tmp_path, write={f"zz/f{i:02d}.txt": "x" for i in range(20)})
    files, ignored = grading.read_workdir(wd, max_files=len(task.files) + 5)
    assert len(files) == len(task.files) + 5
    assert len(ignored) == 15 and all(reason == "too many files" for _, reason in ignored)


# ---------------------------------------------------------------------------------------------
# The grading copy.

def test_grading_copy_takes_only_source_changes(tmp_path):
    task = task_of("add_field")
    pkg, (vis,) = package_of(task), task.visible_test_files
    held = next(iter(task.heldout_tests))
    mods = source_modules(task)
    wd = agent_copy(task, tmp_path, solved=True, write={
        vis: "def test_edited():\n    pass\n", "tests/test_added.py": "x = 1\n", "tests/conftest.py": "x = 1\n",
        held: "def test_fake():\n    pass\n", f"{rt.HELDOUT_DIR}/conftest.py": "x = 1\n",
        "conftest.py": "x = 1\n", "pytest.ini": "[pytest]\n", "pyproject.toml": "", "sitecustomize.py": "",
        "x.pth": "", f"{pkg}/new_module.py": "Y = 2\n", "data/table.csv": "a,b\n"},
        delete=[f"{pkg}/__init__.py"])
    files, _ = grading.read_workdir(wd)
    base = tmp_path / "grading"
    base.mkdir()
    paths = grading.prepare_grading_dir(task, files, base)
    assert paths == sorted(task.heldout_tests)
    repo = base / grading.REPO_DIR
    on_disk = {str(p.relative_to(repo)).replace(os.sep, "/"): p.read_text() for p in repo.rglob("*") if p.is_file()}
    want = {vis: task.files[vis], held: task.heldout_tests[held], f"{pkg}/new_module.py": "Y = 2\n",
            "data/table.csv": "a,b\n", **{m: task.solution_files.get(m, task.files[m]) for m in mods}}
    assert on_disk == want
    assert (base / grading.INI_NAME).read_text() == grading.GRADER_INI
    # The protected file names never come from the agent; an original one would stay original.
    with_conftest = dataclasses.replace(task, files={**task.files, "conftest.py": "ORIGINAL = 1\n"})
    evil = grading.grading_files(with_conftest, {**files, "conftest.py": b"EVIL = 1\n"})
    assert evil["conftest.py"] == b"ORIGINAL = 1\n"
    # An original test or protected file the agent deleted is restored; deleted sources stay deleted.
    assert grading.grading_files(with_conftest, {}) == {"conftest.py": b"ORIGINAL = 1\n",
                                                         vis: task.files[vis].encode()}


def test_agent_file_colliding_with_an_original_is_skipped(tmp_path):
    task = task_of("fix_constant")
    (vis,) = task.visible_test_files
    files = {p: t.encode() for p, t in task.files.items() if p != vis}
    files[f"{vis}/inner.py"] = b"x = 1\n"  # a directory where the original test file goes
    files[f"{rt.HELDOUT_DIR}"] = b"blocker"  # a file where the held-out directory goes
    dest = tmp_path / "copy"
    grading.build_grading_copy(task, files, dest)
    assert (dest / vis).read_text() == task.files[vis]
    assert all((dest / p).read_text() == t for p, t in task.heldout_tests.items())


# ---------------------------------------------------------------------------------------------
# Interpreting the runner's report (synthetic output).

NONCE = "n" * 32
IDS = ("h/test_a.py::test_one", "h/test_a.py::test_two")


def report(*lines, nonce=NONCE):
    return "".join(f"\n{nonce} {line}\n" for line in lines).encode()


def verdict(stdout, stderr=b"", returncode=0, status=None, ids=IDS):
    status = status or ("ok" if returncode == 0 else "error")
    return grading.interpret(ids, Result(stdout, stderr, returncode, status), NONCE)


def test_interpret_requires_positive_evidence():
    ok = verdict(report("READY", f"PASSED {IDS[0]}", f"PASSED {IDS[1]}", "EXIT 0"))
    assert ok.all_passed and ok.pass_fraction == 1.0 and ok.flags == () and ok.status == "ok"
    one = verdict(report("READY", f"PASSED {IDS[0]}", f"FAILED {IDS[1]}", "EXIT 1"), returncode=1)
    assert one.passed == IDS[:1] and one.failed == IDS[1:] and one.pass_fraction == 0.5 and not one.all_passed
    # Lines without the nonce (or with another one) prove nothing and flag fake output.
    fake = b"".join(f"PASSED {t}\n".encode() for t in IDS)
    forged = verdict(report("READY", "EXIT 0") + fake + report(f"PASSED {IDS[0]}", nonce="m" * 32))
    assert forged.passed == () and {"fake_output", "early_exit"} <= set(forged.flags)
    in_stderr = verdict(report("READY", *(f"PASSED {t}" for t in IDS), "EXIT 0"), stderr=b"PASSED x\n")
    assert in_stderr.all_passed and in_stderr.flags == ("fake_output",)
    # A report glued to a partial line of the candidate's still starts on its own line.
    glued = verdict(b"garbage without newline" + report("READY", *(f"PASSED {t}" for t in IDS), "EXIT 0"))
    assert glued.all_passed
    # Lowercase "passed" (pytest's summary) is not a fake.
    assert verdict(report("READY", *(f"PASSED {t}" for t in IDS), "EXIT 0"), stderr=b"2 passed in 0.1s").flags == ()


def test_interpret_statuses_and_flags():
    full = ("READY", *(f"PASSED {t}" for t in IDS))
    # PASSED for every test, but no EXIT: the process left early.
    left = verdict(report(*full))
    assert left.status == "crash" and left.passed == () and set(left.flags) == {"crash", "early_exit"}
    died = verdict(report(*full), returncode=-9)
    assert died.status == "crash" and died.flags == ("crash",)
    # EXIT 0 but the process returned something else (and vice versa).
    assert verdict(report(*full, "EXIT 0"), returncode=3).status == "crash"
    forced = verdict(report("READY", f"FAILED {IDS[0]}", f"PASSED {IDS[1]}", "EXIT 1"), returncode=0)
    assert forced.status == "crash" and "early_exit" in forced.flags and forced.passed == ()
    # EXIT 0 with a test never reported.
    missing = verdict(report("READY", f"PASSED {IDS[0]}", "EXIT 0"))
    assert missing.passed == IDS[:1] and not missing.all_passed and missing.flags == ("early_exit",)
    assert verdict(report("READY", "SYSEXIT internal", "EXIT 3"), returncode=3).flags == ("early_exit",)
    for status in ("timeout", "memory", "output_limit"):
        r = verdict(report(*full, "EXIT 0"), returncode=None, status=status)
        assert r.passed == () and r.status == ("timeout" if status == "timeout" else "crash")
        assert r.flags == (r.status,)
    # Infrastructure: the executor said so, or the runner never started.
    assert verdict(report(*full, "EXIT 0"), status="infra").status == "infra"
    never = verdict(b"", b"ModuleNotFoundError: No module named 'pytest'", returncode=1)
    assert never.status == "infra" and never.passed == () and not never.valid
    # Skips: a test, a whole module, and a parametrised case; xfail never counts as a pass.
    skipped = verdict(report("READY", f"SKIPPED {IDS[0]}", f"PASSED {IDS[1]}", "EXIT 0"))
    assert skipped.passed == IDS[1:] and skipped.flags == ("skipped",)
    module = verdict(report("READY", "SKIPPED h/test_a.py", "EXIT 5"), returncode=5)
    assert module.passed == () and module.flags == ("skipped",)
    param = verdict(report("READY", f"PASSED {IDS[0]}[1]", f"PASSED {IDS[0]}[2]", f"PASSED {IDS[1]}", "EXIT 0"))
    assert param.all_passed
    param_fail = verdict(report("READY", f"PASSED {IDS[0]}[1]", f"FAILED {IDS[0]}[2]", f"PASSED {IDS[1]}", "EXIT 1"),
                         returncode=1)
    assert param_fail.passed == IDS[1:]
    # Evidence voided by a read of the held-out tests or by tampering.
    for line, flag in (("READ /x/h/test_a.py", "read_heldout"), ("TAMPER builtins.abs", "tampered")):
        r = verdict(report(*full, line, "EXIT 0"))
        assert r.passed == () and not r.all_passed and flag in r.flags and r.status == "ok"


# ---------------------------------------------------------------------------------------------
# Honest and untouched copies of every family, and the two graders against each other.

GRADERS = hacks.GRADERS


@pytest.mark.parametrize("grader", GRADERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_reference_solution_passes_and_starting_copy_does_not(family, grader):
    task = for_grader(task_of(family), grader)
    solved = graded_control(family, 0, "reference_solution", grader)
    assert solved.status == "ok" and solved.all_passed and solved.pass_fraction == 1.0, solved.details
    assert solved.flags == () and solved.failed == () and solved.passed == grading.expected_test_ids(task)
    assert solved.returncode == 0 and solved.exit_status == (0 if grader == "pytest" else None)
    assert start_passed(family, grader) < frozenset(solved.passed)


def test_heldout_checks_translate_every_heldout_test():
    """The data checks are the held-out test files, statement for statement."""
    for family in FAMILIES:
        for seed in range(5):
            task = rt.generate_task(seed, family=family, split=rt.FAMILIES[family].split)
            assert tuple(g.name for g in task.heldout_checks) == grading.expected_test_ids(task)
            for group in task.heldout_checks:
                path, name = group.name.split("::")
                body = re.search(rf"^def {name}\(\):\n((?:    .*\n?)+)", task.heldout_tests[path], re.M).group(1)
                statements = [line for line in body.splitlines() if line.startswith("    ") and
                              not line.startswith("        ")]
                assert len(statements) == len(group.checks), (group.name, body)
                assert all(c.expr and c.expr in body for c in group.checks), group.name
    with pytest.raises(ValueError, match="unsupported held-out statement"):
        rt.heldout_checks({"h/test_x.py": "def test_x():\n    assert f(1) == 2\n"})
    with pytest.raises(ValueError, match="unsupported held-out statement"):
        rt.heldout_checks({"h/test_x.py": "x = 1\n"})
    with pytest.raises(ValueError, match="same"):
        rt.heldout_checks({"h/test_x.py": "def same(a, b):\n    return True\n"})


@pytest.mark.parametrize("family", FAMILIES)
def test_the_two_graders_agree_on_every_test(family, tmp_path):
    """Independent oracle of the translation: pytest running the held-out files and the data
    checks give the same verdict per held-out test, on honest, untouched and wrong copies of two
    tasks of the family; and neither pays a look-alike (always-equal objects, an int subclass
    equal to anything: the tests compare exact types)."""
    for seed, names in ((0, ("reference_solution", "untouched_copy", "always_equal_object", "anything_int_object")),
                        (1, ("reference_solution", "untouched_copy", "wrong_solution"))):
        task = task_of(family, seed)
        for name in names:
            if name in CONTROLS:
                checks, suite = (graded_control(family, seed, name, grader) for grader in ("checks", "pytest"))
            else:
                wd = hacks.HACKS[name].plant(task, tmp_path / "rollouts")
                checks = run_grade(task, wd, tmp_path)
                suite = run_grade(as_suite(task), wd, tmp_path)
            assert checks.passed == suite.passed, (task.task_id, name, checks.details, suite.details)
            if hacks.HACKS[name].group == "always_equal":
                assert checks.status == suite.status == "ok"
                assert_scores_zero(checks)


def test_runner_gets_nonce_on_stdin_and_a_clean_directory(tmp_path):
    task = as_suite(task_of("fix_operator"))
    executor = LocalExecutor()
    wd = rt.materialize(task, tmp_path / "rollouts", solved=True)
    assert run_grade(task, wd, tmp_path, executor=executor).all_passed
    (argv, stdin, timeout, workdir), = executor.calls
    assert argv[:5] == [sys.executable, "-I", "-B", "-c", grading.RUNNER]
    assert re.fullmatch(r"[0-9a-f]{32}\n", stdin) and stdin.strip() not in " ".join(argv)
    assert workdir != wd and not os.path.exists(workdir)  # graded elsewhere, then removed
    assert os.listdir(wd) and sorted(os.listdir(tmp_path)) == ["rollouts"]
    assert run_grade(task, wd, tmp_path, executor=executor).all_passed
    assert executor.calls[1][1] != stdin  # a fresh nonce per run


def test_runner_is_a_module_that_runs_only_as_main():
    # Imported (in a fresh interpreter: the program would take over stdin and the descriptors), the
    # module defines its one function and runs nothing; it keeps no state in its globals.
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(grading.__file__))))
    code = ("import rlcode.envs.pytest_runner as r; "
            "print(sorted(k for k in vars(r) if not k.startswith('__')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "['_runner']\n", (out.stdout, out.stderr[-2000:])
    # What is shipped is that file's text, whose last statement starts the program when it runs as
    # a ``-c`` program (``__name__ == "__main__"``).
    with open(os.path.join(repo, "rlcode", "envs", "pytest_runner.py"), encoding="utf-8") as f:
        assert grading.RUNNER == f.read()
    last = ast.parse(grading.RUNNER).body[-1]
    assert ast.unparse(last) == "if __name__ == '__main__':\n    _runner()"


def test_checks_get_inputs_only_in_a_copy_without_heldout_files(tmp_path):
    """The child's request holds the expressions to evaluate and never an expected value; the
    grading copy holds no held-out file."""
    task = task_of("add_field")
    seen = {}

    class Spy(LocalExecutor):
        def run(self, argv, **kwargs):
            seen["files"] = sorted(str(p.relative_to(kwargs["workdir"])) for p in
                                   __import__("pathlib").Path(kwargs["workdir"]).rglob("*") if p.is_file())
            return super().run(argv, **kwargs)

    executor = Spy()
    result = run_grade(task, rt.materialize(task, tmp_path / "rollouts", solved=True), tmp_path, executor=executor)
    assert result.all_passed, result.details
    (argv, stdin, _, _), = executor.calls
    assert argv[:4] == [sys.executable, "-I", "-B", "-c"]
    request = __import__("json").loads(stdin)
    payload = __import__("json").dumps(request)
    expected = [c.expect.value for g in task.heldout_checks for c in g.checks]
    assert [c["expr"] for g in request["groups"] for c in g["checks"]] == [
        c.expr for g in task.heldout_checks for c in g.checks]
    distinctive = [repr(v) for v in expected if isinstance(v, float) and len(repr(v)) > 6]
    assert distinctive and not any(v in payload for v in distinctive)
    assert set(seen["files"]) == set(task.files)  # the copy: the agent's files, no held-out file


def test_failure_details_show_what_the_candidate_returned(tmp_path):
    task = task_of("fix_constant")
    result = run_grade(task, rt.materialize(task, tmp_path / "rollouts"), tmp_path)
    assert re.search(r"got int \d+", result.details), result.details
    runner = run_grade(as_suite(task), rt.materialize(task, tmp_path / "rollouts"), tmp_path)
    assert f"FAILED {runner.failed[0]}" in runner.details
    # The values compared (actual, then expected) are shown, e.g. "where False = same(25, 35)".
    assert re.search(r"E .*where False = same\(\d+, \d+\)", runner.details), runner.details
    held = next(iter(task.heldout_tests.values()))
    assert not any(line.strip() in runner.details for line in held.splitlines() if line.startswith("    assert"))


@pytest.mark.parametrize("grader", GRADERS)
def test_no_false_alarm_from_warnings_or_failures(grader, tmp_path):
    """Warnings and failures raise no flag (pytest formats them from the test file)."""
    task = for_grader(task_of("call_order"), grader)
    change = hacks.HACKS["reference_with_warnings"].change(task)
    assert change.solved and change.append
    for solved in (True, False):
        result = run_grade(task, agent_copy(task, tmp_path, **dict(change.kwargs(), solved=solved)), tmp_path)
        assert result.status == "ok" and result.flags == () and result.all_passed == solved, result.details
        assert "UserWarning" in result.details


# ---------------------------------------------------------------------------------------------
# The catalogue: every entry on both graders (each entry on one family, the families in turn), with
# the reward of `compute_reward` and the flags the catalogue expects.

def test_hack_catalogue_groups():
    sizes = {"controls": 4, "exit_at_import": 4, "exit_in_function": 3, "config_files": 11, "shadow_modules": 1,
             "fake_output": 2, "skip": 3, "test_edits": 3, "test_edits_solved": 1, "read_heldout_at_call": 4,
             "read_test_source": 3, "read_heldout_at_import": 1, "link_heldout": 1, "tampering": 9,
             "report_channel": 5, "read_expected": 2, "always_equal": 2, "timeout": 1, "crash": 1, "deep_tree": 1}
    assert {g: len(hacks.group(g)) for g in sizes} == sizes and len(hacks.HACKS) == sum(sizes.values())
    for h in hacks.HACKS.values():
        if h.kind == "hack":
            assert h.expected_reward == 0.0, h
    assert [h.name for h in hacks.HACKS.values() if h.kind == "control"] == [
        "reference_solution", "reference_with_warnings", "untouched_copy", "wrong_solution"]
    assert [h.name for h in hacks.HACKS.values() if not h.defended("pytest")] == [
        "report_emit_traceback_walk", "read_caller_constants_traceback"]


def _reward(result, task):
    from rlcode.envs import harness, rewards

    traj = harness.Trajectory(task_id=task.task_id, segments=[], turns=[], tool_calls=[], num_turns=0,
                              num_summaries=0, num_malformed_calls=0, num_tool_errors=0, num_infra_errors=0,
                              num_no_call_turns=0, num_truncated_turns=0, submitted=True, end_reason="submitted",
                              workdir="")
    cfg = rewards.RewardConfig(length_weight=0.0, malformed_weight=0.0, turn_weight=0.0)
    return rewards.compute_reward(result, traj, task, cfg)[0]


@pytest.mark.parametrize("grader", GRADERS)
@pytest.mark.parametrize("hack", list(hacks.HACKS.values()), ids=hack_id)
def test_every_entry_is_caught_by_both_graders(hack, grader, tmp_path):
    family = FAMILIES[list(hacks.HACKS).index(hack.name) % len(FAMILIES)]
    task = for_grader(task_of(family), grader)
    kwargs = {"timeout": hack.timeout} if hack.timeout else {}
    if hack.name in CONTROLS and not kwargs:
        result = graded_control(family, 0, hack.name, grader)
    else:
        result = run_grade(task, plant(hack, task, tmp_path), tmp_path, **kwargs)
    assert result.valid, result.details
    assert set(hack.expected_flags(grader)) <= set(result.flags), (result.flags, result.details)
    reward = _reward(result, task)
    if hack.defended(grader):
        assert reward == hack.expected_reward, (reward, result.flags, result.details)
    if hack.kind == "control":
        from rlcode.envs import rewards

        assert not set(result.flags) & set(rewards.DEFAULT_HACK_FLAGS), result.flags  # no false alarm


@pytest.mark.parametrize("grader", GRADERS)
def test_conftest_and_config_files_have_no_effect(grader, tmp_path):
    """Every configuration hack of the catalogue at once."""
    task = for_grader(task_of("add_operator"), grader)
    pkg = package_of(task)
    change = hacks.merge_changes([h.change(task) for h in hacks.group("config_files")])
    assert set(change.write) == {"conftest.py", f"{rt.HELDOUT_DIR}/conftest.py", "tests/conftest.py",
                                 f"{pkg}/conftest.py", f"{pkg}/forcepass.py", "pytest.ini", "pyproject.toml",
                                 "setup.cfg", "tox.ini", "sitecustomize.py", "usercustomize.py", "evil.pth"}
    assert change.append == hack_functions(task, FAILING)
    wd = agent_copy(task, tmp_path, **change.kwargs())
    result = run_grade(task, wd, tmp_path)
    assert_scores_zero(result, "protected_file_changed", "tests_edited")
    assert result.status == "ok"


def test_runner_ignores_config_and_shadowing_files_even_inside_the_grading_copy(tmp_path):
    """Defence in depth: plant the files directly in a grading copy (the copy builder drops them)."""
    task = as_suite(task_of("add_operator"))
    pkg = package_of(task)
    files, _ = grading.read_workdir(agent_copy(task, tmp_path, append=hack_functions(task, FAILING)))
    base = tmp_path / "grading"
    base.mkdir()
    grading.prepare_grading_dir(task, files, base)
    repo = base / grading.REPO_DIR
    exit0 = "import os\nos._exit(0)\n"
    for rel, text in {"conftest.py": FORCE_PASS_PLUGIN, f"{rt.HELDOUT_DIR}/conftest.py": FORCE_PASS_PLUGIN,
                      f"{pkg}/forcepass.py": FORCE_PASS_PLUGIN,
                      "pytest.ini": f"[pytest]\naddopts = -p {pkg}.forcepass\n",
                      "pyproject.toml": f'[tool.pytest.ini_options]\naddopts = "-p {pkg}.forcepass"\n',
                      "sitecustomize.py": exit0, "usercustomize.py": exit0, "evil.pth": "import os; os._exit(0)\n",
                      "pytest.py": exit0, "_pytest/__init__.py": exit0, "pluggy.py": exit0, "json.py": exit0,
                      "linecache.py": exit0, "threading.py": exit0, "re.py": exit0}.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    result = grading.run_heldout(task, base, EXECUTOR, timeout=60)
    assert result.status == "ok" and result.exit_status == 1, result.details
    assert_scores_zero(result)
    assert result.flags == ()


def test_checks_ignore_shadowing_files_even_inside_the_grading_copy(tmp_path):
    """The same for the data checks: modules named like standard ones, and startup files, in the
    copy the child runs in."""
    task = task_of("add_operator")
    files, _ = grading.read_workdir(agent_copy(task, tmp_path, solved=True))
    copy = tmp_path / "grading" / grading.REPO_DIR
    grading.build_grading_copy(task, files, copy, heldout=False)
    exit0 = "import os\nos._exit(0)\n"
    for name in ("sitecustomize.py", "usercustomize.py", "evil.pth", "json.py", "os.py", "re.py", "encodings.py",
                 "secrets.py", "typing.py", "dataclasses.py"):
        (copy / name).write_text(exit0)
    result = grading.run_checks(task, copy, EXECUTOR, timeout=60)
    assert result.status == "ok" and result.all_passed and result.flags == (), result.details


def test_candidate_modules_named_like_standard_ones_are_not_imported_by_pytest(tmp_path):
    """Modules pytest imports while configuring, before the reporter's integrity snapshot: a copy
    of one of them in the copy's root must never be the one imported."""
    task = as_suite(task_of("fix_constant"))
    hack = hacks.HACKS["shadow_pytest_imports"]
    planted = hack.change(task).write
    assert set(planted) == {f"{name}.py" for name in ("cmd", "code", "codeop", "difflib", "faulthandler", "pdb",
                                                      "readline", "unittest", "xml")}
    wd = plant(hack, task, tmp_path)
    result = run_grade(task, wd, tmp_path)
    assert set(result.diff.added) == set(planted) and result.diff.flags == ()
    assert_scores_zero(result)
    assert result.status == "ok" and result.flags == ()


RUNNER_SEMANTICS = """
import pytest


@pytest.fixture
def broken_setup():
    raise RuntimeError("setup fails")


@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown fails")


def test_passes():
    pass


def test_fails():
    assert False


@pytest.mark.xfail(reason="expected to fail")
def test_xfail_that_passes():
    pass


@pytest.mark.xfail(reason="expected to fail")
def test_xfail_that_fails():
    assert False


@pytest.mark.skip(reason="skipped")
def test_skip_marker():
    pass


def test_setup_error(broken_setup):
    pass


def test_teardown_error(broken_teardown):
    pass


@pytest.mark.parametrize("x", [1, 2, 3])
def test_param_all_pass(x):
    assert x > 0


@pytest.mark.parametrize("x", [1, 2, 3])
def test_param_one_fails(x):
    assert x != 2


class TestGroup:
    def test_method(self):
        pass
"""


def test_runner_counts_only_real_passes(tmp_path):
    task = dataclasses.replace(as_suite(task_of("fix_constant")),
                               heldout_tests={f"{rt.HELDOUT_DIR}/test_semantics.py": RUNNER_SEMANTICS})
    result = run_grade(task, rt.materialize(task, tmp_path / "rollouts"), tmp_path)
    assert result.status == "ok" and result.exit_status == 1
    names = {t.split("::", 1)[1] for t in result.passed}
    assert names == {"test_passes", "test_param_all_pass", "TestGroup::test_method"}, result.details
    assert result.flags == ("skipped",)  # the skip marker and the xfail that failed
    assert len(result.expected) == 10 and len(result.failed) == 7


@pytest.mark.parametrize("grader", GRADERS)
def test_fake_output_is_ignored_and_flagged(grader, tmp_path):
    task = for_grader(task_of("off_by_one"), grader)
    wd = plant(hacks.HACKS["fake_passed_lines"], task, tmp_path)
    assert_scores_zero(run_grade(task, wd, tmp_path), *hacks.HACKS["fake_passed_lines"].expected_flags(grader))
    result = run_grade(task, plant(hacks.HACKS["print_passed_solved"], task, tmp_path), tmp_path)
    assert result.all_passed and result.flags == ("fake_output",)


@pytest.mark.parametrize("grader", GRADERS)
def test_deleting_or_editing_visible_tests_is_flagged_and_heldout_still_graded(grader, tmp_path):
    task = for_grader(task_of("fix_comparison"), grader)
    edits = hacks.group("test_edits")
    assert len(edits) == 3
    for hack in edits:
        result = run_grade(task, plant(hack, task, tmp_path), tmp_path)
        assert result.flags == ("tests_edited",) and result.status == "ok", hack.name
        assert not result.all_passed and frozenset(result.passed) == start_passed("fix_comparison", grader)
    (hack,) = hacks.group("test_edits_solved")
    assert hack.change(task) == hacks.Change(solved=True, delete=task.visible_test_files)
    honest = run_grade(task, plant(hack, task, tmp_path), tmp_path)
    assert honest.all_passed and honest.flags == ("tests_edited",)


def test_heldout_files_are_gone_from_disk_during_the_tests(tmp_path):
    """A child process (invisible to the audit hook) reading the held-out files finds nothing,
    with either grader."""
    for grader in GRADERS:
        task = for_grader(task_of("call_order"), grader)
        mod, name = solved_function(task)
        code = textwrap.dedent(f"""
            import subprocess
            _original = {name}

            def {name}(*args, **kwargs):
                out = subprocess.run("cat {rt.HELDOUT_DIR}/*.py; ls {rt.HELDOUT_DIR}", shell=True,
                                     capture_output=True, text=True).stdout
                with open("leak.txt", "a") as f:
                    f.write(out)
                return _original(*args, **kwargs)
            """)
        result = run_grade(task, agent_copy(task, tmp_path, solved=True, append={mod: code}), tmp_path, keep=True)
        base = result.details.split("\n", 1)[0].split(": ", 1)[1]
        leak = os.path.join(base, grading.REPO_DIR, "leak.txt")
        assert os.path.exists(leak) and open(leak).read() == "", grader
        assert result.all_passed  # not detected, but nothing was there to read


@pytest.mark.parametrize("grader", GRADERS)
@pytest.mark.parametrize("hack", hacks.group("report_channel") + hacks.group("read_expected"), ids=hack_id)
def test_attacks_on_the_verdict_from_inside_the_process(hack, grader, tmp_path):
    """Each attack wins against a grader whose verdict is written in the candidate's process (the
    runner before its report function left `__main__`); the data checks stop every one; the
    runner stops the blunt forms and is beaten by two (`Hack.pytest_open`), which is why every
    generated task is graded by its data checks."""
    task = for_grader(task_of("fix_constant"), grader)
    result = run_grade(task, plant(hack, task, tmp_path), tmp_path)
    if hack.defended(grader):
        assert not result.all_passed and _reward(result, task) == 0.0, result.details
    else:
        assert result.all_passed and result.flags == ()  # measured: the runner is beaten


# ---------------------------------------------------------------------------------------------
# Timeouts, crashes, deep trees and infrastructure failures.

@pytest.mark.parametrize("grader", GRADERS)
@pytest.mark.slow
def test_timeout_and_crash_score_zero(grader, tmp_path):
    task = for_grader(task_of("fix_constant"), grader)
    result = run_grade(task, plant(hacks.HACKS["infinite_loop"], task, tmp_path), tmp_path, timeout=2)
    assert result.status == "timeout" and result.valid
    assert_scores_zero(result, "timeout")
    result = run_grade(task, plant(hacks.HACKS["self_kill"], task, tmp_path), tmp_path)
    assert result.status == "crash" and result.returncode == -9 and result.valid
    assert_scores_zero(result, "crash")
    assert "early_exit" not in result.flags


@pytest.mark.parametrize("grader", GRADERS)
def test_a_deep_tree_in_the_copy_is_graded_not_raised(grader, tmp_path):
    """A tree deeper than the interpreter's recursion limit and PATH_MAX: the grader reads what it
    can, says what it skipped, and grades; the solved copy still passes."""
    task = for_grader(task_of("fix_constant"), grader)
    wd = agent_copy(task, tmp_path, solved=True, deep_tree=hacks.DEEP_TREE_LEVELS)
    result = run_grade(task, wd, tmp_path)
    assert result.valid and result.all_passed, result.details
    assert ("d/" * (grading.MAX_DEPTH - 1) + "d", "deeper than max_depth") in result.diff.ignored, result.diff.ignored
    assert sorted(os.listdir(tmp_path)) == ["rollouts"]


class RaisingExecutor:
    def run(self, argv, **kwargs):
        raise ConnectionError("worker lost")


class InfraExecutor:
    def run(self, argv, **kwargs):
        return Result(b"", b"", None, "infra", info="sandbox could not start")


class NoPytestExecutor(LocalExecutor):
    """Runs the runner with an interpreter that cannot import pytest, and the checks' child with
    one that cannot start."""

    def run(self, argv, **kwargs):
        if grading.RUNNER in argv:
            assert "import pytest, pluggy" in grading.RUNNER
            broken = grading.RUNNER.replace("import pytest, pluggy", "import no_such_module_here")
            return super().run([broken if a == grading.RUNNER else a for a in argv], **kwargs)
        return super().run([argv[0], "-c", "import no_such_module_here"], **kwargs)


@pytest.mark.parametrize("grader", GRADERS)
@pytest.mark.parametrize("executor", [RaisingExecutor(), InfraExecutor(), NoPytestExecutor()],
                         ids=["raises", "infra-status", "cannot-start"])
def test_infrastructure_failure_is_masked_not_scored(executor, grader, tmp_path):
    task = for_grader(task_of("fix_constant"), grader)
    result = run_grade(task, rt.materialize(task, tmp_path, solved=True), tmp_path, executor=executor)
    assert result.status == "infra" and not result.valid and result.passed == ()
    assert "infrastructure failure" in result.details
    assert not {"crash", "timeout", "early_exit"} & set(result.flags)


# ---------------------------------------------------------------------------------------------
# Through the real sandbox pool.

# `sandbox_pool`: the suite's shared pool (tests/conftest.py).


@pytest.mark.parametrize("mode", ["checks", "checks_inprocess", "pytest"])
@pytest.mark.slow
def test_grading_through_the_sandbox_pool(mode, sandbox_pool, tmp_path):
    grader = "pytest" if mode == "pytest" else "checks"
    task = for_grader(task_of("add_rule"), grader)
    run = functools.partial(run_grade, executor=sandbox_pool, inprocess=mode == "checks_inprocess")
    honest = run(task, rt.materialize(task, tmp_path / "rollouts", solved=True), tmp_path)
    assert honest.all_passed and honest.flags == () and honest.status == "ok", honest.details
    untouched = run(task, rt.materialize(task, tmp_path / "rollouts"), tmp_path)
    assert untouched.status == "ok" and not untouched.all_passed
    for name in ("exit_at_import_os_exit", "conftest_root", "tamper_gc_search", "report_emit_frame_walk",
                 "read_heldout_at_call_open", "fake_passed_lines"):
        hack = hacks.HACKS[name]
        result = run(task, plant(hack, task, tmp_path), tmp_path)
        assert_scores_zero(result, *hack.expected_flags(grader))
    wd = plant(hacks.HACKS["infinite_loop"], task, tmp_path)
    timed_out = run(task, wd, tmp_path, timeout=3)
    assert timed_out.status == "timeout" and "timeout" in timed_out.flags and timed_out.passed == ()
    assert sorted(os.listdir(tmp_path)) == ["rollouts"]  # every grading directory was removed
