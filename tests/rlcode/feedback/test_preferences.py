"""rlcode.feedback.preferences (the JSON lines format: round trip, defaults, refusals naming file
and line, a torn last line) and rlcode.feedback.simulated_users (label statistics against the
stated choice model, ties, the bias, mutants graded in the sandbox)."""

import json
import math
import random

import numpy as np
import pytest

from rlcode.feedback import preferences as P
from rlcode.feedback import simulated_users as su


def test_round_trip_keeps_every_field_and_writes_only_what_differs_from_defaults(tmp_path):
    pairs = [P.PreferencePair("p1", "a", "b"),
             P.PreferencePair("p2", "c", "d", tie=True, weight=0.5, margin=0.0, id="x/1", source="user:7"),
             P.PreferencePair("p\u00e9", "e\n", "f", margin=1.25)]
    path = tmp_path / "prefs.jsonl"
    assert P.write_preferences(path, pairs) == 3
    assert P.read_preferences(path) == pairs
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert lines[0] == {"prompt": "p1", "chosen": "a", "rejected": "b"}
    assert lines[2] == {"prompt": "p\u00e9", "chosen": "e\n", "rejected": "f", "margin": 1.25}
    # Integer weights are numbers too.
    path.write_text('{"prompt": "q", "chosen": "a", "rejected": "b", "weight": 2}\n')
    assert P.read_preferences(path)[0].weight == 2.0


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "q", "chosen": "a", "rejcted": "b"}', r"unknown field\(s\) \['rejcted'\].*missing field\(s\) \['rejected'\]"),
    ('{"prompt": "q", "chosen": "a", "rejected": "b", "weight": 0}', "weight must be > 0"),
    ('{"prompt": "q", "chosen": "a", "rejected": "b", "weight": NaN}', "weight must be a finite number"),
    ('{"prompt": "q", "chosen": "a", "rejected": "b", "margin": -1}', "margin must be >= 0"),
    ('{"prompt": "q", "chosen": 3, "rejected": "b"}', "chosen must be a string"),
    ('{"prompt": "q", "chosen": "a", "rejected": "b", "tie": "yes"}', "tie must be true or false"),
    ('[1, 2]', "not a JSON record"),
])
def test_bad_records_name_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "prefs.jsonl"
    path.write_text('{"prompt": "ok", "chosen": "a", "rejected": "b"}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"prefs.jsonl:2: .*{message}"):
        P.read_preferences(path)


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_text('{"prompt": "ok", "chosen": "a", "rejected": "b"}\n{"prompt": "cut sh')
    with pytest.warns(RuntimeWarning, match="torn last line"):
        assert len(P.read_preferences(path)) == 1


def test_split_by_prompt_keeps_each_prompt_on_one_side():
    pairs = [P.PreferencePair(f"prompt {i % 50}", f"a{i}", f"b{i}") for i in range(500)]
    train, held = P.split_by_prompt(pairs, 0.3)
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    assert 0.15 < len({p.prompt for p in held}) / 50 < 0.45
    # The side of a prompt depends on the prompt alone, not on order or on the other pairs.
    again = P.split_by_prompt(list(reversed(pairs[:100])), 0.3)[1]
    assert {p.prompt for p in again} <= {p.prompt for p in held}
    assert P.split_by_prompt(pairs, 0.0)[1] == [] and P.split_by_prompt(pairs, 1.0)[0] == []


def test_simulated_labels_follow_the_choice_model():
    """Label frequencies against P(a) = sigmoid(beta dg + bias df) with flips, over many draws."""
    rng = random.Random(0)
    a, b = "    return x\n", "    # explain\n    # more\n    return y\n"  # b has 2 comment lines
    for beta, bias, flip, ga, gb in [(10.0, 0.0, 0.0, 0.6, 0.5), (10.0, 1.0, 0.0, 0.6, 0.5), (4.0, -0.5, 0.2, 0.2, 0.9)]:
        user = su.SimulatedUser(beta=beta, bias=bias, flip=flip)
        p = 1 / (1 + math.exp(-(beta * (ga - gb) + bias * (0 - 2))))
        expected = p * (1 - flip) + (1 - p) * flip
        n = 4000
        wins = sum(user.label("q", a, b, ga, gb, rng).chosen == a for _ in range(n))
        assert abs(wins / n - expected) < 4 * math.sqrt(expected * (1 - expected) / n), (beta, bias, flip)
    tie_user = su.SimulatedUser(tie_band=0.05)
    assert tie_user.label("q", a, a + "\n", 0.5, 0.52, rng).tie
    assert not tie_user.label("q", a, b, 0.5, 0.52, rng).tie  # the features differ
    with pytest.raises(ValueError, match="flip"):
        su.SimulatedUser(flip=0.7)


def test_label_pairs_covers_each_unordered_pair_once_in_random_order():
    rng = random.Random(1)
    texts, gold = ["a", "b", "c", "d", "a"], [1.0, 0.0, 0.5, 0.25, 1.0]
    pairs = su.label_pairs(su.SimulatedUser(beta=1000.0), "q", texts, gold, rng)
    assert sorted(tuple(sorted((p.chosen, p.rejected))) for p in pairs) == sorted(
        (x, y) for i, x in enumerate("abcd") for y in "abcd"[i + 1:])
    better = dict(zip(texts, gold))
    assert all(better[p.chosen] > better[p.rejected] for p in pairs)  # a near-perfectly rational user
    assert len(su.label_pairs(su.SimulatedUser(), "q", texts, gold, rng, max_pairs=2)) == 2


@pytest.mark.slow
def test_candidates_are_graded_mutants_and_verbose_copies_that_behave_the_same():
    from rlcode.envs.tasks import synth
    from rlcode.train.engine import default_pool
    from rlcode.train.rollout import Grader

    rng = random.Random(0)
    tasks = synth.make_split("train", 12, seed=3, levels=(1, 2, 3))
    rows = []
    for task in tasks:
        texts = su.candidates(task, rng, mutants=3, verbose=2)
        assert texts[0] == task.reference_body and len(set(texts)) == len(texts) >= 3
        rows += [(task, t) for t in texts]
    pool = default_pool(2, 10.0)
    try:
        gold, valid, _, _ = Grader(pool).grade([t for t, _ in rows], [c for _, c in rows])
    finally:
        pool.close()
    assert valid.all()
    strip = lambda t: [line for line in t.splitlines() if not line.strip().startswith("#")]
    by_code = {}
    for (task, text), g in zip(rows, gold):
        if text == task.reference_body:
            assert g == 1.0  # the reference passes every held-out test
        by_code.setdefault((task.task_id, tuple(strip(text))), set()).add(float(g))
    assert all(len(v) == 1 for v in by_code.values())  # comment lines change nothing graded
    assert np.mean(gold < 1.0) > 0.3  # mutants mostly break something
    assert any(su.features(t)["comment_lines"] > 0 for _, t in rows)
