"""Bug-fix tasks mined from real Python projects: inject a bug that the project's own tests catch.

The recipe (the way SWE-smith and R2E-Gym build environments at scale, at the size of one
machine): take a pure-Python project with its test suite; run the suite once under a profiler to
learn which functions the tests call (`covered_functions`); enumerate small, plausible bugs in
those functions (`mutation_sites`: an arithmetic or comparison operator, a boolean operator, an
integer or boolean constant, a negated condition, a removed statement, two swapped call
arguments); apply one (`apply`: a text edit of that one expression or statement, the rest of the
file byte-identical) and keep it only if the suite goes from green to red, twice the same way and
within a time budget (`validate`). The failing tests become the task's checks and the tests that
still pass its regression checks; the statement is written from the failing tests' names and
messages, as a bug report would be (`statement`), never from the diff.

Everything here runs the project's tests through an executor (``run(argv, stdin=, timeout=,
workdir=)``: a `rlcode.sandbox.SandboxPool` or a `rlcode.envs.tools.Executor`), so mining can
run in the sandbox like grading does.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rlcode.envs import verdict

KINDS = ("operator", "comparison", "boolean", "constant", "condition", "remove_statement", "swap_arguments")
_BINOPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
           ast.Mod: ast.FloorDiv}
_CMPOPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
           ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_REPORT = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)(?: - (.*))?$")


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One bug: in `path` (relative to the project root), replace the source text between
    (`line`, `col`) and (`end_line`, `end_col`) (1-based lines, 0-based columns, as `ast` gives
    them) by `new`; `old` is the text it replaces. `function`: the qualified name it is in."""

    path: str
    function: str
    kind: str
    line: int
    col: int
    end_line: int
    end_col: int
    old: str
    new: str

    @property
    def key(self) -> str:
        return f"{self.path}:{self.line}:{self.col}:{self.kind}:{self.new}"


# ----------------------------------------------------------------------------------------------
# Sites.

class _Sites(ast.NodeVisitor):
    """Collects the mutation sites inside function bodies (not inside nested definitions)."""

    def __init__(self, source: str, path: str, covered: set[int] | None):
        self.source, self.path, self.covered = source, path, covered
        self.stack: list[str] = []
        self.out: list[Mutation] = []
        self.function: str | None = None

    def _definition(self, node, is_function: bool):
        self.stack.append(node.name)
        outer = self.function
        if is_function:
            take = self.covered is None or node.lineno in self.covered or (
                node.decorator_list and min(d.lineno for d in node.decorator_list) in self.covered)
            self.function = ".".join(self.stack) if take else None
            if self.function is not None:
                self._block(node.body)
        for child in node.body:
            self.visit(child)
        self.function = outer
        self.stack.pop()

    def visit_FunctionDef(self, node):
        self._definition(node, True)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        self._definition(node, False)

    def visit_Lambda(self, node):
        return  # a lambda's body is an expression of its own; leave it alone

    def _add(self, node, kind: str, replacement: ast.AST | str):
        old = ast.get_source_segment(self.source, node)
        if old is None or self.function is None:
            return
        new = replacement if isinstance(replacement, str) else ast.unparse(replacement)
        if new == old:
            return
        self.out.append(Mutation(self.path, self.function, kind, node.lineno, node.col_offset, node.end_lineno,
                                 node.end_col_offset, old, new))

    def generic_visit(self, node):
        if self.function is not None:
            self._sites(node)
        super().generic_visit(node)

    def _sites(self, node):
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            self._add(node, "operator", ast.BinOp(node.left, _BINOPS[type(node.op)](), node.right))
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMPOPS:
            self._add(node, "comparison", ast.Compare(node.left, [_CMPOPS[type(node.ops[0])]()], node.comparators))
        elif isinstance(node, ast.BoolOp):
            op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            self._add(node, "boolean", ast.BoolOp(op, node.values))
        elif isinstance(node, ast.Constant) and type(node.value) is bool:
            self._add(node, "constant", ast.Constant(not node.value))
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            self._add(node, "constant", ast.Constant(node.value + 1))
        elif isinstance(node, (ast.If, ast.While)):
            test = node.test
            negated = test.operand if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) else (
                ast.UnaryOp(ast.Not(), test))
            self._add(test, "condition", negated)
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and not any(isinstance(a, ast.Starred) for a in node.args[:2]):
            a, b = (ast.get_source_segment(self.source, x) for x in node.args[:2])
            if a is not None and b is not None and a != b:
                call = ast.Call(node.func, [node.args[1], node.args[0], *node.args[2:]], node.keywords)
                self._add(node, "swap_arguments", call)
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                self._block(block)

    def _block(self, block: list[ast.stmt]):
        """A statement of a block of two or more is removed (replaced by ``pass``); docstrings and
        bare constants are not statements worth removing."""
        if len(block) < 2:
            return
        for stmt in block:
            if isinstance(stmt, (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign)) and not (
                    isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
                self._add(stmt, "remove_statement", "pass")


def mutation_sites(source: str, path: str, covered_lines: Iterable[int] | None = None) -> list[Mutation]:
    """Every candidate bug in the functions of `source` (a module at `path`) whose ``def`` line
    is in `covered_lines` (None: every function), in source order. Each applies cleanly: the
    mutated module parses."""
    tree = ast.parse(source, filename=path)
    visitor = _Sites(source, path, None if covered_lines is None else set(covered_lines))
    visitor.visit(tree)
    out = []
    for m in visitor.out:
        try:
            ast.parse(apply(source, m), filename=path)
        except SyntaxError:
            continue
        out.append(m)
    return out


def apply(source: str, m: Mutation) -> str:
    """`source` with `m` applied (the rest of the text unchanged); ValueError if the text at the
    site is not `m.old` (the file changed since the site was found)."""
    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(line: int, col: int) -> int:  # ast columns count UTF-8 bytes
        text = lines[line - 1]
        return starts[line - 1] + len(text.encode("utf-8")[:col].decode("utf-8", errors="ignore"))

    a, b = offset(m.line, m.col), offset(m.end_line, m.end_col)
    if source[a:b] != m.old:
        raise ValueError(f"{m.path}:{m.line}: the source at the site is not {m.old[:60]!r}")
    return source[:a] + m.new + source[b:]


# ----------------------------------------------------------------------------------------------
# Running the project's tests.

@dataclasses.dataclass(frozen=True)
class TestRun:
    """outcomes: node id -> PASSED / FAILED / ERROR / SKIPPED / XFAIL / XPASS; messages: node id
    -> the short failure message pytest printed; status: the executor's; seconds: wall time."""

    __test__ = False  # not a pytest test class

    outcomes: dict[str, str]
    messages: dict[str, str]
    status: str
    returncode: int | None
    seconds: float

    @property
    def failed(self) -> tuple[str, ...]:
        return tuple(sorted(t for t, o in self.outcomes.items() if o in ("FAILED", "ERROR")))

    @property
    def passed(self) -> tuple[str, ...]:
        return tuple(sorted(t for t, o in self.outcomes.items() if o == "PASSED"))

    @property
    def green(self) -> bool:
        return self.status == "ok" and self.returncode == 0 and bool(self.passed) and not self.failed


PYTEST_ARGS = ("-q", "-rA", "-p", "no:cacheprovider", "--no-header", "--color=no", "-o", "addopts=",
               "--tb=line", "-W", "ignore::DeprecationWarning")


def parse_report(stdout: str) -> tuple[dict[str, str], dict[str, str]]:
    outcomes, messages = {}, {}
    for line in stdout.splitlines():
        m = _REPORT.match(line.strip())
        if m:
            outcomes[m.group(2)] = m.group(1)
            if m.group(3):
                messages[m.group(2)] = m.group(3)[:300]
    return outcomes, messages


_PYTEST = "import sys; sys.path[:0] = {paths!r}; import pytest; raise SystemExit(int(pytest.main(sys.argv[1:])))"


def run_tests(root: str, tests: Sequence[str], executor: Any, *, timeout: float,
              python: str = sys.executable, pythonpath: Sequence[str] = ()) -> TestRun:
    """Run pytest on `tests` (paths or node ids relative to `root`) in `root`, with the
    directories `pythonpath` (relative to `root`, e.g. ``src``) first on the import path."""
    import time

    root = os.path.abspath(root)
    t0 = time.perf_counter()
    argv = [python, "-B", "-c", _PYTEST.format(paths=list(pythonpath)), *PYTEST_ARGS, *tests]
    res = executor.run(argv, timeout=timeout, workdir=root)
    stdout = verdict.text_of(getattr(res, "stdout", ""))
    outcomes, messages = parse_report(stdout)
    return TestRun(outcomes, messages, getattr(res, "status", "ok"), getattr(res, "returncode", None),
                   time.perf_counter() - t0)


_TRACER = r"""
import cProfile, json, os, sys
root, package, paths = os.path.realpath(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
prefix = os.path.join(root, package)
sys.path[:0] = [root] + [os.path.join(root, p) for p in paths]
import pytest
profiler = cProfile.Profile()  # C-level: every call is counted at a small cost
profiler.enable()
code = pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", *sys.argv[4:]])
profiler.disable()
profiler.create_stats()
seen = set()
for filename, line, name in profiler.stats:
    f = os.path.realpath(filename) if filename and not filename.startswith("<") and name != "<module>" else ""
    if f == prefix + ".py" or f.startswith(prefix + os.sep):
        seen.add((os.path.relpath(f, root), line))
print("\nCOVERED " + json.dumps(sorted(seen)))
sys.exit(int(code))
"""


def covered_functions(root: str, package: str, tests: Sequence[str], executor: Any, *, timeout: float,
                      python: str = sys.executable, pythonpath: Sequence[str] = ()) -> dict[str, set[int]]:
    """path -> first lines of the functions of `package` (a directory or a ``.py`` module under
    `root`, without the suffix) that the tests call (a decorated function's first line is its
    first decorator's)."""
    root = os.path.abspath(root)
    res = executor.run([python, "-B", "-c", _TRACER, root, package, json.dumps(list(pythonpath)), *tests],
                       timeout=timeout, workdir=root)
    stdout = verdict.text_of(getattr(res, "stdout", ""))
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith("COVERED ")), None)
    if line is None:
        raise RuntimeError(f"the coverage run of {root} did not report (status {getattr(res, 'status', '?')}): "
                           f"{verdict.text_of(getattr(res, 'stderr', ''))[-500:]}")
    out: dict[str, set[int]] = {}
    for path, first in json.loads(line[len("COVERED "):]):
        out.setdefault(path.replace(os.sep, "/"), set()).add(int(first))
    return out


# ----------------------------------------------------------------------------------------------
# Mining.

@dataclasses.dataclass(frozen=True)
class MinedTask:
    """A validated bug: `mutation` makes `failing` fail and leaves `regression` passing; `messages`
    are the failures' short messages; `seconds` the slower of the two validation runs."""

    project: str
    version: str
    mutation: Mutation
    failing: tuple[str, ...]
    regression: tuple[str, ...]
    messages: dict[str, str]
    seconds: float

    @property
    def task_id(self) -> str:
        digest = hashlib.sha256(self.mutation.key.encode()).hexdigest()[:10]
        return f"mined/{self.project}/{digest}"

    @property
    def difficulty(self) -> int:
        """A heuristic: the fewer tests fail, the less the report says (1: five or more fail,
        2: two to four, 3: one)."""
        n = len(self.failing)
        return 1 if n >= 5 else 2 if n >= 2 else 3


def statement(task: MinedTask, package: str, limit: int = 3) -> str:
    """The task as an issue: which tests fail and how, never where or why."""
    lines = [f"Some tests of `{package}` fail after a recent change. Failing:"]
    for test in task.failing[:limit]:
        msg = task.messages.get(test, "")
        lines.append(f"- `{test}`" + (f": {msg}" if msg else ""))
    if len(task.failing) > limit:
        lines.append(f"- and {len(task.failing) - limit} more")
    lines.append(f"Find the bug in `{package}` and fix it so that these tests pass and the other tests keep "
                 "passing. Do not change the tests.")
    return "\n".join(lines)


def validate(root: str, m: Mutation, tests: Sequence[str], baseline: TestRun, executor: Any, *,
             timeout: float, work: str, python: str = sys.executable, pythonpath: Sequence[str] = ()) -> tuple | str:
    """Apply `m` in a copy of `root` under `work` and run the tests twice: (failing, regression,
    messages, seconds), or the reason to reject it ("no_failure", "timeout", "nondeterministic",
    "broke_collection")."""
    copy = os.path.join(work, "copy")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache"))
    path = os.path.join(copy, m.path)
    with open(path, encoding="utf-8") as f:
        source = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(apply(source, m))
    runs = []
    for _ in range(2):
        run = run_tests(copy, tests, executor, timeout=timeout, python=python, pythonpath=pythonpath)
        if run.status == "timeout":
            return "timeout"
        runs.append(run)
    first, second = runs
    if first.failed != second.failed:
        return "nondeterministic"
    if not first.failed:
        return "no_failure"
    if set(first.outcomes) != set(baseline.outcomes):
        return "broke_collection"  # a test disappeared or appeared: an import error, not a bug to fix
    regression = tuple(t for t in baseline.passed if t not in set(first.failed))
    return first.failed, regression, first.messages, max(first.seconds, second.seconds)


def mine(root: str, package: str, tests: Sequence[str], executor: Any, *, project: str, version: str,
         max_tasks: int, seed: int = 0, timeout: float = 60.0, max_seconds: float = 30.0,
         work: str | None = None, python: str = sys.executable, pythonpath: Sequence[str] = (),
         log=lambda m: None) -> tuple[list[MinedTask], dict]:
    """Validated tasks of one project (at most `max_tasks`, sites drawn in a seeded order, at most
    two per function) and the counts of every outcome: (tasks, report)."""
    import tempfile

    root = os.path.abspath(root)
    baseline = run_tests(root, tests, executor, timeout=timeout, python=python, pythonpath=pythonpath)
    if not baseline.green:
        raise RuntimeError(f"{project} {version}: the test suite is not green before any change "
                           f"({len(baseline.failed)} failing, status {baseline.status}); failing: {baseline.failed[:5]}")
    covered = covered_functions(root, package, tests, executor, timeout=timeout, python=python,
                                pythonpath=pythonpath)
    sites: list[Mutation] = []
    for path in sorted(covered):
        if is_test_file(path, tests):
            continue  # the tests of a package that keeps them inside itself
        with open(os.path.join(root, path), encoding="utf-8") as f:
            sites += mutation_sites(f.read(), path, covered[path])
    rng = random.Random(seed)
    rng.shuffle(sites)
    per_function: dict[tuple[str, str], int] = {}
    report = {"sites": len(sites), "tried": 0, "kept": 0, "baseline_s": round(baseline.seconds, 3),
              "functions_covered": sum(len(v) for path, v in covered.items() if not is_test_file(path, tests)),
              "rejected": {r: 0 for r in ("no_failure", "timeout", "nondeterministic", "broke_collection", "slow")}}
    tasks: list[MinedTask] = []
    work = work or tempfile.mkdtemp(prefix="rlcode_mine_")
    for m in sites:
        if len(tasks) >= max_tasks:
            break
        fn = (m.path, m.function)
        if per_function.get(fn, 0) >= 2:
            continue
        report["tried"] += 1
        got = validate(root, m, tests, baseline, executor, timeout=timeout, work=work, python=python,
                       pythonpath=pythonpath)
        if isinstance(got, str):
            report["rejected"][got] += 1
            continue
        failing, regression, messages, seconds = got
        if seconds > max_seconds:
            report["rejected"]["slow"] += 1
            continue
        per_function[fn] = per_function.get(fn, 0) + 1
        tasks.append(MinedTask(project, version, m, failing, regression, messages, seconds))
        log(f"{project}: {m.kind} in {m.function} ({m.path}:{m.line}) -> {len(failing)} failing")
    report["kept"] = len(tasks)
    report["validation_rate"] = round(len(tasks) / report["tried"], 3) if report["tried"] else 0.0
    return tasks, report


def is_test_file(path: str, tests: Sequence[str] = ()) -> bool:
    """A test module or conftest (by name), or a file under one of the `tests` paths."""
    name = os.path.basename(path)
    under = any(path == t or path.startswith(t.rstrip("/") + "/") for t in tests)
    return under or name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"


def read_project(root: str, *, skip: Iterable[str] = ()) -> dict[str, str]:
    """path -> text of every .py, .cfg, .toml, .ini and .txt file under `root` (the agent's copy)."""
    out: dict[str, str] = {}
    skip = set(skip)
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in {"__pycache__", ".git", ".pytest_cache", ".tox"})
        for name in sorted(names):
            if name.endswith((".py", ".cfg", ".toml", ".ini", ".txt", ".md", ".rst")):
                rel = os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
                if rel not in skip:
                    with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                        out[rel] = f.read()
    return out


def to_repo_task(task: MinedTask, root: str, package: str, test_files: Sequence[str], split: str) -> Any:
    """The task for the agent job (`rlcode.envs.tasks.repo.RepoTask`): the project with the bug
    as its files, the project's test files held out (graded by the pytest runner), the reference
    solution as the one edit that undoes the bug."""
    from rlcode.envs.tasks import repo as repo_tasks

    files = read_project(root, skip=test_files)
    path = task.mutation.path
    fixed = files[path]
    files[path] = apply(fixed, task.mutation)
    heldout = {}
    for t in test_files:
        with open(os.path.join(root, t), encoding="utf-8") as f:
            heldout[t] = f.read()
    edit = repo_tasks.Edit(path=path, **_unique_edit(files[path], fixed, task.mutation))
    return repo_tasks.RepoTask(task_id=task.task_id, difficulty=task.difficulty, instruction=statement(task, package),
                               files=files, visible_test_files=(), heldout_tests=heldout,
                               solution_files={path: fixed}, family=f"mined:{task.project}", split=split,
                               seed=0, edits=(edit,), expert_reads=(path,), expert_grep=None)


def _unique_edit(buggy: str, fixed: str, m: Mutation) -> dict[str, str]:
    """The reference fix as an `Edit`'s old/new text: the mutated lines, widened line by line
    until the old text occurs once in the buggy file."""
    b, f = buggy.splitlines(keepends=True), fixed.splitlines(keepends=True)
    extra = len(b) - len(f)  # a removed multi-line statement shortens the file
    lo, hi = m.line - 1, m.end_line  # the mutated lines, in the fixed file
    while True:
        old, new = "".join(b[lo:hi + extra]), "".join(f[lo:hi])
        if buggy.count(old) == 1 or (lo == 0 and hi >= len(f)):
            return {"old": old, "new": new}
        lo, hi = max(0, lo - 1), min(len(f), hi + 1)


def split_of(project: str, path: str, eval_projects: Iterable[str] = (), eval_fraction: float = 0.2) -> str:
    """"test" for every task of an evaluation project and for the files of the other projects
    that a hash puts in the held-out fraction; "train" otherwise: evaluation sees code (projects
    and files) that training never saw."""
    if project in set(eval_projects):
        return "test"
    h = int.from_bytes(hashlib.sha256(f"{project}/{path}".encode()).digest()[:8], "big") / 2 ** 64
    return "test" if h < eval_fraction else "train"


def as_json(task: MinedTask) -> dict[str, Any]:
    return {"task_id": task.task_id, "project": task.project, "version": task.version,
            "mutation": dataclasses.asdict(task.mutation), "failing": list(task.failing),
            "regression": list(task.regression), "messages": task.messages, "seconds": task.seconds,
            "difficulty": task.difficulty}


def from_json(d: Mapping[str, Any]) -> MinedTask:
    return MinedTask(d["project"], d["version"], Mutation(**d["mutation"]), tuple(d["failing"]),
                     tuple(d["regression"]), dict(d["messages"]), float(d["seconds"]))


def load_prepared(cache: str, *, splits: Sequence[str] = ("train", "test")) -> dict[str, list[Any]]:
    """The agent tasks (`to_repo_task`) of a prepared cache (`experiments.prepare_mined`:
    ``tasks.jsonl`` and the unpacked projects under ``src/``), by split, in file order."""
    path = os.path.join(cache, "tasks.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no mined tasks here; run python -m experiments.prepare_mined "
                                f"--cache {cache} first")
    out: dict[str, list[Any]] = {s: [] for s in splits}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            if d["split"] not in out:
                continue
            root = os.path.join(cache, "src", f"{d['project']}-{d['version']}")
            out[d["split"]].append(to_repo_task(from_json(d), root, d["package"], d["tests"], d["split"]))
    return out
