"""experiments/prepare_mined.py end to end on a source distribution the test writes (no network):
the pinned hash is checked, the tree unpacked once, tasks mined in the sandbox and reported."""

import io
import json
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


@pytest.fixture()
def fixture_project(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    (cache / "sdist").mkdir(parents=True)
    sdist = cache / "sdist" / "fixture-0.1.tar.gz"
    write_sdist(sdist)
    project = prepare_mined.Project("fixture", "0.1", prepare_mined.sha256_of(str(sdist)), "MIT", "calc", ("tests",))
    monkeypatch.setitem(prepare_mined.PROJECTS, "fixture", project)
    return cache


def test_mines_reports_and_splits_a_pinned_project(fixture_project, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert prepare_mined.main(["--projects", "fixture", "--tasks_per_project", "3", "--cache", str(fixture_project),
                               "--eval_projects", "fixture", "--timeout", "20"]) == 0
    lines = (fixture_project / "tasks.jsonl").read_text().splitlines()
    tasks = [json.loads(line) for line in lines]
    assert len(tasks) == 3 and all(t["split"] == "test" and t["failing"] for t in tasks)
    assert all(t["tests"] == ["tests/test_calc.py"] for t in tasks)
    report = json.loads((fixture_project / "report.json").read_text())["projects"]["fixture"]
    assert report["kept"] == 3 and report["sha256"] == prepare_mined.PROJECTS["fixture"].sha256
    assert sum(report["difficulty"].values()) == 3 and report["splits"] == {"test": 3}
    assert "| fixture | 0.1 | MIT |" in (fixture_project / "report.md").read_text()
    assert not (tmp_path / "results").exists()  # only --publish writes committed evidence
    assert "3 tasks" in capsys.readouterr().out


def test_a_changed_source_distribution_is_refused(fixture_project, monkeypatch):
    sdist = fixture_project / "sdist" / "fixture-0.1.tar.gz"
    sdist.write_bytes(sdist.read_bytes() + b"\0")
    with pytest.raises(SystemExit, match="differs from the pinned"):
        prepare_mined.fetch(prepare_mined.PROJECTS["fixture"], str(fixture_project))


def test_unknown_projects_are_named(capsys):
    with pytest.raises(SystemExit):
        prepare_mined.parse_args(["--projects", "inflection,nosuch"])
    assert "nosuch" in capsys.readouterr().err
