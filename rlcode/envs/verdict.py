"""Trusted verdicts: held-out checks are data, and the candidate's process only computes values.

The principle (the project's sandbox threat model): the candidate never shares a process, an
address space or a writable channel with anything that knows the expected results or writes the
verdict. A held-out check is therefore split in two:

* what to evaluate -- an expression over the names a group's setup defines (``f(3, "a")``,
  ``Item("x", 2.5).fee``) or a named function and its arguments -- is sent to a sandboxed child
  process (`rlcode.envs.verdict_child`), which runs the candidate's code and returns each value
  through a strict typed serialisation (JSON tagged with the exact type; never pickle: nothing
  the candidate sends can run code or carry behaviour here);
* what is expected (`Expect`) stays in this, the trusted, process, which compares.

A child that exits early, prints, forks, floods its output, rebinds the child's functions or writes
lines into its report channel earns nothing it did not compute: the only thing it can influence is
the values it claims, and a claimed value is judged exactly like a returned one. Such behaviour is
also flagged (`FLAGS`) so that a reward can punish it and a monitor can count it.

`Check` (one comparison) and `CheckGroup` (a test: its checks pass together) are the data;
`request_payload` makes the child's standard input, `interpret` turns an executor's result into
a `Verdict`, and `run_checks` does both through any executor with the `rlcode.envs.tools.Executor`
interface (``run(argv, stdin=, timeout=, workdir=)``). The synthesis grader
(`rlcode.train.rollout.Grader`) submits the same child in the pool's in-process mode.

Comparison (`same`, mirroring the generated tests' helper): the claimed value has the exact type
of the expected one, recursively (``True`` is not ``1``, a ``list`` is not a ``tuple``, an ``int``
subclass or any object of a class the protocol does not carry equals nothing), except that an
expected float is matched by an int or a float within ``float_tol`` (absolute). Expected
exceptions (`Expect.raises`) match by the qualified names of the raised exception's classes, so a
subclass of ``ValueError`` is a ``ValueError`` as ``pytest.raises`` would have it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import sys
from collections.abc import Sequence
from typing import Any

from rlcode.envs import verdict_child as child

with open(child.__file__, encoding="utf-8") as _f:
    CHILD_SOURCE = _f.read()
del _f

STATUSES = ("ok", "timeout", "crash", "infra")
# timeout / crash: the candidate's own failure (nothing passes). forged_report: lines in the report
# channel that the child did not write (a garbled line, a claim for an unknown or already answered
# check, a second ready/done); a conflicting second claim also fails that check. The others only
# describe behaviour (a check that raised fails anyway): early_exit, the process returned 0 without
# finishing its report, or the candidate raised SystemExit (or pytest's exit); skipped, it raised
# pytest's skip or xfail; fake_output, it printed the word PASSED; read_heldout, it tried to open,
# list, link or move a watched path (`run_checks(watch=...)`: the held-out tests' place).
FLAGS = ("crash", "early_exit", "fake_output", "forged_report", "read_heldout", "skipped", "timeout")
RAISE_FLAGS = {"builtins.SystemExit": "early_exit", "_pytest.outcomes.Exit": "early_exit",
               "builtins.Exit": "early_exit", "builtins.Skipped": "skipped", "_pytest.outcomes.Skipped": "skipped",
               "_pytest.outcomes.XFailed": "skipped"}  # pytest names some of its outcomes "builtins."
FLOAT_TOL = 1e-9
_PASSED_WORD = re.compile(r"\bPASSED\b")


@dataclasses.dataclass(frozen=True)
class Expect:
    """What a check expects: ``kind`` "equal" (`value`, compared with `same`), "raises" (one of
    `names`, qualified exception class names such as ``"builtins.ValueError"``), "type" (the
    exact type, `names[0]`: a builtin's name such as ``"int"``, else ``"module.Qualname"``) or
    "claim" (any value or exception: the check only collects what the candidate computed, and
    the caller judges `Verdict.claims` itself, on the trusted side, e.g. by replaying a test
    function against them)."""

    kind: str
    value: Any = None
    names: tuple[str, ...] = ()
    float_tol: float = FLOAT_TOL

    @classmethod
    def equal(cls, value: Any, float_tol: float = FLOAT_TOL) -> "Expect":
        return cls("equal", value=value, float_tol=float_tol)

    @classmethod
    def raises(cls, *names: str) -> "Expect":
        return cls("raises", names=tuple(n if "." in n else f"builtins.{n}" for n in names))

    @classmethod
    def type(cls, name: str) -> "Expect":
        return cls("type", names=(name,))

    @classmethod
    def claim(cls) -> "Expect":
        return cls("claim")

    def __post_init__(self):
        if self.kind not in ("equal", "raises", "type", "claim"):
            raise ValueError(f"Expect.kind must be equal, raises, type or claim, got {self.kind!r}")
        if self.kind in ("raises", "type") and not self.names:
            raise ValueError(f"Expect.{self.kind} needs at least one name")


@dataclasses.dataclass(frozen=True)
class Check:
    """One evaluation and its expectation: either `expr` (a Python expression over the names the
    group's setup or source defines) or `call` (a name the group defines) with `args` (plain
    values, sent typed)."""

    expect: Expect
    expr: str | None = None
    call: str | None = None
    args: tuple = ()

    def __post_init__(self):
        if (self.expr is None) == (self.call is None):
            raise ValueError("a Check has exactly one of expr and call")


@dataclasses.dataclass(frozen=True)
class CheckGroup:
    """A test: `checks` pass together. `source` (the candidate's code, executed first, e.g. a
    function definition) and `setup` (e.g. ``from pkg.mod import f``) define the names the checks
    use; either may be empty. `name` identifies the test in results and logs."""

    name: str
    checks: tuple[Check, ...]
    setup: str = ""
    source: str | None = None
    filename: str = "<candidate>"


@dataclasses.dataclass(frozen=True)
class Claim:
    """What the child reported for one check: a returned `value` (decoded: plain data, or
    `verdict_child.Opaque` for a type the protocol does not carry), or the qualified class names
    of what it raised (`raised`, most derived first, with its `message`; `setup_error`: raised by
    the group's setup or source, not by the check), or `unencodable` (`message`: why)."""

    value: Any = None
    raised: tuple[str, ...] = ()
    message: str = ""
    unencodable: bool = False
    setup_error: bool = False


def claim_of(event: dict) -> Claim:
    """The `Claim` of one check's report event (ValueError if malformed)."""
    if "value" in event:
        return Claim(value=child.decode(event["value"]))
    for key in ("raised", "setup_error"):
        if key in event:
            info = event[key]
            types = info.get("types") if isinstance(info, dict) else None
            if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
                raise ValueError(f"malformed {key} event")
            return Claim(raised=tuple(types) or ("?",), message=str(info.get("message", ""))[:300],
                         setup_error=key == "setup_error")
    if "unencodable" in event:
        return Claim(unencodable=True, message=str(event["unencodable"])[:300])
    raise ValueError("malformed check event")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The trusted side's reading of one run of the child.

    status: one of `STATUSES` ("infra": the child never reported ready, or the executor failed:
    mask, do not score). passed: per group, every check passed (always False unless status is
    "ok"). check_passed: per check, flattened in group order. flags: sorted names from `FLAGS`.
    details: a short human-readable account (status, first failures, tail of stderr).
    claims: per check, what the child claimed for an `Expect.claim` check (None for the other
    kinds, and for a check with no single well-formed claim): a `Claim`.
    """

    status: str
    passed: tuple[bool, ...]
    check_passed: tuple[bool, ...]
    flags: tuple[str, ...]
    details: str
    returncode: int | None = None
    claims: tuple[Claim | None, ...] = ()

    @property
    def num_passed(self) -> int:
        return sum(self.passed)

    @property
    def pass_fraction(self) -> float:
        return self.num_passed / len(self.passed) if self.passed else 0.0

    @property
    def valid(self) -> bool:
        return self.status != "infra"


# ----------------------------------------------------------------------------------------------
# Comparison.

def same(expected: Any, actual: Any, float_tol: float = FLOAT_TOL) -> bool:
    """`actual` has the exact type of `expected` and equals it, recursively; an expected float
    is matched by an int or a float within `float_tol`."""
    t = type(expected)
    if t is float:
        return type(actual) in (int, float) and abs(actual - expected) < float_tol
    if type(actual) is not t:
        return False
    if t in (list, tuple):
        return len(actual) == len(expected) and all(same(e, a, float_tol) for e, a in zip(expected, actual))
    if t is dict:
        return len(actual) == len(expected) and all(
            any(same(k, ak, float_tol) and same(v, av, float_tol) for ak, av in actual.items())
            for k, v in expected.items())
    if t in (set, frozenset):
        return len(actual) == len(expected) and all(any(same(e, a, float_tol) for a in actual) for e in expected)
    if t in (int, str, bytes, bool, type(None)):
        return expected == actual
    return False


def _type_name(value: Any) -> str:
    if isinstance(value, child.Opaque):
        return value.type_name
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def judge(expect: Expect, event: dict) -> tuple[bool, str]:
    """(passed, what was claimed) for one check's report event (raises ValueError if the event
    is malformed)."""
    return judge_claim(expect, claim_of(event))


def judge_claim(expect: Expect, claim: Claim) -> tuple[bool, str]:
    """(passed, what was claimed) for one check's `Claim`."""
    if claim.unencodable:
        return False, f"unencodable value ({claim.message[:80]})"
    if claim.raised:
        key = "setup error" if claim.setup_error else "raised"
        got = f"{key} {claim.raised[0]}: {claim.message[:120]}"
        if claim.setup_error:
            return False, got
        return expect.kind == "claim" or (expect.kind == "raises" and bool(set(claim.raised) & set(expect.names))), got
    value = claim.value
    got = f"{_type_name(value)} {value!r}"[:200]
    if expect.kind == "equal":
        return same(expect.value, value, expect.float_tol), got
    if expect.kind == "type":
        return _type_name(value) == expect.names[0], got
    return expect.kind == "claim", got


# ----------------------------------------------------------------------------------------------
# The request and the report.

def request_payload(groups: Sequence[CheckGroup], nonce: str, *, cwd_on_path: bool = False,
                    watch: Sequence[str] = ()) -> bytes:
    """The child's standard input: the groups' sources, setups and checks, never an expectation.
    `watch`: paths relative to the child's working directory whose use is reported (see
    `FLAGS`)."""
    out, i = [], 0
    for g in groups:
        checks = []
        for c in g.checks:
            if c.expr is not None:
                checks.append({"i": i, "expr": c.expr})
            else:
                checks.append({"i": i, "call": c.call, "args": [child.encode(a) for a in c.args]})
            i += 1
        out.append({"name": g.name, "source": g.source, "filename": g.filename, "setup": g.setup, "checks": checks})
    return json.dumps({"nonce": nonce, "cwd_on_path": cwd_on_path, "watch": list(watch), "groups": out}).encode()


def new_nonce() -> str:
    return secrets.token_hex(16)


def child_argv(python: str = sys.executable) -> list[str]:
    """``python -I -B -c <child>``: no environment variables, user site or working directory on
    the import path at start (the child appends the working directory last when asked), no
    bytecode written into the candidate's copy."""
    return [python, "-I", "-B", "-c", CHILD_SOURCE]


def text_of(data: Any) -> str:
    """An executor's output (bytes, str or None) as text, undecodable bytes replaced."""
    if data is None:
        return ""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data).decode("utf-8", errors="replace")
    return str(data)


def interpret(groups: Sequence[CheckGroup], result: Any, nonce: str) -> Verdict:
    """The `Verdict` of one executor result (``stdout``, ``stderr``, ``status``, ``returncode``)
    of the child run on `request_payload(groups, nonce)`."""
    expects = [c.expect for g in groups for c in g.checks]
    n = len(expects)
    status_in = getattr(result, "status", "infra")
    rc = getattr(result, "returncode", None)
    prefix = nonce + " "
    ready = done = None
    events: dict[int, list[dict]] = {}
    forged: list[str] = []
    watched: list[str] = []
    raised_flags: set[str] = set()
    for line in text_of(getattr(result, "stdout", b"")).splitlines():
        if not line.strip():
            continue
        if not line.startswith(prefix):
            forged.append("a line without the run's nonce")
            continue
        try:
            event = json.loads(line[len(prefix):])
        except ValueError:
            forged.append("a garbled line")
            continue
        if not isinstance(event, dict):
            forged.append("a garbled line")
        elif "ready" in event:
            forged += ["a second ready"] if ready is not None else []
            ready = event["ready"] if ready is None else ready
        elif "done" in event:
            forged += ["a second done"] if done is not None else []
            done = event["done"] if done is None else done
        elif "watched" in event:
            watched.append(f"{event.get('watched')} {str(event.get('path'))[:200]}")
        elif type(event.get("i")) is int and 0 <= event["i"] < n:
            events.setdefault(event["i"], []).append(event)
            for key in ("raised", "setup_error"):
                info = event.get(key)
                types = info.get("types", ()) if isinstance(info, dict) else ()
                raised_flags.update(RAISE_FLAGS[t] for t in types if isinstance(t, str) and t in RAISE_FLAGS)
        else:
            forged.append("an event for no check")
    flags: set[str] = set()
    notes = [f"executor status {status_in}, return code {rc}"]
    if status_in == "infra" or ready != n:
        status = "infra"
        notes.append("infrastructure failure: " + (text_of(getattr(result, "info", "")) or "the checker did not start"))
    elif status_in == "timeout":
        status = "timeout"
    elif status_in in ("memory", "output_limit") or done != n or rc != 0:
        status = "crash"
        if rc == 0:
            flags.add("early_exit")
    else:
        status = "ok"
    if status in ("timeout", "crash"):
        flags.add(status)
    check_passed = []
    claims: list[Claim | None] = []
    failures = []
    for i, expect in enumerate(expects):
        got = events.get(i, [])
        if len(got) > 1:
            forged.append(f"{len(got)} claims for check {i}")
        ok, what, claim = False, "no result", None
        if len(got) == 1:
            try:
                parsed = claim_of(got[0])
                ok, what = judge_claim(expect, parsed)
                claim = parsed if expect.kind == "claim" else None
            except ValueError as e:
                forged.append(f"check {i}: {e}")
                what = "malformed result"
        claims.append(claim)
        ok = ok and status == "ok" and len(got) == 1
        check_passed.append(ok)
        if not ok and len(failures) < 5:
            failures.append(f"check {i}: got {what}")
    if forged:
        flags.add("forged_report")
        notes.append("report channel: " + "; ".join(dict.fromkeys(forged[:20])))
    stderr = text_of(getattr(result, "stderr", b""))
    if watched:
        flags.add("read_heldout")
        notes.append("watched paths touched: " + "; ".join(dict.fromkeys(watched[:10])))
    if _PASSED_WORD.search(stderr):
        flags.add("fake_output")
    flags |= raised_flags
    passed, k = [], 0
    for g in groups:
        passed.append(status == "ok" and all(check_passed[k:k + len(g.checks)]))
        k += len(g.checks)
    notes += failures
    details = "\n".join(notes) + ("\n" + stderr[-2000:] if stderr else "")
    return Verdict(status=status, passed=tuple(passed), check_passed=tuple(check_passed),
                   flags=tuple(sorted(flags)), details=details, returncode=rc, claims=tuple(claims))


@dataclasses.dataclass
class InfraResult:
    """An executor result standing for the executor's own failure (it raised)."""

    info: str
    stdout: bytes = b""
    stderr: bytes = b""
    returncode: int | None = None
    status: str = "infra"


def run_checks(executor: Any, groups: Sequence[CheckGroup], *, timeout: float, workdir: str | os.PathLike | None = None,
               python: str = sys.executable, cwd_on_path: bool = False, inprocess: bool = False,
               watch: Sequence[str] = ()) -> Verdict:
    """Run the child on `groups` through `executor` and judge its report.

    executor: anything with ``run(argv, stdin=, timeout=, workdir=)`` (e.g. a
      `rlcode.sandbox.SandboxPool`, or a `rlcode.envs.tools.Executor`); with `inprocess`, a pool's
      ``run_python(code, inprocess=True, stdin=, timeout=, workdir=)`` instead (the child runs in
      the isolated fork of a warm worker: no interpreter start-up).
    cwd_on_path: the child appends its working directory (the candidate's copy) to the end of
      ``sys.path``. watch: paths (relative to the working directory) whose use is flagged.
      Never raises for anything the candidate did; an executor that raises gives an "infra"
      verdict.
    """
    nonce = new_nonce()
    payload = request_payload(groups, nonce, cwd_on_path=cwd_on_path, watch=watch)
    where = None if workdir is None else os.fspath(workdir)
    try:
        if inprocess:
            result = executor.run_python(CHILD_SOURCE, inprocess=True, stdin=payload, timeout=timeout, workdir=where)
        else:
            result = executor.run(child_argv(python), stdin=payload, timeout=timeout, workdir=where)
    except Exception as e:  # the executor's own failure, whatever its type
        result = InfraResult(f"the executor raised {type(e).__name__}: {e}")
    return interpret(groups, result, nonce)
