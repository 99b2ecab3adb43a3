"""Seeded generator of small Python repository tasks, with reference solutions and experts.

A task is a tiny repository: a package ``<pkg>/`` of two or three modules and visible tests
under ``tests/``, with a planted bug or a missing feature. The agent gets the repository, an
instruction and the tools of `rlcode.envs.tools`; its change is graded by **held-out tests**
under ``heldout_tests/`` that are never written into the agent's copy (`materialize`).

Difficulty levels:

* 1 – a one-line constant, operator, comparison or range fix in the one module the instruction
  names (families ``fix_operator``, ``fix_constant``, ``fix_comparison``; eval: ``off_by_one``).
* 2 – a fix inside a function body that needs a second module read to get right: a setting's
  key, the order of a helper's return values, the order of a helper's parameters (families
  ``setting_key``, ``unpack_order``, ``call_order``; eval: ``missing_conversion``).
* 3 – a small feature touching two modules: a new calculator operator, a new dataclass field
  used by the pricing code (``add_operator``, ``add_field``; eval: ``add_rule``).

Within a family a seed draws the package and module names, which variant of the bug or feature
is planted, the constants and the test inputs, so tasks differ in surface and in the fix.

Splits are by **template family**: ``split="train"`` draws only from the train families,
``split="eval"`` only from the eval family of each level, so no eval task shares its template
with a train task (the eval split measures transfer to unseen bug shapes at the same level).
Both splits accept any non-negative seed; the task is a pure function of (split, difficulty,
seed): `random.Random` is seeded with a string, which Python hashes with SHA-512, independent
of ``PYTHONHASHSEED``.

Every task carries its reference solution as exact, unique search/replace edits (`Edit`); the
solved files are those edits applied to the starting files, and the scripted expert
(`expert_turns`) issues the same edits through ``edit_file``.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import os
import random
import re
import tempfile
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

from rlcode.envs import verdict
from rlcode.sandbox import fstree

HELDOUT_DIR = "heldout_tests"
TEST_DIR = "tests"
SPLITS = ("train", "eval")
LEVELS = (1, 2, 3)


@dataclasses.dataclass(frozen=True)
class Edit:
    """Replace the single occurrence of `old` in file `path` with `new`."""

    path: str
    old: str
    new: str


@dataclasses.dataclass(frozen=True)
class RepoTask:
    """One repository task. Treat the dicts as read-only.

    task_id: ``"<split>/L<difficulty>/<family>/<seed>"``, unique per (split, difficulty, seed);
      ``/varied`` is appended for a varied-bug task (`generate_task`).
    difficulty: 1, 2 or 3 (module docstring).
    instruction: what the agent is asked to do (the user message of an episode).
    files: relative path -> text: the agent's starting copy, visible tests included.
    visible_test_files: the paths of `files` that are tests, for ``run_tests``.
    heldout_tests: relative path (under `HELDOUT_DIR`) -> text; never part of `files`.
    solution_files: the files the reference solution changes, path -> fixed text.
    family, split, seed: where the task came from.
    edits: the reference solution as search/replace edits on `files`.
    expert_reads: files the expert reads before fixing.
    expert_grep: a literal the expert searches for (None: no search).
    heldout_checks: the held-out tests as data (`heldout_checks`), one `verdict.CheckGroup` per
      test, named by its pytest node id: what grading evaluates in the sandbox (the expected
      values stay with the grader).
    """

    task_id: str
    difficulty: int
    instruction: str
    files: dict[str, str]
    visible_test_files: tuple[str, ...]
    heldout_tests: dict[str, str]
    solution_files: dict[str, str]
    family: str
    split: str
    seed: int
    edits: tuple[Edit, ...]
    expert_reads: tuple[str, ...]
    expert_grep: str | None = None
    heldout_checks: tuple[verdict.CheckGroup, ...] = ()


# ----------------------------------------------------------------------------------------------
# Helpers shared by the families.

_ADJECTIVES = ("amber", "brisk", "cobalt", "dusty", "eager", "fuzzy", "gentle", "hollow", "ivory",
               "jolly", "keen", "lunar", "misty", "nimble", "olive", "plucky", "quiet", "rustic",
               "silver", "tidy")
_NOUNS = ("ledger", "orbit", "garden", "harbor", "atlas", "beacon", "canvas", "depot", "engine",
          "forge", "grove", "kiosk", "lantern", "meadow", "nexus", "pantry", "quarry", "relay",
          "summit", "tandem")


def _code(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def _package_name(rng: random.Random) -> str:
    # Two words joined by "_" never name a standard-library or installed top-level package.
    return f"{rng.choice(_ADJECTIVES)}_{rng.choice(_NOUNS)}"


# Defined in every generated test module that compares results: a comparison that checks the
# exact type first, so that a look-alike return value (an object whose ``__eq__`` is always True,
# an ``int`` subclass equal to everything with ``abs(x - y) == 0``) passes no test.
_SAME = '''
def same(result, expected):
    """`result` has the exact type of `expected` and equals it (element by element for lists and
    tuples); an expected float is matched by an int or a float within 1e-9."""
    if type(expected) is float:
        return type(result) in (int, float) and abs(result - expected) < 1e-9
    if type(result) is not type(expected):
        return False
    if type(expected) in (list, tuple):
        return len(result) == len(expected) and all(same(r, e) for r, e in zip(result, expected))
    return result == expected
'''


def _same(call: str, value: Any) -> str:
    """An assertion line: `call` evaluates to `value`, type-exactly (see `_SAME`). Simple string
    literals are written in double quotes, as in the rest of the generated tests."""
    line = f"    assert same({call}, {value!r})"
    return re.sub(r"'([^'\"\\]*)'", r'"\1"', line)


def _draw(rng: random.Random, sample: Callable[[], Any], ok: Callable[[Any], bool],
          tries: int = 200) -> Any:
    """Draw from `sample` until `ok` holds (the task must separate buggy from fixed code)."""
    for _ in range(tries):
        value = sample()
        if ok(value):
            return value
    raise RuntimeError("could not draw test inputs that separate the buggy and the fixed code")


def _test_module(imports: str, cases: list[str]) -> str:
    # A test function may draw the same input twice; keep each assertion once.
    cases = ["\n".join(dict.fromkeys(case.split("\n"))) for case in cases]
    if any("same(" in case for case in cases):
        cases = [_SAME.strip("\n"), *cases]
    body = "\n\n\n".join(cases)
    return f"{imports}\n\n\n{body}\n"


@dataclasses.dataclass
class _Parts:
    """What a family builder returns; `_assemble` turns it into a `RepoTask`."""

    instruction: str
    files: dict[str, str]
    visible_tests: dict[str, str]
    heldout_tests: dict[str, str]
    edits: list[Edit]
    reads: list[str]
    grep: str | None = None


def _instruction(text: str, visible: list[str]) -> str:
    tests = ", ".join(f"`{p}`" for p in visible)
    return (f"{text}\n\nThe visible tests are in {tests}; held-out tests will also check the "
            "behaviour described above. Change only what is needed, keep the existing API, and "
            "call `submit` when you are done.")


# ----------------------------------------------------------------------------------------------
# Level 1: a one-line fix in one file.

# (name, parameters, correct expression, wrong expressions, description, argument sampler kind)
_FORMULAS = (
    ("rectangle_area", ("width", "height"), "width * height",
     ("width + height", "width - height", "width ** height"), "the area of a width x height rectangle", "int"),
    ("perimeter", ("width", "height"), "2 * (width + height)",
     ("2 * width + height", "2 * (width * height)", "width + height"),
     "the perimeter of a width x height rectangle", "int"),
    ("average", ("a", "b"), "(a + b) / 2", ("(a - b) / 2", "(a + b) * 2", "a + b / 2"),
     "the arithmetic mean of a and b", "int"),
    ("discounted_price", ("price", "rate"), "price * (1 - rate)",
     ("price * (1 + rate)", "price - rate", "price * rate"),
     "the price after a fractional discount `rate` (0.25 means 25% off)", "rate"),
    ("travel_time", ("distance", "speed"), "distance / speed",
     ("distance * speed", "speed / distance", "distance - speed"),
     "the time needed to cover `distance` at constant `speed`", "int"),
    ("net_amount", ("gross", "fee"), "gross - fee", ("gross + fee", "fee - gross"),
     "what is left of `gross` after paying `fee`", "int"),
)


def _formula_args(rng: random.Random, kind: str) -> tuple:
    if kind == "rate":
        return (rng.randrange(4, 80) * 0.25, rng.choice((0.1, 0.2, 0.25, 0.4, 0.5, 0.75)))
    return (rng.randint(2, 12), rng.randint(2, 12))


def _eval_expr(expr: str, params: tuple[str, ...], args: tuple) -> Any:
    return eval(expr, {"__builtins__": {}}, dict(zip(params, args)))  # our own template text


_OPERATORS = ("+", "-", "*", "/", "//", "**")


def _operator_variants(good: str, params: tuple[str, ...], kind: str) -> list[str]:
    """Every expression one binary operator, one operand order or one parameter name away from
    `good` that gives other values on at least 5 of 50 drawn arguments (and never fails,
    overflows or goes complex there). A pure function of its arguments."""
    parts = re.split(r" (\*\*|//|[-+*/]) ", good)  # operands and operators alternate
    out = []
    for i in range(1, len(parts), 2):
        for op in _OPERATORS:
            if op != parts[i]:
                out.append(" ".join(parts[:i] + [op] + parts[i + 1:]))
        if re.fullmatch(r"\w+", parts[i - 1]) and re.fullmatch(r"\w+", parts[i + 1]):
            out.append(" ".join(parts[:i - 1] + [parts[i + 1], parts[i], parts[i - 1]] + parts[i + 2:]))
    for i in range(0, len(parts), 2):  # a parameter written where another belongs
        for a in params:
            for b in params:
                if a != b and re.search(rf"\b{a}\b", parts[i]):
                    out.append(" ".join(parts[:i] + [re.sub(rf"\b{a}\b", b, parts[i])] + parts[i + 1:]))
    probe = random.Random(f"rlcode.repo_tasks/variants/{good}")
    draws = [_formula_args(probe, kind) for _ in range(50)]
    keep = []
    for expr in dict.fromkeys(out):
        try:
            values = [_eval_expr(expr, params, a) for a in draws]
        except (ArithmeticError, ValueError):
            continue
        if expr != good and all(isinstance(v, (int, float)) and abs(v) < 1e12 for v in values) and sum(
                abs(v - _eval_expr(good, params, a)) > 1e-6 for v, a in zip(values, draws)) >= 5:
            keep.append(expr)
    return keep


def _fix_operator(rng: random.Random, varied: bool = False) -> _Parts:
    pkg = _package_name(rng)
    mod = rng.choice(("formulas", "measure", "compute", "arith"))
    chosen = rng.sample(_FORMULAS, 3)
    target = chosen[0]
    name, params, good, wrongs, doc, kind = target
    bad = rng.choice(wrongs)
    if varied:  # any one-operator, operand-order or parameter-name change of the formula (`generate_task`)
        bad = rng.choice(sorted(set(wrongs) | set(_operator_variants(good, params, kind))))
    order = chosen[:]
    rng.shuffle(order)
    funcs = []
    for f_name, f_params, f_good, _, f_doc, _ in order:
        expr = bad if f_name == name else f_good
        funcs.append(f'def {f_name}({", ".join(f_params)}):\n    """Return {f_doc}."""\n'
                     f"    return {expr}\n")
    path = f"{pkg}/{mod}.py"
    source = f'"""Small formulas used across {pkg}."""\n\n\n' + "\n\n".join(funcs)

    def differs(args):
        return abs(_eval_expr(good, params, args) - _eval_expr(bad, params, args)) > 1e-6

    def case(f_name, f_params, f_good, f_kind, must_differ):
        args = _draw(rng, lambda: _formula_args(rng, f_kind), differs if must_differ else (lambda a: True))
        value = _eval_expr(f_good, f_params, args)
        return _same(f"{f_name}({', '.join(repr(a) for a in args)})", value)

    visible = [f"def test_{name}():\n" + case(name, params, good, kind, True)]
    heldout = [f"def test_{name}_values():\n" + "\n".join(case(name, params, good, kind, True)
                                                           for _ in range(4))]
    for f_name, f_params, f_good, _, _, f_kind in chosen[1:]:
        heldout.append(f"def test_{f_name}_unchanged():\n"
                       + "\n".join(case(f_name, f_params, f_good, f_kind, False) for _ in range(2)))
    imports = f"from {pkg}.{mod} import {', '.join(sorted(c[0] for c in chosen))}"
    vis_path, held_path = f"{TEST_DIR}/test_{mod}.py", f"{HELDOUT_DIR}/test_{mod}_heldout.py"
    return _Parts(
        instruction=_instruction(f"`{name}` in `{path}` returns wrong results: it should return "
                                 f"{doc}. Fix it.", [vis_path]),
        files={f"{pkg}/__init__.py": f'"""{pkg}: small formulas."""\n', path: source},
        visible_tests={vis_path: _test_module(f"from {pkg}.{mod} import {name}", visible)},
        heldout_tests={held_path: _test_module(imports, heldout)},
        edits=[Edit(path, f"    return {bad}\n", f"    return {good}\n")],
        reads=[path, vis_path],
        grep=f"{name}(")


# (constant, value, function, from unit (singular), to unit (plural), wrong values)
_CONVERSIONS = (
    ("MINUTES_PER_HOUR", 60, "hours_to_minutes", "hour", "minutes", (6, 600, 100, 30)),
    ("CENTIMETERS_PER_METER", 100, "meters_to_centimeters", "meter", "centimeters", (10, 1000, 12)),
    ("GRAMS_PER_KILOGRAM", 1000, "kilograms_to_grams", "kilogram", "grams", (100, 10000, 1024)),
    ("DAYS_PER_WEEK", 7, "weeks_to_days", "week", "days", (5, 6, 8)),
    ("BITS_PER_BYTE", 8, "bytes_to_bits", "byte", "bits", (16, 4, 7)),
    ("SECONDS_PER_MINUTE", 60, "minutes_to_seconds", "minute", "seconds", (100, 6, 3600)),
)


def _fix_constant(rng: random.Random, varied: bool = False) -> _Parts:
    pkg = _package_name(rng)
    mod = rng.choice(("units", "conversions", "scales"))
    chosen = rng.sample(_CONVERSIONS, 3)
    const, good, fn, unit, units, wrongs = chosen[0]
    bad = rng.choice(wrongs)
    if varied:  # one of the usual wrong values a fifth of the time, else any other of 2..999
        bad = bad if rng.random() < 0.2 else rng.choice([v for v in range(2, 1000) if v != good])
    order = chosen[:]
    rng.shuffle(order)
    consts = "".join(f"{c} = {bad if c == const else v}\n" for c, v, *_ in order)
    funcs = "\n\n".join(f'def {f}(amount):\n    """Convert `amount` {u}s to {us}."""\n    return amount * {c}\n'
                        for c, _, f, u, us, _ in order)
    path = f"{pkg}/{mod}.py"
    source = f'"""Unit conversions."""\n\n{consts}\n\n{funcs}'

    def cases(f, v, n):
        return "\n".join(_same(f"{f}({a})", a * v) for a in rng.sample(range(1, 50), n))

    vis_path, held_path = f"{TEST_DIR}/test_{mod}.py", f"{HELDOUT_DIR}/test_{mod}_heldout.py"
    heldout = [f"def test_{fn}():\n{cases(fn, good, 4)}\n{_same(f'{fn}(0)', 0)}"]
    heldout += [f"def test_{f}_unchanged():\n{cases(f, v, 2)}" for _, v, f, *_ in chosen[1:]]
    return _Parts(
        instruction=_instruction(f"`{fn}` in `{path}` converts incorrectly: one {unit} is {good} "
                                 f"{units}. Fix it.", [vis_path]),
        files={f"{pkg}/__init__.py": f'"""{pkg}: unit conversions."""\n', path: source},
        visible_tests={vis_path: _test_module(f"from {pkg}.{mod} import {fn}",
                                              [f"def test_{fn}():\n{cases(fn, good, 1)}"])},
        heldout_tests={held_path: _test_module(
            f"from {pkg}.{mod} import {', '.join(sorted(c[2] for c in chosen))}", heldout)},
        edits=[Edit(path, f"{const} = {bad}\n", f"{const} = {good}\n")],
        reads=[path, vis_path],
        grep=const)


# (name, parameter, buggy condition, fixed condition, rule sentence, threshold choices)
_PREDICATES = (
    ("is_adult", "age", "age > {k}", "age >= {k}", "a person is an adult from age {k} on", range(16, 22)),
    ("has_passed", "score", "score > {k}", "score >= {k}", "a score of {k} or more passes", (40, 50, 60, 70)),
    ("is_overdue", "days_late", "days_late >= {k}", "days_late > {k}",
     "a loan is overdue only when it is more than {k} days late", range(1, 8)),
    ("can_ride", "height_cm", "height_cm > {k}", "height_cm >= {k}",
     "riders must be at least {k} cm tall (exactly {k} cm is allowed)", range(100, 141, 5)),
    ("is_freezing", "celsius", "celsius < {k}", "celsius <= {k}",
     "water freezes at {k} degrees Celsius and below", (0,)),
    ("is_small_order", "items", "items < {k}", "items <= {k}", "orders of up to {k} items are small",
     range(3, 11)),
)


_COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")


def _fix_comparison(rng: random.Random, varied: bool = False) -> _Parts:
    pkg = _package_name(rng)
    mod = rng.choice(("rules", "checks", "policy"))
    chosen = rng.sample(_PREDICATES, 3)
    ks = {c[0]: rng.choice(c[5]) for c in chosen}
    name, param, bad, good, rule, _ = chosen[0]
    k = ks[name]
    bad, good = bad.format(k=k), good.format(k=k)
    if varied:  # any comparison with a threshold within 2 of k that fails the visible boundary test
        at_k = eval(good, {}, {param: k})  # our own template text
        bad = rng.choice([c for c in (f"{param} {op} {k + d}" for op in _COMPARISONS for d in range(-2, 3))
                          if eval(c, {}, {param: k}) is not at_k])  # our own template text
    order = chosen[:]
    rng.shuffle(order)
    funcs = []
    for f, p, _, f_good, f_rule, _ in order:
        cond = bad if f == name else f_good.format(k=ks[f])
        funcs.append(f'def {f}({p}):\n    """Rule: {f_rule.format(k=ks[f])}."""\n    return {cond}\n')
    path = f"{pkg}/{mod}.py"
    source = '"""Business rules."""\n\n\n' + "\n\n".join(funcs)

    def cases(f, p, f_good, kk):
        values = sorted({kk - 3, kk - 1, kk, kk + 1, kk + 4})
        return "\n".join(f"    assert {f}({v}) is {eval(f_good.format(k=kk), {}, {p: v})}" for v in values)

    vis_path, held_path = f"{TEST_DIR}/test_{mod}.py", f"{HELDOUT_DIR}/test_{mod}_heldout.py"
    visible = [f"def test_{name}_boundary():\n    assert {name}({k}) is {eval(good, {}, {param: k})}"]
    heldout = [f"def test_{f}():\n{cases(f, p, g, ks[f])}" for f, p, _, g, _, _ in chosen]
    return _Parts(
        instruction=_instruction(f"`{name}` in `{path}` gets the boundary wrong: {rule.format(k=k)}. "
                                 "Fix it.", [vis_path]),
        files={f"{pkg}/__init__.py": f'"""{pkg}: business rules."""\n', path: source},
        visible_tests={vis_path: _test_module(f"from {pkg}.{mod} import {name}", visible)},
        heldout_tests={held_path: _test_module(
            f"from {pkg}.{mod} import {', '.join(sorted(c[0] for c in chosen))}", heldout)},
        edits=[Edit(path, f"    return {bad}\n", f"    return {good}\n")],
        reads=[path, vis_path],
        grep=f"{name}(")


# (name, signature, docstring, buggy body, fixed body, reference, argument sampler)
_RANGE_FUNCS = (
    ("sum_up_to", "n", "Return 1 + 2 + ... + n.", "    return sum(range(1, n))\n",
     "    return sum(range(1, n + 1))\n", lambda n: n * (n + 1) // 2, lambda r: (r.randint(2, 40),)),
    ("countdown", "n", "Return [n, n - 1, ..., 1].", "    return list(range(n, 1, -1))\n",
     "    return list(range(n, 0, -1))\n", lambda n: list(range(n, 0, -1)), lambda r: (r.randint(2, 9),)),
    ("factorial", "n", "Return n! for n >= 0.",
     "    result = 1\n    for i in range(2, n):\n        result *= i\n    return result\n",
     "    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n",
     lambda n: __import__("math").factorial(n), lambda r: (r.randint(3, 12),)),
    ("last_items", "items, n", "Return the last n items of the list (1 <= n <= len(items)).",
     "    return items[len(items) - n + 1:]\n", "    return items[len(items) - n:]\n",
     lambda items, n: items[len(items) - n:],
     lambda r: ((lambda xs: (xs, r.randint(1, len(xs))))(r.sample(range(100), r.randint(3, 8))))),
    ("evens_up_to", "n", "Return the even numbers from 0 to n inclusive.",
     "    return list(range(0, n, 2))\n", "    return list(range(0, n + 1, 2))\n",
     lambda n: list(range(0, n + 1, 2)), lambda r: (2 * r.randint(1, 10),)),
)


def _off_by_one(rng: random.Random) -> _Parts:
    pkg = _package_name(rng)
    mod = rng.choice(("sequences", "series", "counting"))
    chosen = rng.sample(_RANGE_FUNCS, 3)
    name, sig, doc, bad, good, ref, sample = chosen[0]
    order = chosen[:]
    rng.shuffle(order)
    funcs = [f'def {f}({s}):\n    """{d}"""\n' + (bad if f == name else g) for f, s, d, _, g, _, _ in order]
    path = f"{pkg}/{mod}.py"
    source = '"""Counting helpers."""\n\n\n' + "\n\n".join(funcs)

    def buggy(*args):
        scope: dict[str, Any] = {}
        exec(f"def f({sig}):\n{bad}", scope)  # our own template text
        return scope["f"](*args)

    def cases(f, f_ref, f_sample, n, separate):
        lines = []
        for _ in range(n):
            args = _draw(rng, lambda: f_sample(rng),
                         (lambda a: buggy(*a) != f_ref(*a)) if separate else (lambda a: True))
            lines.append(_same(f"{f}({', '.join(repr(a) for a in args)})", f_ref(*args)))
        return "\n".join(lines)

    vis_path, held_path = f"{TEST_DIR}/test_{mod}.py", f"{HELDOUT_DIR}/test_{mod}_heldout.py"
    heldout = [f"def test_{name}():\n{cases(name, ref, sample, 4, True)}"]
    heldout += [f"def test_{f}_unchanged():\n{cases(f, r, s, 2, False)}" for f, _, _, _, _, r, s in chosen[1:]]
    return _Parts(
        instruction=_instruction(f"`{name}` in `{path}` is off by one. Its docstring says: "
                                 f"\"{doc}\" Fix it.", [vis_path]),
        files={f"{pkg}/__init__.py": f'"""{pkg}: counting helpers."""\n', path: source},
        visible_tests={vis_path: _test_module(f"from {pkg}.{mod} import {name}",
                                              [f"def test_{name}():\n{cases(name, ref, sample, 1, True)}"])},
        heldout_tests={held_path: _test_module(
            f"from {pkg}.{mod} import {', '.join(sorted(c[0] for c in chosen))}", heldout)},
        edits=[Edit(path, bad, good)],
        reads=[path, vis_path],
        grep=f"{name}(")


# ----------------------------------------------------------------------------------------------
# Level 2: a fix inside a function body that depends on another module.

# (key, wrong key used by the caller, getter name, description, default choices)
_SETTINGS = (
    ("max_retries", "retries", "retry_limit", "number of retries", (3, 5, 8)),
    ("timeout_seconds", "timeout", "request_timeout", "request timeout in seconds", (10, 30, 60)),
    ("page_size", "per_page", "items_per_page", "number of items per page", (20, 25, 50)),
    ("cache_ttl", "ttl", "cache_lifetime", "cache lifetime in seconds", (60, 300, 900)),
    ("batch_size", "batch", "upload_batch", "upload batch size", (16, 32, 64)),
    ("worker_count", "workers", "pool_size", "size of the worker pool", (2, 4, 8)),
)


def _setting_key(rng: random.Random) -> _Parts:
    pkg = _package_name(rng)
    client = rng.choice(("client", "session", "worker", "service"))
    chosen = rng.sample(_SETTINGS, 3)
    defaults = {c[0]: rng.choice(c[4]) for c in chosen}
    key, wrong, getter, desc, _ = chosen[0]
    settings_path, client_path = f"{pkg}/settings.py", f"{pkg}/{client}.py"
    entries = "".join(f'    "{k}": {defaults[k]},\n' for k in sorted(defaults))
    settings = (f'"""Default settings and their lookup."""\n\nDEFAULTS = {{\n{entries}}}\n\n\n' + _code('''
        def effective(name, overrides=None):
            """Value of setting `name`: `overrides[name]` when given, else the default."""
            if overrides and name in overrides:
                return overrides[name]
            return DEFAULTS[name]
        '''))
    order = chosen[:]
    rng.shuffle(order)
    getters = "\n\n".join(f'def {g}(overrides=None):\n    """The configured {d}."""\n'
                          f'    return effective("{wrong if k == key else k}", overrides)\n'
                          for k, _, g, d, _ in order)
    client_src = f'"""Configuration accessors."""\n\nfrom .settings import effective\n\n\n{getters}'
    others = [c for c in chosen[1:]]
    vis_path, held_path = f"{TEST_DIR}/test_{client}.py", f"{HELDOUT_DIR}/test_{client}_heldout.py"
    override = rng.randint(100, 999)
    visible = [f"def test_{getter}_default():\n" + _same(f"{getter}()", defaults[key])]
    heldout = [f"def test_{getter}():\n" + "\n".join((
                   _same(f"{getter}()", defaults[key]),
                   _same(f"{getter}({{{key!r}: {override}}})", override),
                   _same(f"{getter}({{'other': 1}})", defaults[key])))]
    heldout += [f"def test_{g}_unchanged():\n" + "\n".join((
                    _same(f"{g}()", defaults[k]),
                    _same(f"{g}({{{k!r}: {override + 1}}})", override + 1))) for k, _, g, _, _ in others]
    return _Parts(
        instruction=_instruction(f"`{getter}()` in `{client_path}` raises KeyError instead of "
                                 f"returning the configured {desc}. Fix it.", [vis_path]),
        files={f"{pkg}/__init__.py": f'"""{pkg}: configuration."""\n', settings_path: settings,
               client_path: client_src},
        visible_tests={vis_path: _test_module(f"from {pkg}.{client} import {getter}", visible)},
        heldout_tests={held_path: _test_module(
            f"from {pkg}.{client} import {', '.join(sorted(c[2] for c in chosen))}", heldout)},
        edits=[Edit(client_path, f'effective("{wrong}", overrides)', f'effective("{key}", overrides)')],
        reads=[client_path, settings_path],
        grep="DEFAULTS")


# (helper name, first name, second name, (first, second) expressions, caller, caller doc, result)
_PAIRS = (
    ("totals", "total", "count", ("sum(values)", "len(values)"), "mean",
     "Arithmetic mean of a non-empty list.", "total / count"),
    ("bounds", "low", "high", ("min(values)", "max(values)"), "value_range",
     "Largest minus smallest value of a non-empty list.", "high - low"),
    ("ends", "first", "last", ("values[0]", "values[-1]"), "net_change",
     "Last value minus first value of a non-empty list.", "last - first"),
)


def _unpack_order(rng: random.Random) -> _Parts:
    pkg = _package_name(rng)
    helpers, report = rng.choice((("helpers", "report"), ("aggregate", "summary"), ("reduce", "stats")))
    helper, a, b, (ea, eb), caller, cdoc, result = rng.choice(_PAIRS)
    swap = rng.random() < 0.5
    first, second = (b, a) if swap else (a, b)
    efirst, esecond = (eb, ea) if swap else (ea, eb)
    helpers_path, report_path = f"{pkg}/{helpers}.py", f"{pkg}/{report}.py"
    helper_src = _code(f'''
        """Reductions over lists of numbers."""


        def {helper}(values):
            """Return ({first}, {second}) of a non-empty list."""
            return {efirst}, {esecond}
        ''')
    wrong_unpack = f"    {second}, {first} = {helper}(values)\n"
    right_unpack = f"    {first}, {second} = {helper}(values)\n"
    report_src = (f'"""Summaries built on the reductions."""\n\nfrom .{helpers} import {helper}\n\n\n'
                  f'def {caller}(values):\n    """{cdoc}"""\n{wrong_unpack}    return {result}\n')

    def correct(values):
        scope = {a: eval(ea, {}, {"values": values}), b: eval(eb, {}, {"values": values})}
        return eval(result, {}, scope)

    def buggy(values):
        scope = {first: eval(esecond, {}, {"values": values}), second: eval(efirst, {}, {"values": values})}
        return eval(result, {}, scope)

    def case():
        values = _draw(rng, lambda: [rng.randint(1, 30) for _ in range(rng.randint(3, 6))],
                       lambda v: abs(correct(v) - buggy(v)) > 1e-6)
        return _same(f"{caller}({values!r})", correct(values))

    vis_path, held_path = f"{TEST_DIR}/test_{report}.py", f"{HELDOUT_DIR}/test_{report}_heldout.py"
    check = [1, 2, 3, 4]
    heldout = [f"def test_{caller}():\n" + "\n".join(case() for _ in range(4)),
               f"def test_{helper}_unchanged():\n"
               + _same(f"{helper}({check!r})", (eval(efirst, {}, {"values": check}),
                                                eval(esecond, {}, {"values": check})))]
    return _Parts(
        instruction=_instruction(f"`{caller}` in `{report_path}` returns wrong values. Its "
                                 f"docstring says: \"{cdoc}\" Fix it.", [vis_path]),
        files={f"{pkg}/__init__.py": f'"""{pkg}: list summaries."""\n', helpers_path: helper_src,
               report_path: report_src},
        visible_tests={vis_path: _test_module(f"from {pkg}.{report} import {caller}",
                                              [f"def test_{caller}():\n{case()}"])},
        heldout_tests={held_path: _test_module(
            f"from {pkg}.{helpers} import {helper}\nfrom {pkg}.{report} import {caller}", heldout)},
        edits=[Edit(report_path, wrong_unpack, right_unpack)],
        reads=[report_path, helpers_path],
        grep=f"{helper}(")


_CALL_HELPERS = {
    # helper name -> (canonical parameters, body expression, docstring)
    "clamp": (("value", "low", "high"), "max(low, min(value, high))",
              "Limit `value` to the closed interval [low, high]."),
    "percent": (("part", "whole"), "100 * part / whole", "`part` as a percentage of `whole`."),
}


def _bound_call(helper: str, bound: Mapping[str, Any]) -> Any:
    if helper == "clamp":
        return max(bound["low"], min(bound["value"], bound["high"]))
    return 100 * bound["part"] / bound["whole"]


_CALL_SETTINGS = ("volume", "brightness", "speed", "temperature", "zoom")


def _call_order(rng: random.Random) -> _Parts:
    pkg = _package_name(rng)
    util, mod = rng.choice((("util", "controls"), ("mathx", "device"), ("numeric", "panel")))
    util_path, mod_path = f"{pkg}/{util}.py", f"{pkg}/{mod}.py"
    helper = rng.choice(sorted(_CALL_HELPERS))
    canon, body, hdoc = _CALL_HELPERS[helper]
    # Parameter orders under which the canonical-order call gives different results (for
    # clamp, swapping `value` and `high` alone changes nothing: max(low, min(high, value))).
    perms = [p for p in itertools.permutations(canon)
             if any(_bound_call(helper, dict(zip(p, args))) != _bound_call(helper, dict(zip(canon, args)))
                    for args in ((-5, 1, 10), (5, 1, 10), (15, 1, 10), (1, 2, 3)))]
    params = rng.choice(perms)
    util_src = (f'"""Numeric helpers."""\n\n\ndef {helper}({", ".join(params)}):\n'
                f'    """{hdoc}"""\n    return {body}\n')

    def call(values: Mapping[str, str], order) -> str:
        return f"{helper}({', '.join(values[p] for p in order)})"

    if helper == "clamp":
        what = rng.choice(_CALL_SETTINGS)
        lo, hi = rng.randint(0, 10), rng.randint(50, 100)
        names = {"value": "level", "low": f"MIN_{what.upper()}", "high": f"MAX_{what.upper()}"}
        func = f"set_{what}"
        head = f"MIN_{what.upper()} = {lo}\nMAX_{what.upper()} = {hi}\n\n\n"
        doc = f"Return `level` limited to [MIN_{what.upper()}, MAX_{what.upper()}]."

        def ref(level):
            return max(lo, min(level, hi))

        def bug(level):
            # The call passes the canonical order into the permuted parameters.
            return _bound_call(helper, dict(zip(params, (level, lo, hi))))

        def sample():
            return (rng.choice((rng.randint(-50, lo - 1), rng.randint(lo, hi), rng.randint(hi + 1, 200))),)

        signature = "level"
        instruction = (f"`{func}` in `{mod_path}` does not keep the level within "
                       f"[MIN_{what.upper()}, MAX_{what.upper()}]. Fix it.")
    else:
        func = rng.choice(("completion_rate", "pass_rate", "share"))
        names = {"part": "done", "whole": "total"}
        head = ""
        doc = "Percentage of `total` that is `done`."
        signature = "done, total"

        def ref(done, total):
            return 100 * done / total

        def bug(done, total):
            return 100 * total / done

        def sample():
            return (rng.randint(1, 40), rng.randint(41, 90))

        instruction = f"`{func}(done, total)` in `{mod_path}` returns wrong percentages. Fix it."
    wrong, right = call(names, canon), call(names, params)
    mod_src = (f'"""Settings and rates built on the numeric helpers."""\n\nfrom .{util} import {helper}\n\n'
               f'{head}def {func}({signature}):\n    """{doc}"""\n    return {wrong}\n')

    def case():
        args = _draw(rng, sample, lambda a: abs(ref(*a) - bug(*a)) > 1e-6)
        return _same(f"{func}({', '.join(map(repr, args))})", ref(*args))

    vis_path, held_path = f"{TEST_DIR}/test_{mod}.py", f"{HELDOUT_DIR}/test_{mod}_heldout.py"
    return _Parts(
        instruction=_instruction(instruction, [vis_path]),
        files={f"{pkg}/__init__.py": f'"""{pkg}: device settings."""\n', util_path: util_src, mod_path: mod_src},
        visible_tests={vis_path: _test_module(f"from {pkg}.{mod} import {func}", [f"def test_{func}():\n{case()}"])},
        heldout_tests={held_path: _test_module(f"from {pkg}.{mod} import {func}",
                                               [f"def test_{func}():\n" + "\n".join(case() for _ in range(5))])},
        edits=[Edit(mod_path, f"    return {wrong}\n", f"    return {right}\n")],
        reads=[mod_path, util_path],
        grep=f"{helper}(")


# (large unit, small unit, factor, table name, item names, value step)
_UNIT_TABLES = (
    ("dollars", "cents", 100, "PRICES", ("apple", "bread", "cheese", "dates", "eggs", "flour"), 0.25),
    ("kilograms", "grams", 1000, "WEIGHTS", ("anvil", "box", "crate", "drum", "envelope", "folder"), 0.5),
    ("hours", "minutes", 60, "DURATIONS", ("build", "deploy", "review", "test", "plan", "triage"), 0.5),
    ("kilometers", "meters", 1000, "DISTANCES", ("north", "south", "east", "west", "river", "ridge"), 0.25),
)


def _missing_conversion(rng: random.Random) -> _Parts:
    pkg = _package_name(rng)
    big, small, factor, table, items, step = rng.choice(_UNIT_TABLES)
    mod = rng.choice(("catalog", "inventory", "planner"))
    units_path, mod_path = f"{pkg}/units.py", f"{pkg}/{mod}.py"
    values = {name: rng.randint(1, 40) * step for name in items}
    conv = f"to_{small}"
    units_src = _code(f'''
        """Unit conversions."""


        def {conv}({big}):
            """Convert {big} to whole {small} (rounded to the nearest unit)."""
            return round({big} * {factor})


        def from_{small}({small}):
            """Convert {small} back to {big}."""
            return {small} / {factor}
        ''')
    table_src = "".join(f'    "{k}": {v!r},\n' for k, v in values.items())
    func = f"total_{small}"
    bad = f"    return sum({table}[name] for name in names)\n"
    good = f"    return sum({conv}({table}[name]) for name in names)\n"
    mod_src = (f'"""Lookup table in {big}."""\n\nfrom .units import {conv}\n\n'
               f'{table} = {{\n{table_src}}}\n\n\n'
               f'def {func}(names):\n    """Total of the named entries of {table}, in whole {small}."""\n{bad}')

    def case():
        names = rng.sample(items, rng.randint(1, 4))
        return _same(f"{func}({names!r})", sum(round(values[n] * factor) for n in names))

    vis_path, held_path = f"{TEST_DIR}/test_{mod}.py", f"{HELDOUT_DIR}/test_{mod}_heldout.py"
    return _Parts(
        instruction=_instruction(f"`{func}` in `{mod_path}` should return whole {small}, but "
                                 f"{table} is stored in {big}. Fix it.", [vis_path]),
        files={f"{pkg}/__init__.py": f'"""{pkg}: lookup tables."""\n', units_path: units_src, mod_path: mod_src},
        visible_tests={vis_path: _test_module(f"from {pkg}.{mod} import {func}", [f"def test_{func}():\n{case()}"])},
        heldout_tests={held_path: _test_module(
            f"from {pkg}.{mod} import {func}",
            [f"def test_{func}():\n" + "\n".join(case() for _ in range(4)) + f"\n{_same(f'{func}([])', 0)}",
             f"def test_{func}_type():\n    assert type({func}([\"{items[0]}\"])) is int"])},
        edits=[Edit(mod_path, bad, good)],
        reads=[mod_path, units_path],
        grep=conv)


# ----------------------------------------------------------------------------------------------
# Level 3: a small feature across two modules.

# (symbol, function name, expression, description, argument sampler)
_NEW_OPERATORS = (
    ("%", "modulo", "a % b", "the remainder of a divided by b", lambda r: (r.randint(10, 99), r.randint(2, 9))),
    ("//", "floor_divide", "a // b", "a divided by b, rounded down", lambda r: (r.randint(10, 99), r.randint(2, 9))),
    ("**", "power", "a ** b", "a raised to the power b", lambda r: (r.randint(2, 9), r.randint(2, 5))),
    ("max", "maximum", "max(a, b)", "the larger of a and b", lambda r: (r.randint(1, 99), r.randint(1, 99))),
    ("min", "minimum", "min(a, b)", "the smaller of a and b", lambda r: (r.randint(1, 99), r.randint(1, 99))),
)


def _add_operator(rng: random.Random) -> _Parts:
    pkg = _package_name(rng)
    ops, calc = rng.choice((("ops", "calc"), ("operations", "calculator"), ("arith", "evaluator")))
    ops_path, calc_path = f"{pkg}/{ops}.py", f"{pkg}/{calc}.py"
    sym, fname, expr, desc, sample = rng.choice(_NEW_OPERATORS)
    ops_src = _code('''
        """Binary operations of the calculator."""


        def add(a, b):
            return a + b


        def subtract(a, b):
            return a - b


        def multiply(a, b):
            return a * b
        ''')
    calc_src = _code(f'''
        """Evaluate one binary operation written as "<int> <operator> <int>"."""

        from . import {ops}

        OPERATORS = {{
            "+": {ops}.add,
            "-": {ops}.subtract,
            "*": {ops}.multiply,
        }}


        def evaluate(expression):
            """Evaluate e.g. "2 + 3"; raises ValueError for an unknown operator."""
            left, symbol, right = expression.split()
            if symbol not in OPERATORS:
                raise ValueError(f"unknown operator {{symbol!r}}")
            return OPERATORS[symbol](int(left), int(right))
        ''')

    def case(kind):
        a, b = sample(rng)
        value = eval(expr, {}, {"a": a, "b": b})
        if kind == "ops":
            return _same(f"{ops}.{fname}({a}, {b})", value)
        return _same(f"evaluate(\"{a} {sym} {b}\")", value)

    vis_path, held_path = f"{TEST_DIR}/test_{calc}.py", f"{HELDOUT_DIR}/test_{calc}_heldout.py"
    imports = f"import pytest\n\nfrom {pkg} import {ops}\nfrom {pkg}.{calc} import evaluate"
    visible = ["def test_existing_operators():\n" + "\n".join(
                   _same(f"evaluate({e!r})", v) for e, v in (("2 + 3", 5), ("2 - 3", -1), ("4 * 3", 12))),
               f"def test_{fname}():\n{case('eval')}"]
    heldout = [f"def test_{fname}_function():\n" + "\n".join(case("ops") for _ in range(3)),
               f"def test_{fname}_operator():\n" + "\n".join(case("eval") for _ in range(3)),
               "def test_existing_operators():\n" + "\n".join(
                   _same(f"evaluate({e!r})", v) for e, v in (("7 + 5", 12), ("7 * 5", 35))),
               "def test_unknown_operator():\n    with pytest.raises(ValueError):\n        evaluate(\"1 ? 2\")"]
    last = "def multiply(a, b):\n    return a * b\n"
    return _Parts(
        instruction=_instruction(
            f"Add the `{sym}` operator to `evaluate` in `{calc_path}`: `evaluate(\"a {sym} b\")` must "
            f"return {desc}. Implement it as a function `{fname}(a, b)` in `{ops_path}` next to the "
            "existing operations and register it.", [vis_path]),
        files={f"{pkg}/__init__.py": f'"""{pkg}: a one-operation calculator."""\n', ops_path: ops_src,
               calc_path: calc_src},
        visible_tests={vis_path: _test_module(f"from {pkg}.{calc} import evaluate", visible)},
        heldout_tests={held_path: _test_module(imports, heldout)},
        edits=[Edit(ops_path, last, f"{last}\n\ndef {fname}(a, b):\n    return {expr}\n"),
               Edit(calc_path, f'    "*": {ops}.multiply,\n',
                    f'    "*": {ops}.multiply,\n    "{sym}": {ops}.{fname},\n')],
        reads=[calc_path, ops_path, vis_path],
        grep="OPERATORS")


# (field, description, line-total expression, argument sampler)
_FIELDS = (
    ("discount", "a fractional discount (0.25 means 25% off)", "item.price * item.quantity * (1 - item.discount)",
     lambda r: r.choice((0.1, 0.25, 0.5, 0.75))),
    ("tax_rate", "a fractional tax rate added on top (0.2 means 20% tax)",
     "item.price * item.quantity * (1 + item.tax_rate)", lambda r: r.choice((0.05, 0.1, 0.2, 0.25))),
    ("fee", "a flat fee charged once per line, whatever the quantity",
     "item.price * item.quantity + item.fee", lambda r: r.choice((0.5, 1.0, 2.5, 4.0))),
)


def _add_field(rng: random.Random) -> _Parts:
    pkg = _package_name(rng)
    cls = rng.choice(("Item", "Product", "LineItem", "Article"))
    models, pricing = rng.choice((("models", "pricing"), ("records", "billing"), ("entities", "totals")))
    models_path, pricing_path = f"{pkg}/{models}.py", f"{pkg}/{pricing}.py"
    field, desc, line_expr, sample = rng.choice(_FIELDS)
    models_src = _code(f'''
        """Order data."""

        from dataclasses import dataclass


        @dataclass
        class {cls}:
            name: str
            price: float
            quantity: int = 1
        ''')
    old_line = "    return item.price * item.quantity\n"
    pricing_src = _code(f'''
        """Order totals."""


        def line_total(item):
            """Amount due for one order line."""
        {old_line.rstrip()}


        def order_total(items):
            """Amount due for a whole order."""
            return sum(line_total(item) for item in items)
        ''')

    def price():
        return rng.randint(1, 80) * 0.25

    def expected(p, q, extra):
        class _Item:
            pass
        item = _Item()
        item.price, item.quantity = p, q
        setattr(item, field, extra)
        return eval(line_expr, {}, {"item": item})

    def line_case():
        p, q, x = price(), rng.randint(1, 5), sample(rng)
        line = f"line_total({cls}(\"x\", {p!r}, {q}, {field}={x!r}))"
        return _same(line, expected(p, q, x))

    def default_case():
        p, q = price(), rng.randint(1, 5)
        return _same(f"line_total({cls}(\"x\", {p!r}, {q}))", p * q)

    lines = [(price(), rng.randint(1, 4), sample(rng)) for _ in range(3)]
    order_items = ", ".join(f"{cls}(\"i{i}\", {p!r}, {q}, {field}={x!r})" for i, (p, q, x) in enumerate(lines))
    order_value = sum(expected(p, q, x) for p, q, x in lines)
    imports = f"from {pkg}.{models} import {cls}\nfrom {pkg}.{pricing} import line_total, order_total"
    vis_path, held_path = f"{TEST_DIR}/test_{pricing}.py", f"{HELDOUT_DIR}/test_{pricing}_heldout.py"
    visible = [f"def test_line_total_default():\n{default_case()}", f"def test_line_total_{field}():\n{line_case()}"]
    heldout = [f"def test_line_total_{field}():\n" + "\n".join(line_case() for _ in range(3)),
               f"def test_default_{field}():\n" + _same(f"{cls}('x', 1.0).{field}", 0.0) + f"\n{default_case()}",
               f"def test_order_total():\n{_same(f'order_total([{order_items}])', order_value)}"]
    return _Parts(
        instruction=_instruction(
            f"Add a `{field}` field to `{cls}` in `{models_path}`: {desc}. It defaults to 0, comes "
            f"after `quantity`, and `line_total` in `{pricing_path}` must take it into account "
            f"(the line total becomes `{line_expr}`).", [vis_path]),
        files={f"{pkg}/__init__.py": f'"""{pkg}: orders and totals."""\n', models_path: models_src,
               pricing_path: pricing_src},
        visible_tests={vis_path: _test_module(
            f"from {pkg}.{models} import {cls}\nfrom {pkg}.{pricing} import line_total", visible)},
        heldout_tests={held_path: _test_module(imports, heldout)},
        edits=[Edit(models_path, "    quantity: int = 1\n", f"    quantity: int = 1\n    {field}: float = 0.0\n"),
               Edit(pricing_path, old_line, f"    return {line_expr}\n")],
        reads=[models_path, pricing_path, vis_path],
        grep="line_total")


# (rule name, function name, condition on `value`, description, passing and failing examples)
_NEW_RULES = (
    ("no_spaces", "has_no_spaces", '" " not in value', "the value contains no space",
     ("abc", "a-b"), ("a b", " x")),
    ("lowercase", "is_lowercase", "value == value.lower()", "the value has no upper-case letters",
     ("abc", "x1"), ("Abc", "xY")),
    ("capitalized", "starts_upper", "value[:1].isupper()", "the value starts with an upper-case letter",
     ("Abc", "Zed"), ("abc", "")),
    ("short", "is_short", "len(value) <= {n}", "the value has at most {n} characters", None, None),
)


def _add_rule(rng: random.Random) -> _Parts:
    pkg = _package_name(rng)
    rules, validate = rng.choice((("rules", "validate"), ("checks", "validator"), ("predicates", "forms")))
    rules_path, validate_path = f"{pkg}/{rules}.py", f"{pkg}/{validate}.py"
    rule, fname, cond, desc, good, bad = rng.choice(_NEW_RULES)
    if good is None:
        n = rng.randint(3, 8)
        cond, desc = cond.format(n=n), desc.format(n=n)
        good, bad = ("a" * n, "b"), ("c" * (n + 1), "d" * (n + 3))
    rules_src = _code('''
        """Single-value predicates."""


        def non_empty(value):
            return len(value) > 0


        def is_alpha(value):
            return value.isalpha()
        ''')
    validate_src = _code(f'''
        """Named validation rules."""

        from . import {rules}

        RULES = {{
            "non_empty": {rules}.non_empty,
            "alpha": {rules}.is_alpha,
        }}


        def failures(value, *names):
            """The rules among `names` that `value` breaks; an unknown name raises KeyError."""
            return [name for name in names if not RULES[name](value)]
        ''')
    imports = f"from {pkg} import {rules}\nfrom {pkg}.{validate} import failures"
    vis_path, held_path = f"{TEST_DIR}/test_{validate}.py", f"{HELDOUT_DIR}/test_{validate}_heldout.py"
    visible = ["def test_existing_rules():\n" + _same('failures("abc", "non_empty", "alpha")', []) + "\n"
               + _same('failures("", "non_empty")', ["non_empty"]),
               f"def test_{rule}():\n{_same(f'failures({good[0]!r}, {rule!r})', [])}\n"
               f"{_same(f'failures({bad[0]!r}, {rule!r})', [rule])}"]
    heldout = [f"def test_{fname}():\n" + "".join(f"    assert {rules}.{fname}({v!r}) is True\n" for v in good)
               + "".join(f"    assert {rules}.{fname}({v!r}) is False\n" for v in bad).rstrip("\n"),
               f"def test_{rule}_rule():\n" + "".join(_same(f"failures({v!r}, {rule!r})", []) + "\n" for v in good)
               + "".join(_same(f"failures({v!r}, {rule!r})", [rule]) + "\n" for v in bad).rstrip("\n"),
               "def test_existing_rules():\n" + _same('failures("a1", "alpha", "non_empty")', ["alpha"])]
    last = "def is_alpha(value):\n    return value.isalpha()\n"
    return _Parts(
        instruction=_instruction(
            f"Add a validation rule named `\"{rule}\"` to `RULES` in `{validate_path}`: it passes when "
            f"{desc}. Implement it as a predicate `{fname}(value)` in `{rules_path}` next to the "
            "existing ones (returning a bool).", [vis_path]),
        files={f"{pkg}/__init__.py": f'"""{pkg}: value validation."""\n', rules_path: rules_src,
               validate_path: validate_src},
        visible_tests={vis_path: _test_module(f"from {pkg}.{validate} import failures", visible)},
        heldout_tests={held_path: _test_module(imports, heldout)},
        edits=[Edit(rules_path, last, f"{last}\n\ndef {fname}(value):\n    return {cond}\n"),
               Edit(validate_path, f'    "alpha": {rules}.is_alpha,\n',
                    f'    "alpha": {rules}.is_alpha,\n    "{rule}": {rules}.{fname},\n')],
        reads=[validate_path, rules_path, vis_path],
        grep="RULES")


# ----------------------------------------------------------------------------------------------
# The held-out tests as data.

def _same_helper_dump() -> str:
    return ast.dump(ast.parse(_SAME).body[0])


def heldout_checks(tests: Mapping[str, str]) -> tuple[verdict.CheckGroup, ...]:
    """The held-out test files (path -> pytest source, as the families write them) as
    `verdict.CheckGroup`s, one per test function, named ``<path>::<test>``.

    The files use a closed vocabulary, and every statement is translated or refused: module level
    ``import pytest`` (dropped), other imports (the groups' setup) and the `_SAME` helper
    (verified, dropped); in a test, ``assert same(<expr>, <literal>)`` -> `Expect.equal`,
    ``assert <expr> is True|False|None`` -> `Expect.equal` of that constant (``same`` of a bool is
    ``is``), ``assert type(<expr>) is <name>`` -> `Expect.type`, and
    ``with pytest.raises(<name>): <expr>`` -> `Expect.raises`. Expressions keep their source
    text; expected values are the literals. Anything else raises ValueError naming the file and
    line, so a family cannot add a test the grader would silently not run.
    """
    groups = []
    for path in sorted(tests):
        source = tests[path]
        tree = ast.parse(source)
        setup, funcs = [], []
        for node in tree.body:
            if isinstance(node, ast.Import) and [a.name for a in node.names] == ["pytest"]:
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                setup.append(ast.get_source_segment(source, node))
            elif isinstance(node, ast.FunctionDef) and node.name == "same":
                if ast.dump(node) != _same_helper_dump():
                    raise ValueError(f"{path}:{node.lineno}: a `same` helper other than the generated one")
            elif isinstance(node, ast.FunctionDef) and node.name.startswith("test") and not node.args.args:
                funcs.append(node)
            else:
                raise ValueError(f"{path}:{node.lineno}: unsupported held-out statement {ast.unparse(node)[:80]!r}")
        for func in funcs:
            checks = tuple(_check_of(path, source, stmt) for stmt in func.body)
            groups.append(verdict.CheckGroup(name=f"{path}::{func.name}", checks=checks, setup="\n".join(setup)))
    return tuple(groups)


def _is_call_of(node: ast.AST, name: str, nargs: int) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
            and len(node.args) == nargs and not node.keywords)


def _check_of(path: str, source: str, stmt: ast.stmt) -> verdict.Check:
    """The `verdict.Check` of one statement of a held-out test (see `heldout_checks`)."""
    text = lambda node: ast.get_source_segment(source, node)  # noqa: E731
    if isinstance(stmt, ast.Assert) and stmt.msg is None:
        test = stmt.test
        if _is_call_of(test, "same", 2):
            return verdict.Check(expr=text(test.args[0]), expect=verdict.Expect.equal(ast.literal_eval(test.args[1])))
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Is):
            right = test.comparators[0]
            if _is_call_of(test.left, "type", 1) and isinstance(right, ast.Name):
                return verdict.Check(expr=text(test.left.args[0]), expect=verdict.Expect.type(right.id))
            if isinstance(right, ast.Constant) and type(right.value) in (bool, type(None)):
                return verdict.Check(expr=text(test.left), expect=verdict.Expect.equal(right.value))
    if (isinstance(stmt, ast.With) and len(stmt.items) == 1 and stmt.items[0].optional_vars is None
            and len(stmt.body) == 1 and isinstance(stmt.body[0], ast.Expr)):
        ctx = stmt.items[0].context_expr
        if (isinstance(ctx, ast.Call) and ast.unparse(ctx.func) == "pytest.raises" and len(ctx.args) == 1
                and isinstance(ctx.args[0], ast.Name) and not ctx.keywords):
            return verdict.Check(expr=text(stmt.body[0].value), expect=verdict.Expect.raises(ctx.args[0].id))
    raise ValueError(f"{path}:{stmt.lineno}: unsupported held-out statement {ast.unparse(stmt)[:80]!r}")


# ----------------------------------------------------------------------------------------------
# Registry, assembly and the public API.

@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    difficulty: int
    split: str
    build: Callable[..., _Parts]
    varied: bool = False  # build(rng, varied=True) draws the planted bug from a wider set


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("fix_operator", 1, "train", _fix_operator, varied=True),
    Family("fix_constant", 1, "train", _fix_constant, varied=True),
    Family("fix_comparison", 1, "train", _fix_comparison, varied=True),
    Family("off_by_one", 1, "eval", _off_by_one),
    Family("setting_key", 2, "train", _setting_key),
    Family("unpack_order", 2, "train", _unpack_order),
    Family("call_order", 2, "train", _call_order),
    Family("missing_conversion", 2, "eval", _missing_conversion),
    Family("add_operator", 3, "train", _add_operator),
    Family("add_field", 3, "train", _add_field),
    Family("add_rule", 3, "eval", _add_rule),
)}


def families(split: str, difficulty: int | None = None) -> list[str]:
    """Names of the families of `split` (at `difficulty`, if given), in registry order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return [f.name for f in FAMILIES.values()
            if f.split == split and (difficulty is None or f.difficulty == difficulty)]


def apply_edits(files: Mapping[str, str], edits) -> dict[str, str]:
    """`files` with every edit applied in order; each `old` must occur exactly once."""
    out = dict(files)
    for edit in edits:
        count = out[edit.path].count(edit.old)
        if count != 1:
            raise ValueError(f"edit of {edit.path} matches {count} times: {edit.old!r}")
        out[edit.path] = out[edit.path].replace(edit.old, edit.new)
    return out


BUG_DRAWS = ("standard", "varied")


def generate_task(seed: int, *, difficulty: int | None = None, split: str = "train",
                  family: str | None = None, bugs: str = "standard") -> RepoTask:
    """The task of (split, difficulty, seed); deterministic.

    difficulty: 1, 2 or 3; None draws it from the seed. family: force one family of `split`
    (its difficulty then wins over `difficulty`).
    bugs: "standard", or "varied": the level-1 fix families (``Family.varied``) plant a bug drawn
    from a much wider set (any wrong constant of 2-999, any one-operator, operand-order or
    parameter-name change of the formula, any comparison within 2 of the threshold that fails
    the visible test), so that the broken
    line cannot be guessed from the family and must be read from the file: a curriculum for
    demonstrations, not an evaluation set. The family is the standard task's; the rest of the
    task is drawn anew and its id ends in ``/varied``. Other families ignore it.
    """
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if difficulty is not None and difficulty not in LEVELS:
        raise ValueError(f"difficulty must be one of {LEVELS}, got {difficulty!r}")
    if bugs not in BUG_DRAWS:
        raise ValueError(f"bugs must be one of {BUG_DRAWS}, got {bugs!r}")
    name = f"rlcode.repo_tasks/{split}/{difficulty}/{family}/{seed}"
    rng = random.Random(name)
    if family is None:
        level = difficulty if difficulty is not None else rng.choice(LEVELS)
        family = rng.choice(families(split, level))
    elif family not in families(split):
        raise ValueError(f"family {family!r} is not in split {split!r}: {families(split)}")
    fam = FAMILIES[family]
    varied = bugs == "varied" and fam.varied
    parts = fam.build(random.Random(f"{name}/varied"), varied=True) if varied else fam.build(rng)
    files = {**parts.files, **parts.visible_tests}
    solved = apply_edits(files, parts.edits)
    return RepoTask(
        task_id=f"{split}/L{fam.difficulty}/{family}/{seed}" + ("/varied" if varied else ""),
        difficulty=fam.difficulty,
        instruction=parts.instruction,
        files=files,
        visible_test_files=tuple(parts.visible_tests),
        heldout_tests=dict(parts.heldout_tests),
        solution_files={p: t for p, t in solved.items() if t != files[p]},
        family=family,
        split=split,
        seed=seed,
        edits=tuple(parts.edits),
        expert_reads=tuple(parts.reads),
        expert_grep=parts.grep,
        heldout_checks=heldout_checks(parts.heldout_tests),
    )


def make_tasks(split: str, num: int, *, difficulty: int | None = None, start_seed: int = 0) -> list[RepoTask]:
    """`num` tasks of `split` from seeds start_seed, start_seed + 1, ..."""
    return [generate_task(s, difficulty=difficulty, split=split) for s in range(start_seed, start_seed + num)]


def _write_files(directory: str, files: Mapping[str, str]) -> None:
    # Descriptor-relative and never through a symlink: `directory` may be a copy a program wrote.
    os.makedirs(directory, exist_ok=True)
    fstree.write_files(directory, files)


def materialize(task: RepoTask, root: str | os.PathLike, *, solved: bool = False) -> str:
    """Write a private copy of the task's repository into a new directory under `root`.

    Every call makes a fresh directory (one per rollout), holding `task.files`, with the
    reference solution applied when `solved`. Held-out tests are never written. Returns the
    directory's real path.
    """
    os.makedirs(root, exist_ok=True)
    prefix = re.sub(r"[^A-Za-z0-9]+", "_", task.task_id) + "_"
    directory = os.path.realpath(tempfile.mkdtemp(prefix=prefix, dir=root))
    _write_files(directory, {**task.files, **(task.solution_files if solved else {})})
    return directory


def write_heldout_tests(task: RepoTask, directory: str | os.PathLike) -> list[str]:
    """Write the held-out tests into `directory` (a grading copy, never a rollout's copy);
    returns their relative paths, for ``python -m pytest <paths>``."""
    _write_files(os.fspath(directory), task.heldout_tests)
    return sorted(task.heldout_tests)


# ----------------------------------------------------------------------------------------------
# Scripted expert.

EXPERT_STYLES = ("full", "compact", "recover")

_MISTAKE_OPERATORS = ("**", "//", "<=", ">=", "==", "!=", "+", "-", "*", "/", "<", ">")


def misremembered_edit(task: RepoTask) -> Edit | None:
    """A wrong first try at the task's first reference edit, for the ``recover`` expert: its
    `old` text with one number or one operator changed (drawn from the task's seed), so it is
    not in the file, is not the fix itself, and the file text most like it
    (`rlcode.envs.tools.closest_text`, what a failed ``edit_file`` shows) is exactly the
    reference `old`. None when no such change exists."""
    from rlcode.envs.tools import closest_text  # noqa: PLC0415

    edit = task.edits[0]
    text = task.files[edit.path]
    rng = random.Random(f"rlcode.repo_tasks/misremembered/{task.task_id}")
    numbers = list(re.finditer(r"\d+", edit.old))
    operators = list(re.finditer(r" (\*\*|//|<=|>=|==|!=|[-+*/<>]) ", edit.old))
    candidates = []
    for m in numbers:
        for value in rng.sample(range(2, 1000), 8):
            if str(value) != m.group():
                candidates.append(edit.old[:m.start()] + str(value) + edit.old[m.end():])
    for m in operators:
        for op in _MISTAKE_OPERATORS:
            if op != m.group(1):
                candidates.append(edit.old[:m.start(1)] + op + edit.old[m.end(1):])
    rng.shuffle(candidates)
    for wrong in candidates:
        if wrong != edit.new and wrong not in text and (closest_text(text, wrong) or (0, None))[1] == edit.old:
            return Edit(edit.path, wrong, edit.new)
    return None


def expert_turns(task: RepoTask, style: str = "full") -> list[dict[str, Any]]:
    """The expert's assistant messages (``{"role", "content", "tool_calls"}``), in order.

    ``full``: look around and run the visible tests; read the relevant files (concurrently);
    search for the symbol the fix is about (its uses, or what ties two modules together); apply
    the reference edits; run the tests and the linter; submit. ``compact`` (short episodes for
    small models): read the relevant source files (not the tests); apply the edits; run the
    tests; submit. ``recover``: ``compact`` with a wrong first try at the first edit
    (`misremembered_edit`) before the edits: the tool refuses it and shows the file's line most
    like it, which the next edit copies (``compact`` where no such try exists). The messages do
    not depend on the observations, so a scripted
    policy can replay them (`rlcode.envs.harness.ScriptedPolicy`), and the episode's chat is an
    SFT demonstration in the tokenizer's message format.
    """
    if style not in EXPERT_STYLES:
        raise ValueError(f"expert style must be one of {EXPERT_STYLES}, got {style!r}")

    def call(name, **arguments):
        return {"name": name, "arguments": arguments}

    if style in ("compact", "recover"):
        reads = [p for p in task.expert_reads if p not in task.visible_test_files] or list(task.expert_reads)
        wrong = misremembered_edit(task) if style == "recover" else None
        turns = [("", [call("read_file", path=p) for p in reads]),
                 *([("", [call("edit_file", path=wrong.path, old=wrong.old, new=wrong.new)])] if wrong else []),
                 ("", [call("edit_file", path=e.path, old=e.old, new=e.new) for e in task.edits]),
                 ("", [call("run_tests")]),
                 ("", [call("submit")])]
        return [{"role": "assistant", "content": text, "tool_calls": calls} for text, calls in turns]

    turns = [("I'll look at the repository layout and run the visible tests first.",
              [call("list_dir", path="."), call("run_tests")]),
             ("Let me read the relevant code.", [call("read_file", path=p) for p in task.expert_reads])]
    if task.expert_grep is not None:
        turns.append((f"Let me check where `{task.expert_grep}` appears.", [call("grep", pattern=task.expert_grep)]))
    changed = ", ".join(sorted({f"`{e.path}`" for e in task.edits}))
    turns.append((f"I'll make the change in {changed}.",
                  [call("edit_file", path=e.path, old=e.old, new=e.new) for e in task.edits]))
    turns.append(("Now I'll run the tests and the linter.", [call("run_tests"), call("lint")]))
    turns.append(("The change is in place and the tests pass; submitting.", [call("submit")]))
    return [{"role": "assistant", "content": text, "tool_calls": calls} for text, calls in turns]
