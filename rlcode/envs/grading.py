"""Grading an agent's working copy with the held-out tests, demanding positive evidence.

``grade(task, workdir, executor, timeout=...)`` does three things:

1. **Diff** the agent's final copy against ``task.files`` (`diff_workdir`): changed, added and
   deleted files, with two flags. ``tests_edited``: a visible test file changed or deleted, or any
   file added, changed or deleted under a test directory (the directories of the visible tests and
   ``heldout_tests/``). ``protected_file_changed``: a file that configures Python or pytest
   (``conftest.py`` anywhere, ``pytest.ini``, ``setup.cfg``, ``tox.ini``, ``pyproject.toml``,
   ``sitecustomize.py``, ``usercustomize.py``, any ``*.pth``) added, changed or deleted.
   Bytecode (``__pycache__/``, ``*.pyc``) is neither diffed nor graded. Symlinks, hard-linked
   files, special files, files over ``max_file_bytes`` and anything below ``max_depth``
   directory levels are never read (reading through a planted symlink would copy a host file
   into the grading copy; the walk is `rlcode.sandbox.fstree`'s: bounded, non-recursive and
   descriptor-relative, so no tree the agent built can crash the trainer); they are listed in
   ``WorkdirDiff.ignored`` and an original file replaced by one counts as deleted.

2. **Build a pristine grading copy** in a fresh directory (`build_grading_copy`): the task's
   original files, with the agent's version of every *source* file (changed, added, deleted);
   test files and protected files stay original or absent whatever the agent did; for the pytest
   runner only, then the held-out test files (`repo_tasks.write_heldout_tests`). The agent's copy
   is never graded in place.

3. **Grade** with one of two graders.

**The held-out checks as data** (`run_checks`; every generated task, ``task.heldout_checks``).
Each held-out test is a `verdict.CheckGroup`: the imports of the package and, per assertion, the
expression to evaluate and the expected value or exception or type. The executor runs the
trusted-verdict child (`rlcode.envs.verdict`) in the grading copy, which holds no held-out file;
the child receives the imports and the expressions only, evaluates them with the candidate's
package and returns each value through a typed serialisation; this process compares with the
expected values, which never leave it. Whatever the candidate's code does inside the child
(exit early, print, rewrite or call the child's functions, write into its report channel,
search its memory), it can only change the values it claims, and a claimed value is judged as a
returned one. Flags (behaviour, not evidence): ``forged_report`` (lines in the report channel the
child did not write; a hack flag), ``early_exit`` (a SystemExit, or exit 0 before the report
ended), ``skipped`` (pytest's skip or xfail raised), ``fake_output`` (the word PASSED printed),
``read_heldout`` (an attempt to open, list, link or move ``heldout_tests/``), ``crash``,
``timeout``. A test passes iff every one of its checks did.

**The pytest runner** (`run_heldout`; a task whose held-out tests are only a test suite,
``task.heldout_checks`` empty) runs the held-out tests through the executor with
``python -I -B -c <runner>``. The runner is the program `rlcode.envs.pytest_runner`, whose source
text (`RUNNER`) is passed on the command line; its ini file lives next to the copy, not in it. In
order, before any candidate code can run (``-I``: no environment variables, no user site, the
working directory not on ``sys.path``), it

   a. reads the per-run nonce (``secrets.token_hex``) from stdin, then points stdin at /dev/null;
   b. duplicates the original stdout descriptor as its private report channel and points
      descriptor 1 at stderr (pytest's terminal output and the candidate's prints go to stderr);
   c. installs an audit hook (``sys.addaudithook``, which cannot be removed) and imports pytest
      from the installation, then appends the copy to the *end* of ``sys.path`` (a candidate
      file named like a standard or installed module cannot shadow it);
   d. writes ``<nonce> READY`` and runs ``pytest.main`` with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``
      (other ``PYTEST_*`` variables removed), ``-c <grader ini> -o addopts= --noconftest
      -p no:cacheprovider --rootdir <copy>`` and a reporter plugin object, so no candidate ini,
      conftest or plugin configures pytest;
   e. writes ``<nonce> PASSED|FAILED|SKIPPED <nodeid>`` when each test finishes (failed if any
      phase failed, skipped if a phase skipped, passed only if the call passed; an xfail is not a
      pass), ``<nonce> SKIPPED <collector id>`` for a skipped module, and ``<nonce> EXIT <code>``
      when ``pytest.main`` returns, then leaves with ``os._exit(code)`` (no candidate atexit
      handler or finaliser can change the exit code after the report);
   f. deletes the held-out files from disk once collection has finished and replaces their
      ``linecache`` entries by traps, so a test-time read finds nothing, whether it comes from
      this process (an ``open``, or ``inspect``/``traceback`` looking up the calling test's
      source) or from a child process. pytest's failure reports then show the assertion message
      without the source line.

   The audit hook reports ``<nonce> READ <path>`` (flag ``read_heldout``) for an ``open`` of a
   held-out file or of the held-out directory, an ``os.link`` / ``os.symlink`` / ``os.rename``
   naming one, or a source lookup that reaches a trap of step f, when it happens during the call
   phase of a test (the innermost wrapper of ``pytest_runtest_call``: the test body and the code
   it calls), whoever does it, or at any time while candidate code (a file of the copy outside
   ``heldout_tests/``) is on the calling thread's stack. Measured with pytest 9: pytest itself
   opens a held-out file only while importing it (the assertion rewriter) and when formatting a
   failure or a warning (in ``pytest_runtest_makereport`` and the warnings wrapper, outside the
   call phase), so nothing of pytest's needs excluding inside the call phase, and pytest's own
   opens outside it are not flagged (tests: failing runs and warnings raise no flag). The hook reports
   ``<nonce> TAMPER <what>`` (flag ``tampered``) for the primitives a search of the interpreter's
   memory or a rewrite of the running test needs (``gc.get_objects``/``get_referrers``/
   ``get_referents``, ``ctypes`` memory reads, ``sys.settrace``/``setprofile``, a new audit hook,
   opening ``/proc/*/mem``) when made in the same candidate-attributable situations. The reporter
   also checks, after every test phase and at the end, that no name of ``builtins``, ``pytest``
   and the pytest/pluggy modules and classes that run a test and build its report was rebound or
   deleted, that the held-out test modules' globals are unchanged (a candidate-defined global
   ``abs`` would shadow the builtin) and that every collected test function still has its code
   (``TAMPER``). It reports ``<nonce> FAKE <where>`` when the captured output of a collector or
   a test contains the word ``PASSED``, and ``<nonce> SYSEXIT <where>`` when a ``SystemExit``
   ended a test or collection (pytest 9 turns one raised while importing a test module into an
   internal error).

The grader accepts only positive evidence. It collects the expected test ids itself from the
held-out files (`expected_test_ids`, with `ast`: ``test*`` functions and ``test*`` methods of
``Test*`` classes without ``__init__``; a parametrised test passes when every reported case
passed). A test passed iff it was reported ``PASSED`` with the run's nonce and nothing else;
``all_passed`` needs every expected test passed, ``EXIT 0`` and process return code 0. Lines
without the nonce are ignored; one containing ``PASSED`` flags ``fake_output``.

Statuses: ``ok`` (the runner reported ``EXIT`` and the process returned that code);
``timeout`` (flag ``timeout``) and ``crash`` (flag ``crash``: killed for memory or output, died,
or ended without ``EXIT`` or with another return code) are the candidate's fault and score 0;
``infra`` is not scored (mask it): the executor raised or said ``infra``, or the runner never
reported ``READY`` -- nothing of the candidate runs before that line, so a candidate cannot make
its failure look like an infrastructure failure. Flag ``early_exit``: the process returned 0
without a complete report (``os._exit(0)``; ``EXIT 0`` with tests missing) or a ``SystemExit``
was reported. Flag ``skipped``: any expected test was skipped (not only all of them).
``read_heldout`` and ``tampered`` void the run: no test counts as passed.

What the runner cannot prevent (which is why no generated task is graded by it). The candidate's
code runs in the interpreter that runs pytest and writes the report, so a candidate that
deliberately attacks the grader from inside can win. The runner's state lives in the locals of
one function (not in ``__main__``, whose globals any module can import and rebind) and the
builtins it needs for the exit code are bound before any candidate code runs, so the report
function cannot be called or replaced through ``import __main__``; a search of memory through
``gc``, ``ctypes`` or ``/proc/self/mem`` and a stack walk through ``sys._getframe`` by candidate
code are seen by the audit hook (``tampered``). But the stack is also reachable from any
traceback's frame (``error.__traceback__.tb_frame``), which no hook sees: from there the
candidate reaches the runner's frame (its report function and nonce) and can report every test
passed and exit, and it can read the expected values from the constants of the calling test's
code object. Both are in the catalogue (`rlcode.envs.hacks`, ``report_emit_traceback_walk`` and
``read_caller_constants_traceback``) as known openings of this grader. It can also patch a pytest
function, let the test run and restore it before the next check, or read a held-out file while
the test module is being imported, from a thread or child process running code compiled under a
fake file name. The checks above catch the blunt forms of these; none of them is a proof. The
data checks close all of this by construction; a test suite of a real repository that cannot be
expressed as data checks is graded by the runner with exactly these limits.

The held-out tests are also only as strong as their assertions: ``assert f(x) == 5`` alone is
passed by an object whose ``__eq__`` always returns True. The generated tasks therefore check the
exact type before the value (``same(result, expected)`` in `rlcode.envs.tasks.repo`), and
tests/rlcode/envs/test_grading.py checks that always-equal objects score 0 in every family.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import os
import re
import secrets
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

from rlcode.envs import pytest_runner, tools, verdict
from rlcode.envs.tasks import repo as repo_tasks
from rlcode.sandbox import fstree

STATUSES = ("ok", "timeout", "crash", "infra")
FLAGS = ("crash", "early_exit", "fake_output", "forged_report", "protected_file_changed", "read_heldout",
         "skipped", "tampered", "tests_edited", "timeout")
# Flags that void the evidence of a run: with them no test counts as passed.
VOIDING_FLAGS = ("read_heldout", "tampered")

PROTECTED_NAMES = frozenset({"conftest.py", "pytest.ini", "setup.cfg", "tox.ini", "pyproject.toml",
                             "sitecustomize.py", "usercustomize.py"})
PROTECTED_SUFFIXES = (".pth",)
BYTECODE_DIRS = frozenset({"__pycache__"})
BYTECODE_SUFFIXES = (".pyc", ".pyo")

GRADER_INI = "[pytest]\npython_classes = Test\npython_functions = test\n"
REPO_DIR = "repo"  # the grading copy, inside the executor's working directory
INI_NAME = "grader.ini"  # next to the copy, outside it
DETAILS_CHARS = 4000
_PASSED_WORD = re.compile(r"\bPASSED\b")


# ----------------------------------------------------------------------------------------------
# The runner (executed as ``python -I -B -c RUNNER <ini> <copy> <heldout dir> <test paths...>``):
# the text of `rlcode.envs.pytest_runner`, a module so that it is linted and importable by tests.

with open(pytest_runner.__file__, encoding="utf-8") as _f:
    RUNNER = _f.read()
del _f


# ----------------------------------------------------------------------------------------------
# Expected test ids.

def _test_ids_of(path: str, source: str) -> list[str]:
    tree = ast.parse(source, filename=path)
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    ids = []
    for node in tree.body:
        if isinstance(node, functions) and node.name.startswith("test"):
            ids.append(f"{path}::{node.name}")
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            methods = [n for n in node.body if isinstance(n, functions)]
            if any(m.name == "__init__" for m in methods):
                continue  # pytest does not collect a test class with a constructor
            ids += [f"{path}::{node.name}::{m.name}" for m in methods if m.name.startswith("test")]
    return ids


def expected_test_ids(task: repo_tasks.RepoTask) -> tuple[str, ...]:
    """The pytest node ids of the held-out tests (relative to the copy's root), from their source.

    Collected with `ast`, not from any run: module-level functions named ``test*`` and methods
    named ``test*`` of classes named ``Test*`` without ``__init__`` (the grader's ini sets these
    conventions). Raises ValueError if the task has no held-out test."""
    ids = []
    for path in sorted(task.heldout_tests):
        ids += _test_ids_of(path, task.heldout_tests[path])
    if not ids:
        raise ValueError(f"task {task.task_id} has no held-out tests")
    return tuple(ids)


# ----------------------------------------------------------------------------------------------
# Diff of the agent's copy.

@dataclasses.dataclass(frozen=True)
class WorkdirDiff:
    """The agent's copy against ``task.files``. Paths are relative, with ``/``.

    changed: original files whose bytes differ. added: files not in the task. deleted: original
    files that are no longer a readable regular file. ignored: (path, reason) of what was not
    read (symlink, hard link, special file, too large, too many files).
    """

    changed: tuple[str, ...]
    added: tuple[str, ...]
    deleted: tuple[str, ...]
    ignored: tuple[tuple[str, str], ...]
    tests_edited: bool
    protected_file_changed: bool

    @property
    def flags(self) -> tuple[str, ...]:
        return tuple(name for name in ("protected_file_changed", "tests_edited") if getattr(self, name))


def _test_dirs(task: repo_tasks.RepoTask) -> tuple[str, ...]:
    dirs = {os.path.dirname(p) for p in task.visible_test_files} | {repo_tasks.HELDOUT_DIR}
    return tuple(sorted(d for d in dirs if d))


def is_test_path(task: repo_tasks.RepoTask, rel: str) -> bool:
    """A visible test file, or anything under a test directory (or the directory itself)."""
    if rel in task.visible_test_files:
        return True
    return any(rel == d or rel.startswith(d + "/") for d in _test_dirs(task))


def is_protected_path(rel: str) -> bool:
    """A file that configures Python or pytest when present (wherever it is)."""
    name = rel.rsplit("/", 1)[-1]
    return name in PROTECTED_NAMES or name.endswith(PROTECTED_SUFFIXES)


def _is_bytecode(name: str) -> bool:
    return name.endswith(BYTECODE_SUFFIXES)


MAX_DEPTH = 64  # directory levels of the agent's copy that are read


def read_workdir(workdir: str | os.PathLike, *, max_file_bytes: int = 1_000_000, max_files: int = 2000,
                 max_depth: int = MAX_DEPTH) -> tuple[dict[str, bytes], list[tuple[str, str]]]:
    """The regular files of `workdir` (relative path -> bytes) and what was not read, as
    (path, reason): symlinks, hard links, special files, files over `max_file_bytes`, files past
    `max_files`, directories deeper than `max_depth` (`rlcode.sandbox.fstree.read_files`:
    bounded, non-recursive, never following a symlink, whatever the tree's depth). Bytecode
    (``__pycache__/``, ``*.pyc``) is skipped."""
    root = os.fspath(workdir)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"the working copy {root} is not a directory")

    def bytecode(entry: fstree.Entry) -> bool:
        return entry.name in BYTECODE_DIRS or (entry.kind != fstree.DIR and _is_bytecode(entry.name))

    return fstree.read_files(root, max_file_bytes=max_file_bytes, max_files=max_files, max_depth=max_depth,
                             exclude=bytecode)


def diff_files(task: repo_tasks.RepoTask, agent_files: Mapping[str, bytes],
               ignored: list[tuple[str, str]] | tuple = ()) -> WorkdirDiff:
    """`WorkdirDiff` of the agent's files (relative path -> bytes) against ``task.files``."""
    original = {p: t.encode("utf-8") for p, t in task.files.items()}
    changed = sorted(p for p in original if p in agent_files and agent_files[p] != original[p])
    deleted = sorted(p for p in original if p not in agent_files)
    added = sorted(p for p in agent_files if p not in original)
    touched = changed + deleted + added
    tests_edited = any(is_test_path(task, p) for p in touched)
    protected = any(is_protected_path(p) for p in touched)
    return WorkdirDiff(tuple(changed), tuple(added), tuple(deleted), tuple(sorted(ignored)),
                       tests_edited, protected)


def patch_text(task: repo_tasks.RepoTask, agent_files: Mapping[str, bytes], max_chars: int = 16_000) -> str:
    """The agent's change as one unified diff against ``task.files`` (files in path order, bytes
    decoded as UTF-8 with replacement; a deleted file diffs against nothing, an added one from
    nothing), cut to `max_chars`: what a reward model reads of an episode."""
    original = {p: t for p, t in task.files.items()}
    parts = []
    for path in sorted(set(original) | set(agent_files)):
        old = original.get(path)
        new = agent_files[path].decode("utf-8", errors="replace") if path in agent_files else None
        if old == new:
            continue
        parts += difflib.unified_diff((old or "").splitlines(keepends=True), (new or "").splitlines(keepends=True),
                                      fromfile="/dev/null" if old is None else f"a/{path}",
                                      tofile="/dev/null" if new is None else f"b/{path}")
    text = "".join(line if line.endswith("\n") else line + "\n" for line in parts)
    return text[:max_chars]


def diff_workdir(task: repo_tasks.RepoTask, workdir: str | os.PathLike, **limits) -> WorkdirDiff:
    """Diff the agent's copy `workdir` against ``task.files`` (see `WorkdirDiff`)."""
    files, ignored = read_workdir(workdir, **limits)
    return diff_files(task, files, ignored)


# ----------------------------------------------------------------------------------------------
# The grading copy.

def _write(root: str, rel: str, data: bytes) -> bool:
    """Write one file under `root`; False when the path collides with another file or directory."""
    path = os.path.join(root, *rel.split("/"))
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "xb") as f:
            f.write(data)
    except (FileExistsError, NotADirectoryError, IsADirectoryError):
        return False
    return True


def grading_files(task: repo_tasks.RepoTask, agent_files: Mapping[str, bytes]) -> dict[str, bytes]:
    """The files of the grading copy before the held-out tests are added: every original test and
    protected file as in the task, the agent's version of every other file (deleted ones absent,
    added ones present), and nothing the agent put under a test directory or in a protected file."""
    out: dict[str, bytes] = {}
    for rel, text in task.files.items():
        if is_test_path(task, rel) or is_protected_path(rel):
            out[rel] = text.encode("utf-8")
        elif rel in agent_files:
            out[rel] = agent_files[rel]
    for rel, data in agent_files.items():
        if rel not in task.files and not is_test_path(task, rel) and not is_protected_path(rel):
            out[rel] = data
    return out


def build_grading_copy(task: repo_tasks.RepoTask, agent_files: Mapping[str, bytes],
                       dest: str | os.PathLike, *, heldout: bool = True) -> list[str]:
    """Write the grading copy into the new directory `dest` (`grading_files`, then, with
    `heldout`, the held-out test files for the pytest runner); returns the held-out test paths
    written. Originals and held-out tests are written first; an agent file whose path collides
    with one of them is skipped."""
    dest = os.fspath(dest)
    os.makedirs(dest)
    files = grading_files(task, agent_files)
    fixed = {rel for rel in files if rel in task.files and (is_test_path(task, rel) or is_protected_path(rel))}
    for rel in sorted(fixed):
        _write(dest, rel, files[rel])
    paths = repo_tasks.write_heldout_tests(task, dest) if heldout else []
    for rel in sorted(set(files) - fixed):
        if rel not in task.heldout_tests:
            _write(dest, rel, files[rel])
    return paths


# ----------------------------------------------------------------------------------------------
# Interpreting a run.

@dataclasses.dataclass(frozen=True)
class GradeResult:
    """The verdict on one working copy.

    expected: the held-out test ids (`expected_test_ids`). passed: those reported passed with the
    run's nonce (empty unless status is "ok" and no voiding flag was raised). failed: the other
    expected ids (failed, skipped, errored or never reported). pass_fraction: len(passed) /
    len(expected). all_passed: every expected test passed, ``EXIT 0`` and return code 0.
    flags: sorted names from `FLAGS`. status: one of `STATUSES` ("infra": mask, do not score).
    details: a note and the tail of the runner's output, for logs. diff: the `WorkdirDiff`.
    returncode / exit_status: the process's return code and the runner's EXIT code (None when
    unknown).
    """

    expected: tuple[str, ...]
    passed: tuple[str, ...]
    failed: tuple[str, ...]
    pass_fraction: float
    all_passed: bool
    flags: tuple[str, ...]
    status: str
    details: str
    diff: WorkdirDiff | None = None
    returncode: int | None = None
    exit_status: int | None = None

    @property
    def num_expected(self) -> int:
        return len(self.expected)

    @property
    def num_passed(self) -> int:
        return len(self.passed)

    @property
    def valid(self) -> bool:
        """False for an infrastructure failure (mask the sample out of the batch)."""
        return self.status != "infra"


@dataclasses.dataclass
class _Report:
    ready: bool = False
    exit_status: int | None = None
    outcomes: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    skipped_collectors: list[str] = dataclasses.field(default_factory=list)
    reads: list[str] = dataclasses.field(default_factory=list)
    tampering: list[str] = dataclasses.field(default_factory=list)
    fakes: list[str] = dataclasses.field(default_factory=list)
    sysexits: list[str] = dataclasses.field(default_factory=list)
    foreign_passed: int = 0


def _split_lines(text: str) -> list[str]:
    return [line for line in re.split(r"\r\n|\r|\n", text) if line]


def parse_report(stdout: str, stderr: str, nonce: str) -> _Report:
    """The runner's report lines carrying `nonce`; every other line is the candidate's or pytest's
    (those containing ``PASSED`` are counted in ``foreign_passed``)."""
    rep = _Report()
    prefix = nonce + " "
    for line in _split_lines(stdout):
        if not line.startswith(prefix):
            rep.foreign_passed += bool(_PASSED_WORD.search(line))
            continue
        kind, _, text = line[len(prefix):].partition(" ")
        if kind == "READY":
            rep.ready = True
        elif kind == "EXIT":
            if rep.exit_status is None:
                try:
                    rep.exit_status = int(text)
                except ValueError:
                    pass
        elif kind in ("PASSED", "FAILED", "SKIPPED"):
            if kind == "SKIPPED":
                rep.skipped_collectors.append(text)  # a module or class skips every test under it
            rep.outcomes.setdefault(text, set()).add(kind)
        elif kind == "READ":
            rep.reads.append(text)
        elif kind == "TAMPER":
            rep.tampering.append(text)
        elif kind == "FAKE":
            rep.fakes.append(text)
        elif kind == "SYSEXIT":
            rep.sysexits.append(text)
    rep.foreign_passed += sum(bool(_PASSED_WORD.search(line)) for line in _split_lines(stderr))
    return rep


def _kinds_of(test_id: str, rep: _Report) -> set[str]:
    kinds = set(rep.outcomes.get(test_id, ()))
    for reported, k in rep.outcomes.items():
        if reported.startswith(test_id + "["):  # a parametrised case
            kinds |= k
    for collector in rep.skipped_collectors:
        if test_id.startswith(collector + "::"):
            kinds.add("SKIPPED")
    return kinds


def _tail(text: str, limit: int = DETAILS_CHARS) -> str:
    return text if len(text) <= limit else "[...]\n" + text[-limit:]


def interpret(expected: tuple[str, ...], result: Any, nonce: str,
              diff: WorkdirDiff | None = None) -> GradeResult:
    """The `GradeResult` of one executor result of the runner (see the module docstring)."""
    stdout, stderr = tools.output_text(result.stdout), tools.output_text(result.stderr)
    status_in = getattr(result, "status", "infra")
    rc = getattr(result, "returncode", None)
    rep = parse_report(stdout, stderr, nonce)
    flags = set(diff.flags if diff is not None else ())
    notes = [f"executor status {status_in}, return code {rc}, runner exit {rep.exit_status}"]

    if rep.reads:
        flags.add("read_heldout")
        notes.append("held-out files opened: " + ", ".join(sorted(set(rep.reads))))
    if rep.tampering:
        flags.add("tampered")
        notes.append("tampering: " + ", ".join(sorted(set(rep.tampering))))
    if rep.fakes or rep.foreign_passed:
        flags.add("fake_output")
        notes.append(f"PASSED written outside the report channel ({rep.foreign_passed} line(s); "
                     f"captured in: {', '.join(sorted(set(rep.fakes))) or '-'})")
    if rep.sysexits:
        flags.add("early_exit")
        notes.append("SystemExit in: " + ", ".join(sorted(set(rep.sysexits))))

    kinds = {t: _kinds_of(t, rep) for t in expected}
    if any("SKIPPED" in k for k in kinds.values()):
        flags.add("skipped")
    complete = rep.exit_status is not None

    if status_in == "infra" or not rep.ready:
        status = "infra"
        notes.append("infrastructure failure: " + (str(getattr(result, "info", "") or "")
                                                   or "the runner did not start"))
    elif status_in == "timeout":
        status = "timeout"
    elif status_in in ("memory", "output_limit") or not complete or rc != rep.exit_status:
        status = "crash"
        if rc == 0:
            flags.add("early_exit")  # "success" without a complete, consistent report
    else:
        status = "ok"
    if status in ("timeout", "crash"):
        flags.add(status)

    if status == "ok" and not flags.intersection(VOIDING_FLAGS):
        passed = tuple(t for t in expected if kinds[t] == {"PASSED"})
    else:
        passed = ()
    if status == "ok" and rep.exit_status == 0 and any(not k for k in kinds.values()):
        flags.add("early_exit")  # EXIT 0 yet expected tests unreported
    failed = tuple(t for t in expected if t not in set(passed))
    all_passed = (status == "ok" and bool(expected) and not failed and rep.exit_status == 0 and rc == 0)
    details = "\n".join(notes) + "\n" + _tail(stderr)
    return GradeResult(expected=tuple(expected), passed=passed, failed=failed,
                       pass_fraction=len(passed) / len(expected) if expected else 0.0,
                       all_passed=all_passed, flags=tuple(sorted(flags)), status=status,
                       details=details, diff=diff, returncode=rc, exit_status=rep.exit_status)


# ----------------------------------------------------------------------------------------------
# The entry point.

def prepare_grading_dir(task: repo_tasks.RepoTask, agent_files: Mapping[str, bytes],
                        base: str | os.PathLike) -> list[str]:
    """Fill the empty directory `base`: ``grader.ini`` and the grading copy ``repo/``
    (`build_grading_copy`). Returns the held-out test paths."""
    paths = build_grading_copy(task, agent_files, os.path.join(os.fspath(base), REPO_DIR))
    with open(os.path.join(os.fspath(base), INI_NAME), "w", encoding="utf-8") as f:
        f.write(GRADER_INI)
    return paths


def run_heldout(task: repo_tasks.RepoTask, base: str | os.PathLike, executor: tools.Executor, *,
                timeout: float, python: str = sys.executable, diff: WorkdirDiff | None = None) -> GradeResult:
    """Run the runner on a prepared grading directory `base` (`prepare_grading_dir`) through
    `executor` with a fresh nonce, and interpret its report."""
    expected = expected_test_ids(task)
    nonce = secrets.token_hex(16)
    argv = [python, "-I", "-B", "-c", RUNNER, INI_NAME, REPO_DIR, repo_tasks.HELDOUT_DIR,
            *sorted(task.heldout_tests)]
    try:
        result = executor.run(argv, stdin=nonce + "\n", timeout=timeout, workdir=os.fspath(base))
    except Exception as e:  # the executor's own failure, whatever its type
        result = verdict.InfraResult(f"the executor raised {type(e).__name__}: {e}")
    return interpret(expected, result, nonce, diff)


def run_checks(task: repo_tasks.RepoTask, copy: str | os.PathLike, executor: Any, *, timeout: float,
               python: str = sys.executable, diff: WorkdirDiff | None = None, inprocess: bool = False) -> GradeResult:
    """Evaluate ``task.heldout_checks`` on the grading copy `copy` (`build_grading_copy` with
    ``heldout=False``) through the trusted-verdict protocol (`rlcode.envs.verdict`) and turn the
    verdict into a `GradeResult`: a held-out test passed iff every check of its group did."""
    groups = task.heldout_checks
    v = verdict.run_checks(executor, groups, timeout=timeout, workdir=copy, python=python, cwd_on_path=True,
                           inprocess=inprocess, watch=(repo_tasks.HELDOUT_DIR,))
    expected = tuple(g.name for g in groups)
    flags = set(diff.flags if diff is not None else ()) | set(v.flags)
    voided = bool(flags.intersection(VOIDING_FLAGS))
    passed = () if voided else tuple(name for name, ok in zip(expected, v.passed) if ok)
    failed = tuple(name for name in expected if name not in set(passed))
    return GradeResult(expected=expected, passed=passed, failed=failed,
                       pass_fraction=len(passed) / len(expected) if expected else 0.0,
                       all_passed=v.status == "ok" and bool(expected) and not failed,
                       flags=tuple(sorted(flags)), status=v.status, details=_tail(v.details), diff=diff,
                       returncode=v.returncode)


def grade(task: repo_tasks.RepoTask, workdir: str | os.PathLike, executor: tools.Executor, *,
          timeout: float, python: str = sys.executable, root: str | os.PathLike | None = None,
          keep: bool = False, max_file_bytes: int = 1_000_000, max_files: int = 2000,
          inprocess: bool = False) -> GradeResult:
    """Grade the agent's final copy `workdir` of `task` with its held-out tests.

    The held-out checks as data (``task.heldout_checks``, every generated task) go through
    `run_checks`; a task with only held-out test files goes through the pytest runner
    (`run_heldout`, see the module docstring for what that cannot defend against).
    executor: runs the child or the runner (`rlcode.sandbox.SandboxPool` or any
      `tools.Executor`) with the grading directory as ``workdir``. timeout: wall seconds of the
      run. inprocess: the data checks run in the pool's in-process mode (a `SandboxPool`).
    python: the interpreter the executor runs (for the runner, it must have pytest).
    root: where the fresh grading directory is made (default: the system temporary directory);
      it holds the copy ``repo/`` (and, for the runner, ``grader.ini``) and is removed afterwards
      unless `keep` (then `details` starts with its path).
    max_file_bytes, max_files: what is read of the agent's copy (`read_workdir`).
    Never raises for anything the candidate did; see `GradeResult` for the verdict.
    """
    if not task.heldout_checks:
        expected_test_ids(task)  # a task without held-out tests is a bug of the task: raise now
    files, ignored = read_workdir(workdir, max_file_bytes=max_file_bytes, max_files=max_files)
    diff = diff_files(task, files, ignored)
    base = tempfile.mkdtemp(prefix="rlcode_grade_", dir=os.fspath(root) if root is not None else None)
    try:
        if task.heldout_checks:
            copy = os.path.join(base, REPO_DIR)
            build_grading_copy(task, files, copy, heldout=False)
            graded = run_checks(task, copy, executor, timeout=timeout, python=python, diff=diff, inprocess=inprocess)
        else:
            prepare_grading_dir(task, files, base)
            graded = run_heldout(task, base, executor, timeout=timeout, python=python, diff=diff)
        if keep:
            graded = dataclasses.replace(graded, details=f"grading directory: {base}\n" + graded.details)
        return graded
    finally:
        if not keep:
            fstree.remove(base)
