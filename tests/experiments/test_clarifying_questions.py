"""experiments/clarifying_questions.py: its grid (the main job with questions allowed, over the
question reward), and the table, JSON and figure it draws from the runs' logs."""

import json

import numpy as np
import pytest

from experiments import ablate, clarifying_questions as cq
from rlcode.train.metrics import EventWriter


def test_the_grid_allows_questions_and_sweeps_the_question_reward():
    args = cq.parse_args(["--question_rewards=0,-1.5", "--wrong_penalty=0.5", "--set=train.steps=3"])
    argv = cq.ablate_args(args)
    for item in ("--set=task.allow_questions=True", "--set=task.question_demos=0.1", "--set=reward.wrong_penalty=0.5",
                 "--sweep=reward.question_reward:0.0,-1.5", "--name=questions"):
        assert item in argv
    assert argv.index("--set=train.steps=40") < argv.index("--set=train.steps=3")  # --set comes last, wins


def test_bad_arguments_are_refused(capsys):
    for argv, message in ((["--question_rewards=a"], "--question_rewards"), (["--question_rewards="], "nothing to run"),
                          (["--question_demos=0"], "must know how to ask"), (["--wrong_penalty=-1"], "wrong_penalty")):
        with pytest.raises(SystemExit):
            cq.parse_args(argv)
        assert message in capsys.readouterr().err


def test_table_json_and_figure_from_the_runs_logs(tmp_path, monkeypatch, capsys):
    out = tmp_path / "runs"
    # Two runs as the job logs them: the naive reward's question rate climbs, the other's stays.
    runs = []
    for label, climb in (("reward.question_reward=0.0", True), ("reward.question_reward=-1.5", False)):
        workdir = out / label / "seed0"
        w = EventWriter(str(workdir / "tb"))
        w.scalars(0, {"eval/pass@1": 0.2, "eval/question_rate": 0.1})
        for step in range(1, 21):
            q = min(1.0, 0.1 + 0.1 * max(0, step - 5)) if climb else 0.1
            w.scalars(step, {"behaviour/question_rate": q, "rollout/pass@1": 0.3 * (1 - q), "rollout/reward": -q,
                             **({"behaviour/question_rate_flag": float(climb and step >= 9)} if step > 3 else {})})
        w.scalars(20, {"eval/pass@1": 0.05 if climb else 0.25, "eval/question_rate": 0.9 if climb else 0.05})
        w.close()
        runs.append({"label": label, "seed": 0, "workdir": str(workdir), "status": "completed"})

    def fake_ablate(argv):  # the grid's summary, as ablate writes it
        assert "--table_only" in argv
        (out / "ablate_questions.json").write_text(json.dumps({"runs": runs}))
        return 0

    monkeypatch.setattr(ablate, "main", fake_ablate)
    assert cq.main([f"--out={out}", "--table_only", "--smooth=2"]) == 0
    data = json.loads((out / "clarifying_questions.json").read_text())
    naive, rebalanced = data["runs"]
    assert naive["question_rate_start"] == pytest.approx(0.1) and naive["question_rate_final"] == pytest.approx(1.0)
    assert rebalanced["question_rate_final"] == pytest.approx(0.1)
    assert naive["first_question_flag"] == 9 and rebalanced["first_question_flag"] is None
    assert naive["eval_pass@1_start"] == 0.2 and naive["eval_question_rate_final"] == 0.9
    assert naive["pass@1_final"] == pytest.approx(0.0) and rebalanced["pass@1_final"] == pytest.approx(0.27)
    np.testing.assert_allclose(naive["curves"]["question_rate"][:6], [0.1] * 5 + [0.2])
    assert (out / "clarifying_questions.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert "| reward.question_reward=0.0 | 0 | 0.100 -> 1.000 |" in table and "| 9 |" in table
