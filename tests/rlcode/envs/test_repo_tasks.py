"""rlcode.envs.tasks.repo: determinism, disjoint splits, the reference solutions against the
held-out tests (pytest in a subprocess), the starting copies failing them, and materialised
copies without held-out tests."""

import concurrent.futures
import hashlib
import json
import os
import subprocess
import sys

import pytest

from rlcode import tokenizer as tk
from rlcode.envs.tasks import repo as rt

FAMILY_SEEDS = [(name, seed) for seed, name in enumerate(rt.FAMILIES)]
VARIED = [name for name, fam in rt.FAMILIES.items() if fam.varied]


def fingerprint(task):
    blob = json.dumps([task.files, task.heldout_tests, task.solution_files, task.instruction], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def pytest_run(directory, paths):
    # Installed plugins are not loaded, as the grader's runner does not load them (each would cost
    # every one of these runs its import).
    proc = subprocess.run([sys.executable, "-B", "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *paths],
                          cwd=directory, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    return proc.returncode, proc.stdout + proc.stderr


def count_tests(files):
    return sum(text.count("\ndef test_") for text in files.values())


@pytest.fixture(scope="module")
def grading(tmp_path_factory):
    """For one task per family, pytest on held-out + visible tests in the solved copy and in the
    starting copy (each a separate materialised directory, held-out tests added for grading)."""
    root = tmp_path_factory.mktemp("grading")
    jobs = {}
    cases = [(name, name, seed, "standard") for name, seed in FAMILY_SEEDS]
    cases += [(f"{name}/varied", name, seed, "varied") for name in VARIED for seed in (0, 1)]
    for key, name, seed, bugs in cases:
        task = rt.generate_task(seed, family=name, split=rt.FAMILIES[name].split, bugs=bugs)
        runs = []
        for solved in (True, False):
            directory = rt.materialize(task, root, solved=solved)
            runs.append((directory, rt.write_heldout_tests(task, directory) + list(task.visible_test_files)))
        jobs[key] = (task, runs)
    workers = max(1, min(8, len(os.sched_getaffinity(0)) // 2))  # pytest start-up is CPU-bound
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {name: [pool.submit(pytest_run, d, p) for d, p in runs] for name, (_, runs) in jobs.items()}
        return {name: (jobs[name][0], [f.result() for f in fs]) for name, fs in futures.items()}


@pytest.mark.parametrize("family", list(rt.FAMILIES) + [f"{name}/varied" for name in VARIED])
@pytest.mark.slow
def test_solution_passes_heldout_and_start_fails(grading, family):
    task, [(rc_solved, out_solved), (rc_start, out_start)] = grading[family]
    expected = count_tests(task.heldout_tests) + count_tests({p: task.files[p] for p in task.visible_test_files})
    assert rc_solved == 0 and f"{expected} passed" in out_solved, out_solved
    assert rc_start == 1, out_start
    failed = [line.split()[1].split("::")[0] for line in out_start.splitlines() if line.startswith("FAILED ")]
    # The starting copy fails held-out tests and visible tests alike.
    assert set(failed) == set(task.heldout_tests) | set(task.visible_test_files), out_start


@pytest.mark.parametrize("split", rt.SPLITS)
@pytest.mark.parametrize("difficulty", rt.LEVELS)
def test_deterministic_per_seed(split, difficulty):
    a = [rt.generate_task(s, difficulty=difficulty, split=split) for s in range(5)]
    b = [rt.generate_task(s, difficulty=difficulty, split=split) for s in range(5)]
    assert a == b
    assert all(t.difficulty == difficulty and t.split == split for t in a)


def test_deterministic_across_interpreters():
    code = ("import hashlib, json; from rlcode.envs.tasks import repo as rt; "
            "print(hashlib.sha256(json.dumps([[t.files, t.heldout_tests, t.instruction] "
            "for t in rt.make_tasks('train', 12) + rt.make_tasks('eval', 6)], sort_keys=True).encode()).hexdigest())")
    here = hashlib.sha256(json.dumps([[t.files, t.heldout_tests, t.instruction]
                                      for t in rt.make_tasks("train", 12) + rt.make_tasks("eval", 6)],
                                     sort_keys=True).encode()).hexdigest()
    for hash_seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == here


def test_seeds_give_different_tasks():
    for split in rt.SPLITS:
        for level in rt.LEVELS:
            tasks = rt.make_tasks(split, 30, difficulty=level)
            assert len({fingerprint(t) for t in tasks}) >= 25, (split, level)
            assert {t.family for t in tasks} == set(rt.families(split, level)), (split, level)
    mixed = rt.make_tasks("train", 60)
    assert {t.difficulty for t in mixed} == set(rt.LEVELS)


def test_splits_are_disjoint():
    train, evaluation = set(rt.families("train")), set(rt.families("eval"))
    assert train and evaluation and not train & evaluation
    assert train | evaluation == set(rt.FAMILIES)
    for level in rt.LEVELS:
        assert rt.families("train", level) and rt.families("eval", level)
    train_tasks, eval_tasks = rt.make_tasks("train", 150), rt.make_tasks("eval", 150)
    assert {t.family for t in train_tasks} <= train and {t.family for t in eval_tasks} <= evaluation
    assert not {fingerprint(t) for t in train_tasks} & {fingerprint(t) for t in eval_tasks}
    assert not {t.task_id for t in train_tasks} & {t.task_id for t in eval_tasks}
    # The same seed in the two splits gives different tasks.
    assert all(fingerprint(a) != fingerprint(b) for a, b in zip(train_tasks, eval_tasks))


@pytest.mark.parametrize("split", rt.SPLITS)
def test_task_structure(split):
    for task in rt.make_tasks(split, 120):
        fam = rt.FAMILIES[task.family]
        assert task.difficulty == fam.difficulty and task.split == fam.split == split
        assert task.visible_test_files and set(task.visible_test_files) <= set(task.files)
        assert all(p.startswith(rt.TEST_DIR + "/") for p in task.visible_test_files)
        assert task.heldout_tests and all(p.startswith(rt.HELDOUT_DIR + "/") for p in task.heldout_tests)
        assert not any(p.startswith(rt.HELDOUT_DIR) for p in task.files)
        assert not set(task.heldout_tests.values()) & set(task.files.values())
        assert task.solution_files and set(task.solution_files) <= set(task.files)
        assert not set(task.solution_files) & set(task.visible_test_files)
        assert all(task.solution_files[p] != task.files[p] for p in task.solution_files)
        assert {p: t for p, t in rt.apply_edits(task.files, task.edits).items()
                if t != task.files[p]} == task.solution_files
        for text in [*task.files.values(), *task.heldout_tests.values(), *task.solution_files.values()]:
            compile(text, "<task>", "exec")
        assert len({e.path for e in task.edits}) == (2 if task.difficulty == 3 else 1)
        assert set(task.expert_reads) <= set(task.files)
        if task.difficulty >= 2:
            assert len([p for p in task.expert_reads if p not in task.visible_test_files]) >= 2
        for path in task.visible_test_files:
            assert path in task.instruction


def _test_outcomes(task, files):
    """{test name: passed} for the visible and held-out tests of a one-module task, run in this
    process: the module's source and each test module execute in one namespace (the import of
    the package is dropped)."""
    module = next(p for p in task.solution_files)
    out = {}
    for path, text in {**{p: task.files[p] for p in task.visible_test_files}, **task.heldout_tests}.items():
        scope = {}
        exec(compile(files[module], module, "exec"), scope)
        exec(compile("\n".join(line for line in text.splitlines() if not line.startswith("from ")), path, "exec"), scope)
        for name in [n for n in scope if n.startswith("test_")]:
            try:
                scope[name]()
                out[f"{path}::{name}"] = True
            except AssertionError:
                out[f"{path}::{name}"] = False
    return out


@pytest.mark.parametrize("family", VARIED)
@pytest.mark.slow
def test_varied_bugs_are_real_bugs_that_cannot_be_guessed(family):
    # Every varied task of 300 seeds: the starting copy fails the visible test and the named
    # function's held-out test, the fix passes every test, the other functions' tests pass on the
    # starting copy (only one line is broken). And the broken line is spread out: per function,
    # more distinct broken lines than the standard draw plants (2-4 wrong forms) and none of them
    # the bug of much more than a quarter of the tasks.
    tasks = [rt.generate_task(s, family=family, bugs="varied") for s in range(300)]
    assert all(t.task_id == f"train/L1/{family}/{s}/varied" for s, t in enumerate(tasks))
    per_function = {}
    for task in tasks:
        start, fixed = _test_outcomes(task, task.files), _test_outcomes(task, rt.apply_edits(task.files, task.edits))
        assert all(fixed.values()), (task.task_id, fixed)
        failing = {n for n, ok in start.items() if not ok}
        assert any(n.startswith(rt.TEST_DIR + "/") for n in failing), (task.task_id, start)
        assert failing and all("_unchanged" not in n for n in failing), (task.task_id, start)
        (edit,) = task.edits
        function = task.instruction.split("`")[1]
        per_function.setdefault(function, []).append(edit.old)
    standard = [rt.generate_task(s, family=family) for s in range(300)]
    standard_lines = {}
    for task in standard:
        standard_lines.setdefault(task.instruction.split("`")[1], set()).add(task.edits[0].old)
    for function, lines in per_function.items():
        top = max(lines.count(line) for line in lines)
        assert len(set(lines)) > max(3, len(standard_lines[function])), (function, sorted(lines))
        assert top <= 0.25 * len(lines) + 3, (function, sorted(lines))
    assert not {t.task_id for t in standard} & {t.task_id for t in tasks}
    # The family and nothing else of the draw is kept from the standard task of that seed.
    assert [t.family for t in standard] == [t.family for t in tasks]


def test_varied_bugs_keep_the_family_and_leave_other_families_alone():
    for seed in range(40):
        standard = rt.generate_task(seed, difficulty=None)
        varied = rt.generate_task(seed, difficulty=None, bugs="varied")
        assert varied.family == standard.family
        if rt.FAMILIES[standard.family].varied:
            assert varied.task_id == standard.task_id + "/varied" and varied.files != standard.files
        else:
            assert varied == standard


def test_materialize_writes_a_private_copy_without_heldout_tests(tmp_path):
    task = rt.generate_task(3, difficulty=3)
    first, second = rt.materialize(task, tmp_path), rt.materialize(task, tmp_path)
    assert first != second and os.path.dirname(first) == os.path.realpath(tmp_path)
    for directory in (first, second):
        written = {}
        for d, _, names in os.walk(directory):
            for n in names:
                path = os.path.join(d, n)
                written[os.path.relpath(path, directory)] = open(path).read()
        assert written == task.files
        assert not os.path.exists(os.path.join(directory, rt.HELDOUT_DIR))
        assert not set(written.values()) & set(task.heldout_tests.values())
    solved = rt.materialize(task, tmp_path, solved=True)
    for path, text in task.solution_files.items():
        assert open(os.path.join(solved, path)).read() == text
    assert not os.path.exists(os.path.join(solved, rt.HELDOUT_DIR))
    grading = tmp_path / "grading"
    assert rt.write_heldout_tests(task, grading) == sorted(task.heldout_tests)
    assert all((grading / p).read_text() == t for p, t in task.heldout_tests.items())


def test_apply_edits_requires_a_unique_match():
    files = {"a.py": "x = 1\nx = 1\ny = 2\n"}
    assert rt.apply_edits(files, [rt.Edit("a.py", "y = 2", "y = 3")]) == {"a.py": "x = 1\nx = 1\ny = 3\n"}
    with pytest.raises(ValueError, match="matches 2 times"):
        rt.apply_edits(files, [rt.Edit("a.py", "x = 1", "x = 0")])
    with pytest.raises(ValueError, match="matches 0 times"):
        rt.apply_edits(files, [rt.Edit("a.py", "z", "w")])


@pytest.mark.parametrize("kwargs, message", [
    ({"seed": -1}, "non-negative"),
    ({"seed": 0, "split": "test"}, "split must be one of"),
    ({"seed": 0, "difficulty": 4}, "difficulty must be one of"),
    ({"seed": 0, "family": "off_by_one", "split": "train"}, "not in split"),
    ({"seed": 0, "family": "fix_operator", "split": "eval"}, "not in split"),
    ({"seed": 0, "bugs": "wide"}, "bugs must be one of"),
])
def test_generate_task_rejects_bad_arguments(kwargs, message):
    seed = kwargs.pop("seed")
    with pytest.raises(ValueError, match=message):
        rt.generate_task(seed, **kwargs)


@pytest.mark.parametrize("family", list(rt.FAMILIES))
def test_expert_turns_apply_the_reference_edits(family):
    task = rt.generate_task(11, family=family, split=rt.FAMILIES[family].split)
    turns = rt.expert_turns(task)
    calls = [c for t in turns for c in t["tool_calls"]]
    names = [c["name"] for c in calls]
    assert names[-1] == "submit" and names.count("submit") == 1
    edits = [c["arguments"] for c in calls if c["name"] == "edit_file"]
    assert edits == [{"path": e.path, "old": e.old, "new": e.new} for e in task.edits]
    reads = [c["arguments"]["path"] for c in calls if c["name"] == "read_file"]
    assert set(reads) >= {e.path for e in task.edits}
    assert names.index("edit_file") > max(i for i, n in enumerate(names) if n == "read_file")
    assert names.index("run_tests") < names.index("edit_file") < len(names) - 1 - names[::-1].index("run_tests")
    assert ("grep" in names) == (task.expert_grep is not None)
    tokenizer = tk.ByteTokenizer()
    for turn in turns:  # each turn renders, and parses back to its calls
        assert turn["role"] == "assistant" and turn["content"]
        ids, mask = tokenizer.encode_chat([turn], add_generation_prompt=False)
        text = tokenizer.decode([t for t, m in zip(ids, mask) if m][:-1])
        parsed = tk.parse_tool_calls(text)
        assert [(p["name"], p["arguments"], p["error"]) for p in parsed] == \
            [(c["name"], c["arguments"], None) for c in turn["tool_calls"]]


@pytest.mark.parametrize("bugs", rt.BUG_DRAWS)
def test_the_recovering_expert_tries_a_wrong_line_then_the_one_the_tool_shows(tmp_path, bugs):
    from support.local_executor import LocalExecutor

    from rlcode.envs import tools

    missing = 0
    for family in VARIED + ["off_by_one"]:
        for seed in range(8):
            task = rt.generate_task(seed, family=family, split=rt.FAMILIES[family].split, bugs=bugs)
            wrong = rt.misremembered_edit(task)
            compact, recover = rt.expert_turns(task, "compact"), rt.expert_turns(task, "recover")
            if wrong is None:  # e.g. every changed operator is closer to another function's line
                missing += 1
                assert recover == compact
                continue
            (edit,) = task.edits
            assert wrong.path == edit.path and wrong.new == edit.new
            assert wrong.old not in task.files[edit.path] and wrong.old.count("\n") == edit.old.count("\n")
            assert recover == compact[:1] + [{"role": "assistant", "content": "", "tool_calls": [
                {"name": "edit_file", "arguments": {"path": wrong.path, "old": wrong.old, "new": wrong.new}}]}] + compact[1:]
            # Played in a workspace: the wrong try is refused with the reference line as the hint, and
            # the expert's next edit is that hint, copied.
            ws = tools.Workspace(rt.materialize(task, tmp_path), LocalExecutor(), test_paths=list(task.visible_test_files))
            out = tools.call_tool(ws, "edit_file", recover[1]["tool_calls"][0]["arguments"])
            assert out.status == "error"
            assert json.loads(out.observation.rsplit(" is ", 1)[1]) == recover[2]["tool_calls"][0]["arguments"]["old"]
            assert tools.call_tool(ws, "edit_file", recover[2]["tool_calls"][0]["arguments"]).status == "ok"
    assert missing <= 2


def test_no_wrong_try_where_no_single_change_points_back_to_the_line():
    task = rt.generate_task(0, family="setting_key")  # the edit changes a quoted key: no number or operator
    assert rt.misremembered_edit(task) is None
    assert rt.expert_turns(task, "recover") == rt.expert_turns(task, "compact")
