"""rlcode.envs.verdict: the typed codec, the comparison, the reading of the child's report, and
attacks on the verdict by a candidate that shares the child's process.

The attacks (`rlcode.envs.hacks.VERDICT_ATTACKS`) are the ones that earned full reward from a
grader that ran its comparison in the candidate's interpreter (reading the expected values
through ``import __main__``, frames, ``gc`` or raw memory; rebinding the comparison; forging
result lines from ``atexit``, a late thread or before an early ``os._exit``). Here the expected
values are random strings that no honest function computes, so a passed check can only come from
reading them; every attack scores 0, through a plain subprocess and through the sandbox pool in
both of its modes.
"""

from __future__ import annotations

import json
import math
import random
import uuid

import pytest

from rlcode.envs import hacks, verdict
from rlcode.envs.tasks import repo as repo_tasks
from rlcode.envs import verdict_child as child
from support.local_executor import LocalExecutor, Result  # this test directory is on sys.path

# ---------------------------------------------------------------------------------------------
# The codec.


def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["none", "bool", "int", "bigint", "float", "str", "bytes"]
    if depth < 3:
        kinds += ["list", "tuple", "dict", "set", "frozenset"]
    kind = rng.choice(kinds)
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "bigint":
        return rng.choice((-1, 1)) * 7 ** rng.randint(30, 300)
    if kind == "float":
        return rng.choice((rng.uniform(-1e6, 1e6), 0.1, -0.0, 1e-310, float("inf"), float("-inf"), 5e300))
    if kind == "str":
        return "".join(rng.choice("ab \n\"\\é\u2028\x00😀") for _ in range(rng.randint(0, 8)))
    if kind == "bytes":
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 6)))
    items = [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "list":
        return items
    if kind == "tuple":
        return tuple(items)
    hashable = [rng.choice((rng.randint(-50, 50), "k%d" % rng.randint(0, 50), (1, "x"))) for _ in items]
    if kind == "dict":
        return {k: v for k, v in zip(hashable, items)}
    return set(hashable) if kind == "set" else frozenset(hashable)


def _identical(a, b) -> bool:
    """Equal with exactly the same types everywhere (floats bit-for-bit, -0.0 included)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return math.copysign(1, a) == math.copysign(1, b) and (a == b or (math.isnan(a) and math.isnan(b)))
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    return a == b


def test_codec_round_trips_exact_types():
    rng = random.Random(0)
    for _ in range(2000):
        value = _random_value(rng)
        wire = json.loads(json.dumps(child.encode(value)))
        assert _identical(child.decode(wire), value), value
    nan = child.decode(child.encode(float("nan")))
    assert type(nan) is float and math.isnan(nan)


def test_codec_never_carries_behaviour():
    class AlwaysEqual:
        def __eq__(self, other):
            return True

    class Int(int):
        def __eq__(self, other):
            return True

    class Str(str):
        pass

    for value in (AlwaysEqual(), Int(3), Str("x"), [Int(1)], {"k": AlwaysEqual()}, len, object):
        decoded = child.decode(json.loads(json.dumps(child.encode(value))))
        for expected in (3, "x", [1], {"k": 1}, None):
            assert not verdict.same(expected, decoded)
    assert child.encode(Int(3)) == ["object", f"{__name__}.test_codec_never_carries_behaviour.<locals>.Int"]
    assert child.encode(True) == ["bool", True] and child.encode(1) == ["int", "1"]


@pytest.mark.parametrize("bad", [
    [], ["nope"], ["none", 1], ["bool", 1], ["int", 1], ["int", "1_000"], ["int", "١٢"], ["int", " 1"],
    ["int", ""], ["int", "9" * 5000], ["float", 1.5], ["float", "1.5.5"], ["str", 3], ["bytes", "zz"],
    ["list", "abc"], ["list", [["int", "1"], "x"]], ["tuple", [], []], ["dict", [["str", "a"]]],
    ["dict", [[["list", []], ["none"]]]], ["set", [["list", []]]], ["object", 3], "str", None, {"t": 1},
])
def test_decode_is_strict(bad):
    with pytest.raises(ValueError):
        child.decode(bad)


def test_decode_bounds_depth_and_size():
    deep = ["none"]
    for _ in range(child.MAX_DEPTH + 2):
        deep = ["list", [deep]]
    with pytest.raises(ValueError):
        child.decode(deep)
    with pytest.raises(ValueError):
        child.decode(["list", [["none"]] * (child.MAX_NODES + 1)])
    nested: list = []
    for _ in range(child.MAX_DEPTH + 2):
        nested = [nested]
    with pytest.raises(child.Unencodable):
        child.encode(nested)
    with pytest.raises(child.Unencodable):
        child.encode("x" * (child.MAX_CHARS + 1))


# ---------------------------------------------------------------------------------------------
# The comparison: the same rule as the generated tests' `same` helper (its independent oracle).

def _tests_same():
    scope: dict = {}
    exec(repo_tasks._SAME, scope)
    return scope["same"]


def test_same_agrees_with_the_generated_tests_helper():
    oracle = _tests_same()
    rng = random.Random(1)
    atoms = [0, 1, -1, 2, True, False, 0.0, 1.0, 1.0 + 1e-12, 1.0 + 1e-6, 2.5, "1", "", None, (), []]
    pool = atoms + [[1, 2], [1, 2.0], (1, 2), [True, 2], (1.0,), [[1], [2]], [[1], [2.0]]]
    for _ in range(3000):
        expected, actual = rng.choice(pool), rng.choice(pool)
        if type(expected) is type(None) or type(actual) is type(None):
            continue
        assert verdict.same(expected, actual) == oracle(actual, expected), (expected, actual)


def test_judge_raises_and_types():
    raised = {"raised": {"types": ["mod.MyError", "builtins.ValueError", "builtins.Exception"], "message": "m"}}
    assert verdict.judge(verdict.Expect.raises("ValueError"), raised)[0]
    assert not verdict.judge(verdict.Expect.raises("KeyError"), raised)[0]
    assert not verdict.judge(verdict.Expect.equal(1), raised)[0]
    setup = {"setup_error": {"types": ["builtins.ValueError"], "message": ""}}
    assert not verdict.judge(verdict.Expect.raises("ValueError"), setup)[0]  # not raised by the check
    value = {"value": ["int", "3"]}
    assert verdict.judge(verdict.Expect.type("int"), value)[0]
    assert not verdict.judge(verdict.Expect.type("bool"), value)[0]
    assert not verdict.judge(verdict.Expect.type("int"), {"value": ["object", "m.Int"]})[0]
    assert not verdict.judge(verdict.Expect.raises("ValueError"), value)[0]
    with pytest.raises(ValueError):
        verdict.judge(verdict.Expect.equal(1), {"value": ["int", "x"]})


# ---------------------------------------------------------------------------------------------
# Reading the report.

GROUPS = [verdict.CheckGroup("g0", (verdict.Check(expr="f(1)", expect=verdict.Expect.equal(1)),
                                    verdict.Check(expr="f(2)", expect=verdict.Expect.equal(4)))),
          verdict.CheckGroup("g1", (verdict.Check(expr="f(3)", expect=verdict.Expect.equal(9)),))]
NONCE = "n" * 32


def _report(*events, nonce=NONCE, extra=""):
    return "".join(f"{nonce} {json.dumps(e)}\n" for e in events) + extra


def _claims(values):
    return [{"i": i, "value": child.encode(v)} for i, v in enumerate(values)]


def test_interpret_scores_only_claims_of_a_complete_run():
    good = _report({"ready": 3}, *_claims([1, 4, 9]), {"done": 3})
    v = verdict.interpret(GROUPS, Result(good, "", 0, "ok"), NONCE)
    assert v.status == "ok" and v.passed == (True, True) and v.flags == () and v.pass_fraction == 1.0
    half = _report({"ready": 3}, *_claims([1, 5, 9]), {"done": 3})
    v = verdict.interpret(GROUPS, Result(half, "", 0, "ok"), NONCE)
    assert v.passed == (False, True) and v.check_passed == (True, False, True)
    # Incomplete: ended 0 before "done" (early exit), or nonzero.
    for rc, status, flags in ((0, "ok", ("crash", "early_exit")), (1, "error", ("crash",))):
        v = verdict.interpret(GROUPS, Result(_report({"ready": 3}, *_claims([1, 4, 9])), "", rc, status), NONCE)
        assert v.status == "crash" and v.passed == (False, False) and v.flags == flags
    v = verdict.interpret(GROUPS, Result(good, "", None, "timeout"), NONCE)
    assert v.status == "timeout" and v.passed == (False, False) and v.flags == ("timeout",)
    for status in ("memory", "output_limit"):
        assert verdict.interpret(GROUPS, Result(good, "", -9, status), NONCE).status == "crash"
    # No "ready": nothing of the candidate ran; an executor failure: both are masked.
    assert verdict.interpret(GROUPS, Result("", "", 1, "error"), NONCE).status == "infra"
    assert verdict.interpret(GROUPS, Result(good, "", None, "infra"), NONCE).status == "infra"
    assert verdict.interpret(GROUPS, Result(_report({"ready": 2}), "", 0, "ok"), NONCE).status == "infra"


@pytest.mark.parametrize("forgery", [
    _report({"i": 1, "value": ["int", "4"]}),                 # a second claim for check 1
    _report({"i": 7, "value": ["int", "4"]}),                 # a claim for no check
    _report({"ready": 3}), _report({"done": 3}),              # a second ready / done
    "garbage\n", _report({"i": 1, "value": ["int", "4"]}, nonce="0" * 32),  # no nonce
    NONCE + " {not json\n", _report({"i": 1, "value": ["int", "x"]}),
])
def test_interpret_flags_forged_lines_and_fails_conflicting_claims(forgery):
    text = _report({"ready": 3}, *_claims([1, 4, 9]), {"done": 3}) + forgery
    v = verdict.interpret(GROUPS, Result(text, "", 0, "ok"), NONCE)
    assert "forged_report" in v.flags
    if '"i": 1,' in forgery and forgery.startswith(NONCE):
        assert v.check_passed[1] is False  # two claims for one check: neither counts
    assert v.check_passed[0] and v.check_passed[2]


def test_run_checks_masks_an_executor_that_raises():
    class Raising:
        def run(self, *a, **k):
            raise RuntimeError("boom")

    v = verdict.run_checks(Raising(), GROUPS, timeout=5)
    assert v.status == "infra" and "boom" in v.details


# ---------------------------------------------------------------------------------------------
# Attacks from inside the child's process.

SECRET = "SECRET-"


def _secret_groups(n: int = 4, attack: str = "") -> tuple[list[verdict.CheckGroup], list[str]]:
    """One group: the candidate `attack` defines f; f(i) is expected to be a fresh random string
    that no function computes. The args carry a marker of their own (ARG-...)."""
    secrets = [SECRET + uuid.uuid4().hex for _ in range(n)]
    checks = tuple(verdict.Check(call="f", args=(f"ARG-{uuid.uuid4().hex}",), expect=verdict.Expect.equal(s))
                   for s in secrets)
    return [verdict.CheckGroup("secret", checks, source=attack)], secrets


# `sandbox_pool`: the suite's shared pool (tests/conftest.py).


@pytest.fixture(params=["subprocess", "pool_exec", "pool_inprocess"])
def run(request):
    if request.param == "subprocess":
        return lambda groups: verdict.run_checks(LocalExecutor(), groups, timeout=30)
    pool = request.getfixturevalue("sandbox_pool")
    inprocess = request.param == "pool_inprocess"
    return lambda groups: verdict.run_checks(pool, groups, timeout=20, inprocess=inprocess)


@pytest.mark.parametrize("attack", sorted(hacks.VERDICT_ATTACKS))
def test_attacks_from_the_candidates_process_score_zero(attack, run):
    """The catalogue's attacks (each beat the grader that compared in the candidate's process)."""
    groups, secrets = _secret_groups(attack=hacks.VERDICT_ATTACKS[attack][2])
    v = run(groups)
    assert v.status != "infra", v.details
    assert v.passed == (False,) and not any(v.check_passed), v.details
    assert not any(s in v.details for s in secrets)


def test_the_searches_find_what_the_process_holds(run):
    """Controls: the memory scan and the stack walk do find an (argument, expected) pair that is
    in the child's process, here one the candidate made itself."""
    bait = "\n_f = f\ndef f(x):\n    pair = (x, 'BAIT')\n    text = '(' + repr(x) + ', \"BAIT\")'\n    return _f(x)\n"
    for name in ("memory_scan", "frame_walk"):
        groups, _ = _secret_groups(attack=hacks.VERDICT_ATTACKS[name][2] + bait)
        v = run(groups)
        assert v.status == "ok" and "str 'BAIT'" in v.details, (name, v.details)


def test_an_honest_candidate_passes_and_output_does_not_matter(run):
    source = ("import sys, os\nprint('all good')\nsys.stdout.flush()\n"
              "def f(x):\n    print('noise', x)\n    return x[::-1]\n")
    checks = tuple(verdict.Check(call="f", args=(a,), expect=verdict.Expect.equal(a[::-1])) for a in ("abc", "xy"))
    v = run([verdict.CheckGroup("honest", checks, source=source)])
    assert v.status == "ok" and v.passed == (True,) and v.flags == (), v.details
    # Printing PASSED cannot change a verdict; it is flagged as the attempt it is.
    v = run([verdict.CheckGroup("honest", checks, source="print('PASSED everything')\n" + source)])
    assert v.passed == (True,) and v.flags == ("fake_output",), v.details


def test_behaviour_flags(run):
    checks = (verdict.Check(call="f", args=(1,), expect=verdict.Expect.equal(1)),)
    for body, flag in (("raise SystemExit(0)", "early_exit"), ("import pytest; pytest.skip('x')", "skipped"),
                       ("import pytest; pytest.xfail('x')", "skipped"),
                       ("import glob; glob.glob('hidden/*.py'); return x", "read_heldout"),
                       ("open('hidden/t.py') if False else None; return x", None)):
        source = f"def f(x):\n    {body}\n"
        v = verdict.run_checks(LocalExecutor(), [verdict.CheckGroup("b", checks, source=source)], timeout=30,
                               watch=["hidden"])
        assert v.flags == ((flag,) if flag else ()), (body, v.flags, v.details)
        assert v.passed == ((flag == "read_heldout" or flag is None),)


def test_early_exit_and_exceptions(run):
    checks = (verdict.Check(call="f", args=(1,), expect=verdict.Expect.equal(2)),
              verdict.Check(call="f", args=(0,), expect=verdict.Expect.raises("ZeroDivisionError")),
              verdict.Check(call="g", args=(), expect=verdict.Expect.equal(None)))
    source = "import sys\ndef f(x):\n    return 2 // x\ndef g():\n    sys.exit(0)\n"
    v = run([verdict.CheckGroup("exc", checks, source=source)])
    assert v.status == "ok" and v.check_passed == (True, True, False), v.details  # SystemExit is a raise
    exiting = "import os\ndef f(x):\n    os._exit(0)\n"
    v = run([verdict.CheckGroup("exit", checks[:1], source=exiting)])
    assert v.status == "crash" and v.flags == ("crash", "early_exit") and not any(v.check_passed)
    broken = "def f(x) return\n"
    v = run([verdict.CheckGroup("syntax", checks, source=broken),
             verdict.CheckGroup("fine", checks[:1], source="def f(x):\n    return 2\n")])
    assert v.status == "ok" and v.passed == (False, True), v.details
