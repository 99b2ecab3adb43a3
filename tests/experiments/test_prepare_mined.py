"""experiments/prepare_mined.py end to end on a source distribution the test writes (no network):
the pinned hash is checked, the tree unpacked once, tasks mined in the sandbox and reported."""

import contextlib
import io
import json
import shutil
import tarfile

import pytest

from experiments import prepare_mined
from support.fixture_project import PACKAGE, TESTS


def write_sdist(path, name="fixture", version="0.1"):
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in ((f"{name}-{version}/calc/__init__.py", PACKAGE),
                          (f"{name}-{version}/tests/test_calc.py", TESTS)):
            data = text.encode()
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def pin_fixture_project(cache, monkeypatch):
    """The fixture project's source distribution in `cache`, pinned in `prepare_mined.PROJECTS`."""
    (cache / "sdist").mkdir(parents=True)
    sdist = cache / "sdist" / "fixture-0.1.tar.gz"
    write_sdist(sdist)
    project = prepare_mined.Project("fixture", "0.1", prepare_mined.sha256_of(str(sdist)), "MIT", "calc", ("tests",))
    monkeypatch.setitem(prepare_mined.PROJECTS, "fixture", project)
    return cache


@pytest.fixture()
def fixture_project(tmp_path, monkeypatch):
    return pin_fixture_project(tmp_path / "cache", monkeypatch)


@pytest.fixture(scope="module")
def mined_fixture(tmp_path_factory):
    """One run of the script on the fixture project (3 tasks, all in the test split), shared by
    the test of its outputs and the agent job that trains on them (mining runs the project's tests
    about twenty times): (directory it ran in, its cache, its printed output, its sha256 pin)."""
    base = tmp_path_factory.mktemp("mined")
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        cache = pin_fixture_project(base / "cache", mp)
        mp.chdir(base)  # a relative cache path, as the default is
        with contextlib.redirect_stdout(out):
            code = prepare_mined.main(["--projects", "fixture", "--tasks_per_project", "3", "--cache", "cache",
                                       "--eval_projects", "fixture", "--timeout", "20"])
        sha256 = prepare_mined.PROJECTS["fixture"].sha256
    assert code == 0, out.getvalue()[-2000:]
    return base, cache, out.getvalue(), sha256


@pytest.mark.slow
def test_mines_reports_and_splits_a_pinned_project(mined_fixture):
    base, fixture_project, printed, sha256 = mined_fixture
    lines = (fixture_project / "tasks.jsonl").read_text().splitlines()
    tasks = [json.loads(line) for line in lines]
    assert len(tasks) == 3 and all(t["split"] == "test" and t["failing"] for t in tasks)
    assert all(t["tests"] == ["tests/test_calc.py"] for t in tasks)
    report = json.loads((fixture_project / "report.json").read_text())["projects"]["fixture"]
    assert report["kept"] == 3 and report["sha256"] == sha256
    assert sum(report["difficulty"].values()) == 3 and report["splits"] == {"test": 3}
    assert "| fixture | 0.1 | MIT |" in (fixture_project / "report.md").read_text()
    assert not (base / "results").exists()  # only --publish writes committed evidence
    assert "3 tasks" in printed


def test_a_changed_source_distribution_is_refused(fixture_project, monkeypatch):
    sdist = fixture_project / "sdist" / "fixture-0.1.tar.gz"
    sdist.write_bytes(sdist.read_bytes() + b"\0")
    with pytest.raises(SystemExit, match="differs from the pinned"):
        prepare_mined.fetch(prepare_mined.PROJECTS["fixture"], str(fixture_project))


def test_unknown_projects_are_named(capsys):
    with pytest.raises(SystemExit):
        prepare_mined.parse_args(["--projects", "inflection,nosuch"])
    assert "nosuch" in capsys.readouterr().err


@pytest.mark.slow
def test_the_agent_job_trains_on_mined_tasks(mined_fixture, tmp_path):
    """A prepared cache (`task.source=mined`): expert demonstrations from the reference fixes, one
    GRPO step on the train split, evaluation on the test split, every episode graded by the
    project's own held-out tests."""
    from configs.agent_repo import get_config
    from support.local_executor import LocalExecutor

    from rlcode.envs.tasks import mined
    from rlcode.models.transformer import model_config
    from rlcode.checks import ConfigError
    from rlcode.train import agent

    fixture_project = tmp_path / "cache"
    shutil.copytree(mined_fixture[1], fixture_project)  # a copy: the splits are rewritten below
    path = fixture_project / "tasks.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for i, row in enumerate(rows):  # one file: make both splits exist whatever its hash says
        row["split"] = "test" if i == len(rows) - 1 else "train"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prepared = mined.load_prepared(str(fixture_project))
    assert [len(prepared["train"]), len(prepared["test"])] == [2, 1]

    cfg = get_config("base=bytes")
    cfg.model = model_config(vocab_size=320, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                             ffw_dim=64)
    cfg.workdir = str(tmp_path / "run")
    cfg.task.update(source="mined", mined_dir=str(fixture_project), levels=(1, 2, 3), num_train=2, num_demos=2,
                    num_fresh=0, num_eval=1)
    cfg.agent.update(max_turns=3, max_response_tokens=192, max_context_tokens=3072)
    cfg.sft.update(steps=1, batch_size=2, cache_dir=str(tmp_path / "sft"))
    cfg.train.steps = 1
    cfg.rollout.update(prompts_per_step=1, group_size=2)
    cfg.eval.update(num_samples=1, batch_rows=1)
    cfg.sandbox.timeout = 30.0
    with pytest.raises(ConfigError, match="0 of the 2 train tasks to draw from"):  # every mined task is a demonstration
        agent.run(cfg, pool=LocalExecutor(), log=lambda m: None)
    cfg.task.rl_tasks = "all"
    result = agent.run(cfg, pool=LocalExecutor(), log=lambda m: None)
    assert result.completed and result.steps_done == 1
    assert "eval/success" in result.first_eval and "eval/success" in result.last_eval

    # The evaluator plays the run's checkpoint on the test split, as the job's evaluation does.
    from experiments import evaluate

    out = tmp_path / "eval"
    assert evaluate.main(["--run", cfg.workdir, "--tasks", "mined", "--mined_dir", str(fixture_project),
                          "--samples", "1", "--k", "1", "--batch", "1", "--out", str(out)]) == 0
    report = json.loads((out / "evaluate.json").read_text())
    assert report["source"] == "mined" and report["tasks"]["evaluated"] == 1 and report["policy"]["step"] == 1
    assert 0.0 <= report["overall"]["pass@1"] <= 1.0
    (row,), (transcript,) = report["per_task"], report["transcripts"]
    assert row["n"] == 1 and row["c"] == report["overall"]["pass@1"] and row["task_id"] == transcript["task_id"]
    assert transcript["prompt"].startswith("Some tests of `")  # the task's statement
    assert transcript["completion"].startswith("# turn 0 (action") and "\n# end: " in transcript["completion"]
    assert f"### {row['task_id']} (passed: {transcript['passed']})" in (out / "evaluate.md").read_text()
    with pytest.raises(SystemExit, match="'agent' run"):
        evaluate.load_run(str(tmp_path / "run"), None)  # a synthesis evaluation refuses an agent run
