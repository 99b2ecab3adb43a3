"""Clarifying questions in the main job, and its behaviour monitor: demonstrations that ask, questions
that are never executed, the behaviour statistics in TensorBoard, and the monitor's stop."""

import re

import pytest

from support import tiny_job

from rlcode.checks import ConfigError
from rlcode.train import loop
from rlcode.train.metrics import read_jsonl


@pytest.fixture(scope="module")
def pool(sandbox_pool):
    return sandbox_pool


def test_question_demos_need_questions_allowed(tmp_path):
    cfg = tiny_job.tiny_config(tmp_path, task__question_demos=0.25)
    with pytest.raises(ConfigError, match="task.question_demos=0.25: .*task.allow_questions=True"):
        loop.validate_config(cfg, budget=[])
    cfg = tiny_job.tiny_config(tmp_path, behaviour__action="alert")
    with pytest.raises(ConfigError, match="behaviour.action"):
        loop.validate_config(cfg, budget=[])
    cfg = tiny_job.tiny_config(tmp_path)
    del cfg["behaviour"]  # a config written before the section: the defaults apply
    loop.validate_config(cfg, budget=[])


@pytest.mark.slow
def test_the_job_asks_logs_behaviour_and_the_monitor_stops_it(tmp_path, pool):
    cfg = tiny_job.tiny_config(tmp_path / "run", steps=4, task__allow_questions=True, task__question_demos=0.5,
                               sft__steps=2, eval__every=0, eval__at_start=False)
    cfg.reward.update(wrong_penalty=1.0, question_reward=0.0)
    # Any change from the first step's behaviour flags: the monitor stops the run at step 2.
    cfg.behaviour.update(baseline_steps=1, window=1, z=0.0, rate_tolerance=0.0, length_tolerance=0.0, action="stop")
    said = []
    result = loop.run(cfg, pool=pool, log=said.append)
    assert result.stopped == "behaviour" and result.steps_done == 2
    assert any(re.search(r"SFT demonstrations: (\d+) of (\d+) ask", m) for m in said)
    asked, demos = map(int, next(re.search(r"SFT demonstrations: (\d+) of (\d+) ask", m) for m in said
                                     if "SFT demonstrations" in m).groups())
    assert asked == round(0.5 * demos) and demos > 8
    assert any(m.startswith("behaviour monitor at step 2: ") and m.endswith("; stopping") for m in said)
    rows = [r for r in read_jsonl(tmp_path / "run" / "tb") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for stat in ("answer_rate", "question_rate", "malformed_rate", "length"):
        assert all(f"behaviour/{stat}" in r for r in rows)
        assert f"behaviour/{stat}_flag" in rows[1] and f"behaviour/{stat}_flag" not in rows[0]
    assert rows[1]["behaviour/events"] >= 1
    for r in rows:  # asking is the complement of answering; a question pays question_reward (0)
        assert r["behaviour/answer_rate"] + r["behaviour/question_rate"] == pytest.approx(1.0)
        assert r["rollout/reward_question"] == 0.0 and r["rollout/reward_wrong"] <= 0.0
    assert "eval/question_rate" in result.last_eval
