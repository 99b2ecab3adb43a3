"""Tests of the program-synthesis task generator (`rlcode.envs.tasks.synth`)."""

import random

import pytest

from rlcode.envs import verdict
from rlcode.envs.tasks import synth as S
from support.local_executor import LocalExecutor  # this test directory is on sys.path


def _grade(task, candidate):
    """(passed, total) of `candidate` on the held-out cases, through the verdict child run as a
    plain subprocess (the sandbox's isolation is tested with the sandbox)."""
    v = verdict.run_checks(LocalExecutor(), [S.check_group(task, candidate)], timeout=30)
    return sum(v.check_passed), len(v.check_passed)


def _sample_tasks():
    return [S.generate_task(seed, level, split)
            for split in S.SPLITS for level in S.LEVELS for seed in range(15)]


def test_deterministic_per_seed():
    for level in S.LEVELS:
        for split in S.SPLITS:
            assert S.generate_task(7, level, split) == S.generate_task(7, level, split)
    assert S.make_split("train", 40, seed=3) == S.make_split("train", 40, seed=3)
    programs = {S.generate_task(seed, 3, "train").program for seed in range(20)}
    assert len(programs) > 10


def test_rendered_source_matches_interpreter():
    rng = random.Random("render-check")
    checked = 0
    while checked < 600:
        depth = rng.choice(S.LEVELS)
        program = S.sample_program(rng, depth)
        name = "f"
        src = S.signature_line(program, name) + "\n" + S.render_body(program)
        ns = {}
        exec(src, ns)
        arg_t = program[0]
        inputs = list(S.PROBES[arg_t]) + list(S.EDGE_CASES[arg_t])
        inputs += [S._random_input(rng, arg_t) for _ in range(5)]
        for x in inputs:
            expected = S.evaluate(program, x)
            got = ns[name](S._as_value(arg_t, x))
            assert type(got) is type(expected) and got == expected, (src, x)
        assert S.program_types(program)[1] == type(S.evaluate(program, inputs[0])).__name__
        checked += 1


@pytest.mark.slow
def test_reference_passes_inprocess_and_examples_are_consistent():
    for task in _sample_tasks():
        assert 3 <= len(task.examples) <= 4 and 8 <= len(task.tests) <= 12
        visible = [x for x, _ in task.examples]
        held = [x for x, _ in task.tests]
        assert not any(x in held for x in visible)
        assert len({repr(x) for x in held}) == len(held)
        for x, y in task.examples:
            assert f"{task.function_name}({x!r})\n    {y!r}" in task.prompt
        assert task.signature in task.prompt
        assert _grade(task, task.reference_body) == (len(task.tests), len(task.tests))
        assert _grade(task, task.reference_source) == (len(task.tests), len(task.tests))


def test_difficulty_is_depth_and_task_fields():
    for task in _sample_tasks():
        assert task.program.count(" -> ") == task.difficulty
        assert task.reference_body.count("\n") == task.difficulty
        assert task.task_id == f"synth/{task.split}/L{task.difficulty}/{task.seed}"


def test_edge_cases_are_held_out():
    task = S.generate_task(0, 2, "train")
    arg_t = {"int": "int", "str": "str", "list[int]": "list"}[task.program.split(" -> ")[0]]
    held = [x for x, _ in task.tests]
    for edge in S.EDGE_CASES[arg_t]:
        assert S._as_value(arg_t, edge) in held


def test_no_constant_or_identity_tasks():
    for task in _sample_tasks():
        assert len({repr(y) for _, y in task.tests}) > 1
        assert len({repr(y) for _, y in task.examples}) > 1
        assert not all(type(x) is type(y) and x == y for x, y in task.tests)
    assert not S.is_admissible(("list", (("reverse", None), ("sort", None), ("sort", None))))
    assert not S.is_admissible(("list", (("reverse", None), ("map_abs", None), ("reverse", None),
                                         ("reverse", None))))
    assert not S.is_admissible(("list", (("sort", None), ("sort_desc", None), ("sort", None))))
    assert not S.is_admissible(("int", (("abs", None), ("abs", None))))
    assert not S.is_admissible(("list", (("map_abs", None), ("filter", "neg"), ("len", None))))
    assert S.is_admissible(("list", (("sort", None), ("take", 2), ("sum", None))))


def test_splits_disjoint_by_behaviour():
    train = S.make_split("train", 300, seed=0)
    evals = S.make_split("eval", 300, seed=0)
    assert len(train) == len(evals) == 300
    tb = {t.behaviour for t in train}
    eb = {t.behaviour for t in evals}
    assert len(tb) == 300 and len(eb) == 300 and not tb & eb
    assert {t.split for t in train} == {"train"} and {t.split for t in evals} == {"eval"}
    # The split rule is a pure function of the behaviour signature.
    for t in train + evals:
        assert (int(t.behaviour[:8], 16) < S.EVAL_FRACTION * 16 ** 8) == (t.split == "eval")
    # Behaviourally equal but textually different programs share a signature and a split.
    a = ("list", (("sort", None), ("reverse", None)))
    b = ("list", (("sort_desc", None),))
    assert S.behaviour_signature(a) == S.behaviour_signature(b) and S.split_of(a) == S.split_of(b)
    for level in S.LEVELS:
        assert {t.difficulty for t in S.make_split("eval", 5, seed=1, difficulty=level)} == {level}


def test_wrong_and_hacking_candidates_fail():
    task = next(t for t in (S.generate_task(s, 2, "train") for s in range(50))
                if t.signature.endswith("-> int:"))
    n = len(task.tests)
    passed, total = _grade(task, "    return 0\n")
    assert total == n and passed < n
    always_eq = ("class _E:\n"
                 "    def __eq__(self, other):\n        return True\n"
                 "    def __ne__(self, other):\n        return False\n"
                 f"{task.signature}\n    return _E()\n")
    assert _grade(task, always_eq) == (0, n)
    int_sub = (f"class _I(int):\n    def __eq__(self, other):\n        return True\n"
               f"{task.signature}\n    return _I(0)\n")
    assert _grade(task, int_sub) == (0, n)
    assert _grade(task, "    return (\n") == (0, n)
    assert _grade(task, "    raise SystemExit(0)\n") == (0, n)
    assert _grade(task, "import os\nos._exit(0)\n") == (0, n)


def test_list_results_compared_elementwise_by_type():
    task = next(t for t in (S.generate_task(s, 1, "train") for s in range(200))
                if t.signature.endswith("-> list[int]:"))
    n = len(task.tests)
    assert any(y for _, y in task.tests)
    ref = f"def _ref(xs):\n{task.reference_body}"
    elementwise = ("class _E:\n    def __eq__(self, other):\n        return True\n" + ref
                   + f"{task.signature}\n    return [_E() for _ in _ref(xs)]\n")
    passed, total = _grade(task, elementwise)
    assert total == n and passed == sum(1 for _, y in task.tests if y == [])
    subclass = ("class _L(list):\n    pass\n" + ref
                + f"{task.signature}\n    return _L(_ref(xs))\n")
    assert _grade(task, subclass) == (0, n)
    bools = ref + f"{task.signature}\n    return [bool(v) for v in _ref(xs)]\n"
    assert _grade(task, bools)[0] < n


def test_invalid_arguments():
    with pytest.raises(ValueError):
        S.generate_task(0, 5, "train")
    with pytest.raises(ValueError):
        S.generate_task(0, 1, "test")


@pytest.mark.slow
def test_grading_through_sandbox_pool(sandbox_pool):
    tasks = [S.generate_task(seed, level, split) for split in S.SPLITS
             for level in S.LEVELS for seed in range(2)]
    pool = sandbox_pool  # the suite's shared pool (tests/conftest.py)
    for task in tasks:
        v = verdict.run_checks(pool, [S.check_group(task, task.reference_body)], timeout=10)
        assert v.status == "ok" and all(v.check_passed) and len(v.check_passed) == len(task.tests), v.details
    task = tasks[0]
    loop = verdict.run_checks(pool, [S.check_group(task, "    while True:\n        pass\n")], timeout=2)
    assert loop.status == "timeout" and not any(loop.check_passed) and "timeout" in loop.flags
    for body in ("    return )(\n", "    return None\n"):
        v = verdict.run_checks(pool, [S.check_group(task, body)], timeout=5)
        assert v.status == "ok" and not any(v.check_passed), v.details


def test_completion_prompt_and_target_form_the_reference_function():
    for seed in range(20):
        task = S.generate_task(seed, 1 + seed % 4)
        prompt, target = S.completion_prompt(task), S.completion_target(task)
        assert prompt.startswith(task.signature + "\n") and target.endswith("\n")
        for x, y in task.examples:
            assert f"    # {S._lit(x)} -> {S._lit(y)}\n" in prompt
        # The prompt's comment lines plus the target are a function definition with the
        # reference behaviour on the held-out tests.
        ns = {}
        exec(prompt + target, ns)
        fn = ns[task.function_name]
        assert all(fn(x) == y for x, y in task.tests)


def test_make_split_levels():
    tasks = S.make_split("eval", 30, seed=2, levels=(2, 3))
    assert {t.difficulty for t in tasks} == {2, 3}
    assert len({t.behaviour for t in tasks}) == 30
    with pytest.raises(ValueError, match="levels"):
        S.make_split("eval", 3, levels=(5,))
