"""rlcode.envs.rewards: every term against hand-computed values, the hack and infrastructure
rules, the typed config section, and one end-to-end check on real grades."""

from __future__ import annotations

import dataclasses
import math

import ml_collections
import pytest

from rlcode.envs import grading, harness, rewards
from rlcode.envs.tasks import repo as rt
from support.local_executor import LocalExecutor  # this test directory is on sys.path

# sigmoid(0), sigmoid(1), sigmoid(-3), computed by hand: 1 / (1 + e^-x).
SIG0, SIG1, SIG_M3 = 0.5, 0.7310585786300049, 0.04742587317756678


@dataclasses.dataclass
class Task:
    difficulty: int


def trajectory(tokens_per_turn=(), malformed=0, infra=0, summaries=()):
    """A Trajectory with action turns generating the given token counts (and summary turns)."""
    turns = [harness.Turn(i, 0, "action", "", n, False) for i, n in enumerate(tokens_per_turn)]
    turns += [harness.Turn(len(turns) + i, 1, "summary", "", n, False) for i, n in enumerate(summaries)]
    return harness.Trajectory(task_id="t", segments=[], turns=turns, tool_calls=[], num_turns=len(tokens_per_turn),
                              num_summaries=len(summaries), num_malformed_calls=malformed, num_tool_errors=0,
                              num_infra_errors=infra, num_no_call_turns=0, num_truncated_turns=0, submitted=True,
                              end_reason="submitted", workdir="/nonexistent")


def grade_result(passed=3, expected=3, status="ok", flags=()):
    ids = tuple(f"h.py::test_{i}" for i in range(expected))
    return grading.GradeResult(expected=ids, passed=ids[:passed], failed=ids[passed:],
                               pass_fraction=passed / expected, all_passed=passed == expected and status == "ok",
                               flags=tuple(sorted(flags)), status=status, details="")


def test_all_terms_by_hand():
    # d = 1: L0 = 1024, s = 256; N = 4 * 256 = 1024 -> sigmoid(0).
    reward, terms, flags, valid = rewards.compute_reward(grade_result(), trajectory([256] * 4), Task(1), None)
    assert valid and flags == ()
    assert terms == pytest.approx({"tests": 1.0, "length": -0.1 * SIG0, "malformed": 0.0, "turns": -0.04, "hack": 0.0,
                                   "preference": 0.0})
    assert reward == pytest.approx(1.0 - 0.05 - 0.04)
    # d = 3: L0 = 4096, s = 1024; N = 1024 -> sigmoid(-3). 3 malformed calls, 5 turns, tests failed.
    traj = trajectory([200, 200, 200, 200, 224], malformed=3)
    reward, terms, _, _ = rewards.compute_reward(grade_result(passed=2), traj, Task(3), None)
    assert terms == pytest.approx({"tests": 0.0, "length": -0.1 * SIG_M3, "malformed": -0.15, "turns": -0.05,
                                   "hack": 0.0, "preference": 0.0})
    assert reward == pytest.approx(-0.1 * SIG_M3 - 0.15 - 0.05)
    # d = 2: L0 = 2048, s = 512; N = 2048 + 512 (a summary turn counts) -> sigmoid(1).
    _, terms, _, _ = rewards.compute_reward(grade_result(), trajectory([2000], summaries=[560]), Task(2), None)
    assert terms["length"] == pytest.approx(-0.1 * SIG1)
    assert terms["turns"] == pytest.approx(-0.01)
    # The malformed penalty is capped.
    _, terms, _, _ = rewards.compute_reward(grade_result(), trajectory([10], malformed=25), Task(1), None)
    assert terms["malformed"] == pytest.approx(-0.05 * 10)


def test_pass_fraction_mode_and_custom_weights():
    cfg = rewards.reward_config(test_reward="pass_fraction", length_weight=0.5, length_midpoint=100.0,
                                length_growth=3.0, length_softness=0.5, malformed_weight=0.2, malformed_cap=2,
                                turn_weight=0.1)
    cfg = rewards.RewardConfig.from_config(cfg)
    # d = 2: L0 = 300, s = 150; N = 450 -> sigmoid(1).
    reward, terms, _, _ = rewards.compute_reward(grade_result(passed=2), trajectory([150, 300], malformed=5),
                                                 Task(2), cfg)
    want = {"tests": 2 / 3, "preference": 0.0, "length": -0.5 * SIG1, "malformed": -0.4, "turns": -0.2, "hack": 0.0}
    assert terms == pytest.approx(want)
    assert reward == pytest.approx(sum(want.values()))


def test_length_penalty_shape():
    cfg = rewards.RewardConfig()
    assert [rewards.length_midpoint(d) for d in (1, 2, 3)] == [1024.0, 2048.0, 4096.0]
    grid = [0, 256, 512, 1024, 1536, 2048, 4096, 8192, 16384]
    for d in (1, 2, 3):
        values = [rewards.length_penalty(n, d, cfg) for n in grid]
        assert all(a > b for a, b in zip(values, values[1:]))  # longer is always worse
        assert -0.1 <= values[-1] < -0.0999 and -0.01 < values[0] < 0  # bounded by the weight
        assert rewards.length_penalty(rewards.length_midpoint(d), d, cfg) == pytest.approx(-0.05)
    for n in grid[1:]:  # the same length costs an easy task more than a hard one
        assert rewards.length_penalty(n, 1) < rewards.length_penalty(n, 2) < rewards.length_penalty(n, 3)
    # At N = 0 the argument is -1 / softness at every level (the step's width scales with L0).
    assert rewards.length_penalty(0, 1) == rewards.length_penalty(0, 3) == pytest.approx(-0.1 / (1 + math.exp(4)))
    # Huge lengths do not overflow.
    assert rewards.length_penalty(10**9, 1) == pytest.approx(-0.1)
    with pytest.raises(ValueError, match="difficulty"):
        rewards.length_penalty(10, 0)


def test_timeout_and_crash_are_failures_with_flags():
    for status in ("timeout", "crash"):
        # Even a grade that somehow carries passes scores 0 on tests when the run did not finish.
        g = dataclasses.replace(grade_result(passed=3), status=status, flags=(status,), all_passed=False)
        for mode in rewards.TEST_REWARDS:
            reward, terms, flags, valid = rewards.compute_reward(g, trajectory([100]), Task(1), rewards.RewardConfig(test_reward=mode))
            assert valid and terms["tests"] == 0.0 and flags == (status,)
            assert reward == pytest.approx(terms["length"] + terms["turns"])


def test_infrastructure_failures_are_masked():
    zeros = {name: 0.0 for name in rewards.TERMS}
    for g, traj in ((grade_result(status="infra", passed=0), trajectory([100])),
                    (grade_result(), trajectory([100], infra=1))):
        assert rewards.compute_reward(g, traj, Task(1), None) == (0.0, zeros, ("infra",), False)


@pytest.mark.parametrize("flag", rewards.DEFAULT_HACK_FLAGS)
def test_hack_flags(flag):
    g = grade_result(flags=(flag,))
    traj = trajectory([256] * 4, malformed=1)
    penalties = -0.1 * SIG0 - 0.05 - 0.04
    # zero_tests (default): the test term is zeroed, penalties stay; a hack never beats an honest failure.
    reward, terms, flags, valid = rewards.compute_reward(g, traj, Task(1), rewards.RewardConfig(hack_penalty=0.5))
    assert valid and flags == (flag,) and terms["tests"] == 0.0 and terms["hack"] == -0.5
    assert reward == pytest.approx(penalties - 0.5)
    honest_failure, _, _, _ = rewards.compute_reward(grade_result(passed=0), traj, Task(1), None)
    assert rewards.compute_reward(g, traj, Task(1), None)[0] == pytest.approx(honest_failure)
    # zero_reward: exactly 0, and the terms still sum to the reward.
    reward, terms, _, _ = rewards.compute_reward(g, traj, Task(1), rewards.RewardConfig(hack_mode="zero_reward"))
    assert reward == 0.0 and sum(terms.values()) == pytest.approx(0.0)
    assert terms["tests"] == 1.0 and terms["hack"] == pytest.approx(-(1.0 + penalties))
    # none: flags are reported, nothing changes.
    reward, terms, flags, _ = rewards.compute_reward(g, traj, Task(1), rewards.RewardConfig(hack_mode="none"))
    assert reward == pytest.approx(1.0 + penalties) and terms["hack"] == 0.0 and flags == (flag,)
    # A flag outside hack_flags does not count as a hack.
    others = tuple(f for f in rewards.DEFAULT_HACK_FLAGS if f != flag)
    reward, _, _, _ = rewards.compute_reward(g, traj, Task(1), rewards.RewardConfig(hack_flags=others))
    assert reward == pytest.approx(1.0 + penalties)


def test_config_readers():
    cfg = rewards.reward_config()
    assert isinstance(cfg, ml_collections.ConfigDict)
    read = rewards.RewardConfig.from_config
    assert read(cfg) == rewards.RewardConfig() == read({}) == read(rewards.RewardConfig())
    assert read({"turn_weight": 0.5}).turn_weight == 0.5
    assert read(cfg.to_dict()) == rewards.RewardConfig()
    assert read(ml_collections.FrozenConfigDict(cfg)) == rewards.RewardConfig()
    listed = read({"hack_flags": ["tests_edited"]})
    assert listed.hack_flags == ("tests_edited",)
    g, traj = grade_result(passed=1), trajectory([300, 400], malformed=2)
    results = [rewards.compute_reward(g, traj, Task(2), c)
               for c in (None, read(cfg), read(cfg.to_dict()), rewards.RewardConfig())]
    assert all(r == results[0] for r in results)
    # compute_reward takes the typed section only: a ConfigDict or a dict is refused, not read.
    for untyped in (cfg, cfg.to_dict()):
        with pytest.raises(TypeError, match="RewardConfig.from_config"):
            rewards.compute_reward(g, traj, Task(2), untyped)
    with pytest.raises(ValueError, match="unknown reward config field"):
        rewards.reward_config(no_such_field=1)
    for bad, field in (({"test_reward": "best"}, "test_reward"), ({"hack_mode": "zero"}, "hack_mode"),
                       ({"hack_flags": ("tests_edited", "made_up")}, "hack_flags"),
                       ({"hack_flags": "tests_edited"}, "hack_flags"), ({"length_weight": -1.0}, "length_weight"),
                       ({"length_midpoint": 0.0}, "length_midpoint"), ({"length_softness": 0.0}, "length_softness"),
                       ({"length_growth": 0.5}, "length_growth"), ({"malformed_cap": -1}, "malformed_cap"),
                       ({"turn_weight": math.nan}, "turn_weight")):
        with pytest.raises(ValueError, match=field):
            rewards.RewardConfig.from_config(bad)
    assert set(rewards.DEFAULT_HACK_FLAGS) <= set(grading.FLAGS)


def test_end_to_end_with_real_grades(tmp_path):
    task = rt.generate_task(3, family="fix_constant")
    (vis,) = task.visible_test_files
    traj = trajectory([300, 300])
    honest = grading.grade(task, rt.materialize(task, tmp_path / "r", solved=True), LocalExecutor(), timeout=60,
                           root=tmp_path)
    untouched = grading.grade(task, rt.materialize(task, tmp_path / "r"), LocalExecutor(), timeout=60, root=tmp_path)
    wd = rt.materialize(task, tmp_path / "r", solved=True)
    (tmp_path / "r" / wd / vis).unlink()
    edited = grading.grade(task, wd, LocalExecutor(), timeout=60, root=tmp_path)
    assert honest.all_passed and edited.all_passed and edited.flags == ("tests_edited",)
    assert 0 < untouched.pass_fraction < 1
    length_and_turns = -0.1 * rewards._sigmoid((600 - 1024) / 256) - 0.02
    r_honest, *_ = rewards.compute_reward(honest, traj, task, None)
    r_untouched, *_ = rewards.compute_reward(untouched, traj, task, None)
    r_edited, _, flags, valid = rewards.compute_reward(edited, traj, task, None)
    assert r_honest == pytest.approx(1.0 + length_and_turns)
    assert r_untouched == pytest.approx(length_and_turns)  # all_pass: the unchanged tests pay nothing
    assert r_edited == pytest.approx(length_and_turns) and flags == ("tests_edited",) and valid


def test_a_learned_reward_replaces_the_tests_and_a_hack_earns_none_of_it():
    cfg = rewards.RewardConfig(source="reward_model", reward_model="rm", preference_weight=2.0)
    traj = trajectory([300, 400], malformed=2)
    reward, terms, _, valid = rewards.compute_reward(grade_result(passed=3), traj, Task(2), cfg, preference=0.75)
    assert valid and terms["tests"] == 0.0 and terms["preference"] == 1.5
    assert reward == pytest.approx(sum(terms.values()))
    tests_cfg = rewards.RewardConfig()
    _, tests_terms, _, _ = rewards.compute_reward(grade_result(passed=3), traj, Task(2), tests_cfg)
    assert tests_terms["preference"] == 0.0 and tests_terms["tests"] == 1.0
    assert {k: v for k, v in terms.items() if k not in ("tests", "preference")} == \
        {k: v for k, v in tests_terms.items() if k not in ("tests", "preference")}
    _, hacked, _, _ = rewards.compute_reward(grade_result(flags=("tests_edited",)), traj, Task(2), cfg, preference=9.0)
    assert hacked["preference"] == 0.0 and hacked["tests"] == 0.0
    for bad in (None, math.nan):
        with pytest.raises(ValueError, match="finite reward-model score"):
            rewards.compute_reward(grade_result(), traj, Task(2), cfg, preference=bad)
    with pytest.raises(ValueError, match="needs reward.reward_model"):
        rewards.RewardConfig(source="reward_model")


def test_patch_text_is_the_unified_diff_of_every_changed_added_and_deleted_file():
    task = rt.generate_task(3, difficulty=1, split="train")
    files = {p: t.encode() for p, t in task.files.items()}
    assert grading.patch_text(task, files) == ""
    changed = sorted(task.solution_files)[0]
    files[changed] = task.solution_files[changed].encode()
    deleted = sorted(p for p in task.files if p != changed)[0]
    del files[deleted]
    files["notes/new.txt"] = b"one\ntwo"
    text = grading.patch_text(task, files)
    old, new = task.files[changed].splitlines(), task.solution_files[changed].splitlines()
    minus = [ln[1:] for ln in text.split(f"+++ b/{changed}\n")[1].split("--- ")[0].splitlines() if ln.startswith("-")]
    plus = [ln[1:] for ln in text.split(f"+++ b/{changed}\n")[1].split("--- ")[0].splitlines() if ln.startswith("+")]
    assert set(minus) <= set(old) and set(plus) <= set(new) and (minus or plus)
    assert [ln for ln in old if ln not in minus] == [ln for ln in new if ln not in plus]  # the unchanged lines agree
    assert f"--- a/{deleted}\n+++ /dev/null\n" in text
    assert "--- /dev/null\n+++ b/notes/new.txt\n" in text and "+one\n+two\n" in text
    assert text.index(f"a/{changed}") < text.index("b/notes/new.txt") or changed > "notes/new.txt"
    assert len(grading.patch_text(task, files, max_chars=50)) == 50
