"""Seeded generator of program-synthesis tasks, with reference solutions and a sandbox grader.

A task asks for the body of a one-argument Python function. The prompt gives the signature
(with type hints) and 3-4 input/output examples; the reward runs 8-12 **held-out** cases, none of
whose inputs is a visible example, through the trusted-verdict protocol (`check_group`).

Hidden programs. A program is a chain of `depth` primitives of a small typed DSL over ``int``,
``str`` and ``list[int]`` (`PRIMITIVES`; each has a source type, a target type and an optional
constant). The chain is type-consistent: each primitive consumes the type the previous one
produced, the first one consumes the argument type. Difficulty = depth, 1..4 (`LEVELS`).
Every primitive is total on its type (no exceptions: ``max`` uses a default, ``//`` a
non-zero constant, ``xs[0]`` a guard), so every task input has a defined output.

Each program has two faces, and the tests check that they agree on hundreds of programs:

* `evaluate`: a Python interpreter of the DSL (the definition of the outputs);
* `render_body`: idiomatic Python source of the function body (the reference solution, also the
  SFT demonstration). One statement per primitive, assigning to ``n`` / ``s`` / ``xs`` by type;
  the last primitive is inlined into ``return``.

Rejected (degenerate or redundant) programs, judged on the fixed probe inputs `PROBES`:

* two consecutive uses of the same primitive (``add 2 . add 3``, ``sort . sort``);
* any two prefixes of the chain (the empty prefix, i.e. the identity, included) that behave the
  same on the probes: this removes no-op steps (``sort`` of a sorted list), cancelling pairs
  (``reverse . reverse``) and identity programs;
* constant output on the probes, or on the held-out cases, or on the visible examples.

Depth is the number of primitives of the generated chain; it is not proven minimal (e.g.
``mul 2 . add 1`` could be matched by a different chain of the same length), only free of the
redundancies above.

Behaviour signature and splits. `behaviour_signature(program)` is the SHA-256 of the argument
type and the ``repr`` of the program's outputs on `PROBES[argument type]`. A program belongs to
the ``eval`` split iff the first 8 hex digits of its signature, as an integer, are ``< 0.2 *
16**8`` (about 20% of behaviours), otherwise to ``train``. The split is therefore a function of
behaviour on the probes: two programs that agree on the probes have the same signature and the
same split, so no program of the eval split behaves on the probes like any training program.
(Programs that agree on the probes but differ elsewhere are treated as the same behaviour;
that only makes the separation stricter.) `make_split` additionally returns tasks with pairwise
distinct signatures.

Determinism. A task is a pure function of (seed, difficulty, split): `random.Random` is seeded
with a string, which Python hashes with SHA-512, independent of ``PYTHONHASHSEED``.

Grading. `check_group(task, candidate)` expresses the held-out cases as data for
`rlcode.envs.verdict`: the sandboxed child receives the candidate's source and the inputs only,
calls the function on each input and returns each value through a typed serialisation; the
trusted side compares with the expected outputs it alone holds, type-exactly and recursively
(``True`` is not ``1``, an object whose ``__eq__`` always answers True fails). Nothing in the
candidate's process knows an expected output, the number of checks aside, so printing, exiting
early, forging report lines or inspecting the interpreter earns nothing it did not compute.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable
from typing import Any

from rlcode.envs import verdict

SPLITS = ("train", "eval")
LEVELS = (1, 2, 3, 4)
EVAL_FRACTION = 0.2

TYPES = ("int", "str", "list")
TYPE_HINT = {"int": "int", "str": "str", "list": "list[int]"}
VAR = {"int": "n", "str": "s", "list": "xs"}
FUNCTION_NAMES = ("transform", "compute", "solve", "process", "convert", "evaluate_input")

# Fixed probe inputs per argument type: the behaviour signature and the redundancy checks.
PROBES: dict[str, tuple] = {
    "int": (-17, -5, -3, -1, 0, 1, 2, 3, 4, 7, 10, 12, 25, 99),
    "str": ("", " ", "a", "abc", "Hello World", "  padded  ", "aAbB", "xyz abc", "banana",
            "CAB", "a b c", "zzz  ", "x-y_z"),
    "list": ((), (0,), (5,), (-3,), (1, 2, 3), (3, 1, 2), (-2, -7, 4), (4, 4, 1, 0),
             (10, -10, 5, -5, 0), (2, 9, 2, 7, 1, 8), (1, 1, 1), (-1, 6, -4, 3, 8, -9, 0)),
}
# Edge cases always among the held-out inputs (empty, zero, negatives, whitespace).
EDGE_CASES: dict[str, tuple] = {
    "int": (0, -1, -13, 1),
    "str": ("", " ", " AbC "),
    "list": ((), (0,), (-4, -4), (-5, 3, -1)),
}
_STR_ALPHABET = "abcxyzAB  "


@dataclasses.dataclass(frozen=True)
class Primitive:
    """One DSL operation `src -> dst`.

    consts: the constants a program may pick (``(None,)`` for none).
    fn(value, k): the interpreter. render(var, k): a Python expression over variable `var`.
    """

    name: str
    src: str
    dst: str
    consts: tuple
    fn: Callable[[Any, Any], Any]
    render: Callable[[str, Any], str]


_PRED = {
    "pos": ("v > 0", lambda v: v > 0),
    "neg": ("v < 0", lambda v: v < 0),
    "even": ("v % 2 == 0", lambda v: v % 2 == 0),
    "odd": ("v % 2 == 1", lambda v: v % 2 == 1),
    "gt2": ("v > 2", lambda v: v > 2),
}


def _p(name, src, dst, consts, fn, render) -> Primitive:
    return Primitive(name, src, dst, tuple(consts), fn, render)


_N = (None,)
PRIMITIVES: tuple[Primitive, ...] = (
    # int -> int
    _p("add", "int", "int", (-5, -3, -2, -1, 1, 2, 3, 7), lambda x, k: x + k,
       lambda v, k: f"{v} + {k}" if k > 0 else f"{v} - {-k}"),
    _p("mul", "int", "int", (2, 3, 4, -2), lambda x, k: x * k, lambda v, k: f"{v} * {k}"),
    _p("negate", "int", "int", _N, lambda x, k: -x, lambda v, k: f"-{v}"),
    _p("abs", "int", "int", _N, lambda x, k: abs(x), lambda v, k: f"abs({v})"),
    _p("mod", "int", "int", (2, 3, 5, 7), lambda x, k: x % k, lambda v, k: f"{v} % {k}"),
    _p("floordiv", "int", "int", (2, 3, 4), lambda x, k: x // k, lambda v, k: f"{v} // {k}"),
    _p("square", "int", "int", _N, lambda x, k: x * x, lambda v, k: f"{v} * {v}"),
    _p("max_with", "int", "int", (0, 3, -2), lambda x, k: max(x, k),
       lambda v, k: f"max({v}, {k})"),
    _p("min_with", "int", "int", (0, 5, -1), lambda x, k: min(x, k),
       lambda v, k: f"min({v}, {k})"),
    # int -> str / list
    _p("to_str", "int", "str", _N, lambda x, k: str(x), lambda v, k: f"str({v})"),
    _p("digits", "int", "list", _N, lambda x, k: [int(c) for c in str(abs(x))],
       lambda v, k: f"[int(c) for c in str(abs({v}))]"),
    # str -> str
    _p("upper", "str", "str", _N, lambda s, k: s.upper(), lambda v, k: f"{v}.upper()"),
    _p("lower", "str", "str", _N, lambda s, k: s.lower(), lambda v, k: f"{v}.lower()"),
    _p("strip", "str", "str", _N, lambda s, k: s.strip(), lambda v, k: f"{v}.strip()"),
    _p("reverse_str", "str", "str", _N, lambda s, k: s[::-1], lambda v, k: f"{v}[::-1]"),
    _p("replace", "str", "str", (("a", "o"), (" ", "_"), ("b", ""), ("x", "yy")),
       lambda s, k: s.replace(k[0], k[1]), lambda v, k: f"{v}.replace({k[0]!r}, {k[1]!r})"),
    _p("append_str", "str", "str", ("!", "ab", "-z"), lambda s, k: s + k,
       lambda v, k: f"{v} + {k!r}"),
    _p("prepend_str", "str", "str", ("<", "q"), lambda s, k: k + s, lambda v, k: f"{k!r} + {v}"),
    _p("take_str", "str", "str", (2, 3, 5), lambda s, k: s[:k], lambda v, k: f"{v}[:{k}]"),
    _p("drop_str", "str", "str", (1, 2, 3), lambda s, k: s[k:], lambda v, k: f"{v}[{k}:]"),
    # str -> int / list
    _p("len_str", "str", "int", _N, lambda s, k: len(s), lambda v, k: f"len({v})"),
    _p("count_char", "str", "int", ("a", " ", "b", "z"), lambda s, k: s.count(k),
       lambda v, k: f"{v}.count({k!r})"),
    _p("word_lengths", "str", "list", _N, lambda s, k: [len(w) for w in s.split()],
       lambda v, k: f"[len(w) for w in {v}.split()]"),
    _p("ords", "str", "list", _N, lambda s, k: [ord(c) for c in s],
       lambda v, k: f"[ord(c) for c in {v}]"),
    # list -> list
    _p("map_add", "list", "list", (-2, 1, 3), lambda xs, k: [v + k for v in xs],
       lambda v, k: f"[v + {k} for v in {v}]" if k > 0 else f"[v - {-k} for v in {v}]"),
    _p("map_mul", "list", "list", (2, 3, -1), lambda xs, k: [v * k for v in xs],
       lambda v, k: f"[v * {k} for v in {v}]"),
    _p("map_abs", "list", "list", _N, lambda xs, k: [abs(v) for v in xs],
       lambda v, k: f"[abs(v) for v in {v}]"),
    _p("map_square", "list", "list", _N, lambda xs, k: [v * v for v in xs],
       lambda v, k: f"[v * v for v in {v}]"),
    _p("filter", "list", "list", tuple(_PRED), lambda xs, k: [v for v in xs if _PRED[k][1](v)],
       lambda v, k: f"[v for v in {v} if {_PRED[k][0]}]"),
    _p("reverse", "list", "list", _N, lambda xs, k: xs[::-1], lambda v, k: f"{v}[::-1]"),
    _p("sort", "list", "list", _N, lambda xs, k: sorted(xs), lambda v, k: f"sorted({v})"),
    _p("sort_desc", "list", "list", _N, lambda xs, k: sorted(xs, reverse=True),
       lambda v, k: f"sorted({v}, reverse=True)"),
    _p("take", "list", "list", (1, 2, 3), lambda xs, k: xs[:k], lambda v, k: f"{v}[:{k}]"),
    _p("drop", "list", "list", (1, 2), lambda xs, k: xs[k:], lambda v, k: f"{v}[{k}:]"),
    _p("append", "list", "list", (0, 5, -1), lambda xs, k: xs + [k],
       lambda v, k: f"{v} + [{k}]"),
    _p("dedupe", "list", "list", _N, lambda xs, k: list(dict.fromkeys(xs)),
       lambda v, k: f"list(dict.fromkeys({v}))"),
    # list -> int / str
    _p("sum", "list", "int", _N, lambda xs, k: sum(xs), lambda v, k: f"sum({v})"),
    _p("len", "list", "int", _N, lambda xs, k: len(xs), lambda v, k: f"len({v})"),
    _p("max", "list", "int", (0,), lambda xs, k: max(xs, default=k),
       lambda v, k: f"max({v}, default={k})"),
    _p("min", "list", "int", (0,), lambda xs, k: min(xs, default=k),
       lambda v, k: f"min({v}, default={k})"),
    _p("count", "list", "int", (0, 1, -4), lambda xs, k: xs.count(k),
       lambda v, k: f"{v}.count({k})"),
    _p("first", "list", "int", (0, -1), lambda xs, k: xs[0] if xs else k,
       lambda v, k: f"{v}[0] if {v} else {k}"),
    _p("join", "list", "str", (",", " "), lambda xs, k: k.join(str(v) for v in xs),
       lambda v, k: f"{k!r}.join(str(v) for v in {v})"),
)
PRIM_BY_NAME = {p.name: p for p in PRIMITIVES}
assert len(PRIM_BY_NAME) == len(PRIMITIVES)

Step = tuple  # (primitive name, constant or None)
Program = tuple  # (argument type, tuple of Steps)


def program_types(program: Program) -> tuple[str, str]:
    """(argument type, return type) of a program; raises on a type-inconsistent chain."""
    arg_t, steps = program
    t = arg_t
    for name, _ in steps:
        prim = PRIM_BY_NAME[name]
        if prim.src != t:
            raise TypeError(f"{name} takes {prim.src}, got {t}")
        t = prim.dst
    return arg_t, t


def canonical_program(program: Program) -> str:
    """Readable, unique text of a program: ``list[int] -> sort -> take(3) -> sum``."""
    arg_t, steps = program
    parts = [TYPE_HINT[arg_t]]
    for name, k in steps:
        parts.append(name if k is None else f"{name}({k!r})")
    return " -> ".join(parts)


def _as_value(t: str, x):
    return list(x) if t == "list" else x


def evaluate(program: Program, x):
    """The DSL interpreter: the program's output on argument `x`."""
    arg_t, steps = program
    value = _as_value(arg_t, x)
    for name, k in steps:
        value = PRIM_BY_NAME[name].fn(value, k)
    return value


def render_body(program: Program) -> str:
    """Python source of the function body (4-space indented lines, ending in ``return``)."""
    arg_t, steps = program
    var = VAR[arg_t]
    lines = []
    for i, (name, k) in enumerate(steps):
        prim = PRIM_BY_NAME[name]
        expr = prim.render(var, k)
        if i == len(steps) - 1:
            lines.append(f"return {expr}")
        else:
            var = VAR[prim.dst]
            lines.append(f"{var} = {expr}")
    return "".join(f"    {line}\n" for line in lines)


def signature_line(program: Program, name: str) -> str:
    arg_t, ret_t = program_types(program)
    return f"def {name}({VAR[arg_t]}: {TYPE_HINT[arg_t]}) -> {TYPE_HINT[ret_t]}:"


def behaviour_signature(program: Program) -> str:
    """SHA-256 hex of (argument type, outputs on `PROBES`); equal behaviour -> equal signature."""
    arg_t = program[0]
    outs = [evaluate(program, x) for x in PROBES[arg_t]]
    return hashlib.sha256(repr((arg_t, outs)).encode()).hexdigest()


def split_of(program: Program) -> str:
    """``"eval"`` iff int(signature[:8], 16) < EVAL_FRACTION * 16**8, else ``"train"``."""
    head = int(behaviour_signature(program)[:8], 16)
    return "eval" if head < EVAL_FRACTION * 16 ** 8 else "train"


def _behaviour(program: Program) -> tuple:
    arg_t, ret_t = program_types(program)
    return ret_t, repr([evaluate(program, x) for x in PROBES[arg_t]])


def is_admissible(program: Program) -> bool:
    """No repeated consecutive primitive, no two prefixes behaving alike, no constant output."""
    arg_t, steps = program
    for a, b in zip(steps, steps[1:]):
        if a[0] == b[0]:
            return False
    seen = set()
    for i in range(len(steps) + 1):
        b = _behaviour((arg_t, steps[:i]))
        if b in seen:
            return False
        seen.add(b)
    outs = [evaluate(program, x) for x in PROBES[arg_t]]
    return len({repr(o) for o in outs}) > 1


def sample_program(rng: random.Random, depth: int) -> Program:
    """A random type-consistent chain of `depth` primitives (admissibility not checked)."""
    arg_t = rng.choice(TYPES)
    t, steps, prev = arg_t, [], None
    for _ in range(depth):
        prim = rng.choice([p for p in PRIMITIVES if p.src == t and p.name != prev])
        steps.append((prim.name, rng.choice(prim.consts)))
        t, prev = prim.dst, prim.name
    return arg_t, tuple(steps)


def _random_input(rng: random.Random, t: str):
    if t == "int":
        return rng.randint(-20, 30)
    if t == "str":
        return "".join(rng.choice(_STR_ALPHABET) for _ in range(rng.randint(1, 9)))
    return tuple(rng.randint(-9, 12) for _ in range(rng.randint(1, 7)))


@dataclasses.dataclass(frozen=True)
class SynthTask:
    """One program-synthesis task. Inputs are given as the Python values the function receives.

    task_id: ``"synth/<split>/L<difficulty>/<seed>"``.
    difficulty: depth of the hidden program, 1..4.
    function_name, signature: e.g. ``"solve"``, ``"def solve(xs: list[int]) -> int:"``.
    prompt: the signature with a docstring of the visible examples and the instruction.
    examples: visible (input, output) pairs (3-4).
    tests: held-out (input, output) pairs (8-12), inputs disjoint from the visible ones.
    reference_body: the reference solution, the function body (indented 4 spaces).
    program: canonical program text (`canonical_program`). behaviour: `behaviour_signature`.
    """

    task_id: str
    split: str
    seed: int
    difficulty: int
    function_name: str
    signature: str
    prompt: str
    examples: tuple[tuple[Any, Any], ...]
    tests: tuple[tuple[Any, Any], ...]
    reference_body: str
    program: str
    behaviour: str

    @property
    def reference_source(self) -> str:
        """The complete reference function (signature + body)."""
        return f"{self.signature}\n{self.reference_body}"

    # The completion-task protocol (`rlcode.envs.tasks.protocol.CompletionTask`).
    source = "synth"

    def completion_prompt(self) -> str:
        return completion_prompt(self)

    def completion_target(self) -> str:
        return completion_target(self)

    def check_groups(self, completion: str) -> list[verdict.CheckGroup]:
        return [check_group(self, completion)]

    def score(self, v: verdict.Verdict) -> float:
        """The fraction of held-out cases whose value matched."""
        return float(sum(v.check_passed) / len(v.check_passed)) if v.check_passed else 0.0


def _lit(v) -> str:
    return repr(list(v) if isinstance(v, tuple) else v)


def _prompt(name: str, sig: str, examples) -> str:
    doc = "\n".join(f"    >>> {name}({_lit(x)})\n    {_lit(y)}" for x, y in examples)
    return ("Write the body of the following Python function so that it returns the shown "
            "outputs and generalises to other inputs of the same type.\n\n"
            f'{sig}\n    """Examples:\n\n{doc}\n    """\n')


def _cases(rng: random.Random, program: Program):
    """(visible, held-out) input/output pairs, or None if either set has a constant output."""
    arg_t = program[0]
    visible: list = []
    n_visible = rng.randint(3, 4)
    while len(visible) < n_visible:
        x = _random_input(rng, arg_t)
        if x not in visible and x not in EDGE_CASES[arg_t]:
            visible.append(x)
    n_tests = rng.randint(8, 12)
    held = [x for x in EDGE_CASES[arg_t]]
    for _ in range(200):
        if len(held) >= n_tests:
            break
        x = _random_input(rng, arg_t)
        if x not in held and x not in visible:
            held.append(x)
    ex = tuple((_as_value(arg_t, x), evaluate(program, x)) for x in visible)
    ts = tuple((_as_value(arg_t, x), evaluate(program, x)) for x in held)
    if len({repr(y) for _, y in ex}) < 2 or len({repr(y) for _, y in ts}) < 2:
        return None
    return ex, ts


def generate_task(seed: int, difficulty: int, split: str = "train") -> SynthTask:
    """The task of (seed, difficulty, split): rejection-samples an admissible program of depth
    `difficulty` whose behaviour falls in `split`, then its examples and held-out cases."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if difficulty not in LEVELS:
        raise ValueError(f"difficulty must be one of {LEVELS}, got {difficulty!r}")
    rng = random.Random(f"synth/{split}/{difficulty}/{seed}")
    for _ in range(10_000):
        program = sample_program(rng, difficulty)
        if not is_admissible(program) or split_of(program) != split:
            continue
        cases = _cases(rng, program)
        if cases is None:
            continue
        name = rng.choice(FUNCTION_NAMES)
        sig = signature_line(program, name)
        examples, tests = cases
        return SynthTask(
            task_id=f"synth/{split}/L{difficulty}/{seed}", split=split, seed=seed,
            difficulty=difficulty, function_name=name, signature=sig,
            prompt=_prompt(name, sig, examples), examples=examples, tests=tests,
            reference_body=render_body(program), program=canonical_program(program),
            behaviour=behaviour_signature(program))
    raise RuntimeError(f"no task found for seed={seed} difficulty={difficulty} split={split}")


def make_split(split: str, n: int, seed: int = 0, difficulty: int | None = None,
               levels: tuple[int, ...] = LEVELS) -> list[SynthTask]:
    """`n` tasks of `split` with pairwise distinct behaviour signatures.

    Candidate j has task seed ``seed * 1_000_003 + j`` and level `difficulty`, or ``levels[j %
    len(levels)]`` when difficulty is None; candidates whose behaviour was already taken are
    skipped, so levels with few distinct behaviours (depth 1 has only a few dozen) saturate and
    the other levels fill the rest. The list is a pure function of the arguments."""
    if not levels or any(level not in LEVELS for level in levels):
        raise ValueError(f"levels must be a non-empty subset of {LEVELS}, got {levels!r}")
    tasks: list[SynthTask] = []
    seen: set[str] = set()
    j = 0
    while len(tasks) < n:
        level = difficulty if difficulty is not None else levels[j % len(levels)]
        task = generate_task(seed * 1_000_003 + j, level, split)
        j += 1
        if task.behaviour not in seen:
            seen.add(task.behaviour)
            tasks.append(task)
        if j > 50 * n + 1000:
            raise RuntimeError(f"could not find {n} distinct tasks (found {len(tasks)})")
    return tasks


def completion_prompt(task: SynthTask) -> str:
    """The task as text for a completion model: the signature line, then one comment line per
    visible example (``    # <input> -> <output>``). The policy continues with the indented
    body; `completion_target` is the reference continuation (the SFT demonstration). Shorter than
    `SynthTask.prompt`, whose English instruction a small byte-level policy cannot use."""
    lines = [task.signature] + [f"    # {_lit(x)} -> {_lit(y)}" for x, y in task.examples]
    return "\n".join(lines) + "\n"


def completion_target(task: SynthTask) -> str:
    """The reference body as the continuation of `completion_prompt` (ends with a newline)."""
    return task.reference_body.rstrip("\n") + "\n"


def candidate_source(task: SynthTask, candidate: str) -> str:
    """Full source of the candidate function: `candidate` as is if it defines
    ``def <function_name>(`` at top level, else `candidate` taken as the body under the task's
    signature (re-indented if it was not indented)."""
    if any(line.startswith(f"def {task.function_name}(") for line in candidate.splitlines()):
        return candidate
    lines = candidate.strip("\n").splitlines() or ["pass"]
    if not any(line.startswith((" ", "\t")) for line in lines if line.strip()):
        lines = ["    " + line for line in lines]
    return task.signature + "\n" + "\n".join(lines) + "\n"


def check_group(task: SynthTask, candidate: str) -> verdict.CheckGroup:
    """The held-out tests of `task` as data for the trusted-verdict protocol: the candidate's
    source (`candidate_source`) defines the function, and each held-out case is one call with its
    input; the expected outputs stay in the `CheckGroup`'s expectations, on the trusted side.
    Compared type-exactly and recursively (`verdict.same`: ``True`` is not ``1``, an object whose
    ``__eq__`` always answers True equals nothing)."""
    checks = tuple(verdict.Check(call=task.function_name, args=(x,), expect=verdict.Expect.equal(y))
                   for x, y in task.tests)
    return verdict.CheckGroup(name=task.task_id, checks=checks, source=candidate_source(task, candidate))
