"""experiments/prepare_corpus.py end to end on a standard library and a mined-task cache the test
writes: the corpus, its manifest, the tokenizer and the report; no held-out file, no held-out
number."""

import json
import os

import pytest

from experiments import prepare_corpus
from rlcode.tokenizer import load_tokenizer


def write(root, rel, text):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


@pytest.fixture()
def sources(tmp_path):
    lib = tmp_path / "lib"
    for i in range(40):
        write(lib, f"mod{i}.py", f"def function_{i}(value):\n    return value * {i} + len(str(value))\n" * 5)
    write(lib, "test/test_mod.py", "assert True\n")
    mined = tmp_path / "mined"
    write(mined, "report.json", json.dumps({"eval_projects": []}))
    write(mined, "tasks.jsonl", json.dumps({"project": "six", "version": "1.17.0", "split": "train", "tests": [],
                                            "mutation": {"path": "six.py"}}) + "\n")
    write(mined, "src/six-1.17.0/six.py", "def add_metaclass(metaclass):\n    return metaclass\n")
    return str(lib), str(mined)


def test_builds_the_corpus_and_the_tokenizer_and_reports_them(sources, tmp_path, capsys):
    lib, mined = sources
    out = str(tmp_path / "corpus")
    assert prepare_corpus.main(["--stdlib", lib, "--mined_dir", mined, "--out", out, "--heldout", "0.3",
                                "--vocab_size", "300"]) == 0
    report = json.loads(open(os.path.join(out, "report.json")).read())
    manifest = json.loads(open(os.path.join(out, "manifest.json")).read())
    assert report["splits"] == manifest["splits"] and report["left_out"]["tests"] == 1
    assert report["sources"]["mined/six"]["licence"] == "MIT"  # the pinned project's licence
    assert sum(s["files"] for s in report["splits"].values()) == 41
    assert report["splits"]["heldout"]["files"] > 0 and report["tokenizer"]["heldout_bytes_per_token"] > 1.0
    assert load_tokenizer(os.path.join(out, "tokenizer")).vocab_size == 300
    assert "| mined/six | MIT |" in capsys.readouterr().out

    assert prepare_corpus.main(["--stdlib", lib, "--mined_dir", str(tmp_path / "none"), "--out", out,
                                "--heldout", "0", "--vocab_size", "300"]) == 0
    report = json.loads(open(os.path.join(out, "report.json")).read())
    assert report["splits"]["heldout"]["files"] == 0 and report["tokenizer"]["heldout_bytes_per_token"] is None
    printed = capsys.readouterr().out
    assert "no mined-task cache" in printed and "no held-out file" in printed
