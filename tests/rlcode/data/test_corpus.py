"""rlcode.data: the code corpus (sources, exclusions, deduplication, split by hash, manifest) and
the BPE tokenizer trained on it (exact round trips, special tokens, compression)."""

import hashlib
import itertools
import json
import os

import pytest

from rlcode.data import bpe, corpus
from rlcode.tokenizer import SPECIAL_TOKENS, ByteTokenizer, load_tokenizer


def write(root, rel, data):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode("utf-8"))


def fake_sources(tmp_path):
    lib = tmp_path / "lib"
    write(lib, "a.py", "def a():\n    return 1\n")
    write(lib, "dup.py", "def a():\r\n    return 1\r\n")  # the same text once line endings are normalised
    write(lib, "pkg/b.py", "class B:\n    pass\n")
    write(lib, "pkg/tests/c.py", "x = 1\n")
    write(lib, "test/support.py", "y = 1\n")
    write(lib, "test_y.py", "z = 1\n")
    write(lib, "idlelib/idle_test/w.py", "w = 1\n")
    write(lib, "site-packages/thirdparty.py", "t = 1\n")
    write(lib, "big.py", "# " + "x" * 300 + "\n")
    write(lib, "bad.py", b"s = '\xff\xfe'\n")
    write(lib, "notes.txt", "not python\n")
    mined = tmp_path / "mined"
    write(mined, "report.json", json.dumps({"eval_projects": ["evalproj"]}))
    tasks = [{"project": "p", "version": "1.0", "split": "train", "tests": ["tests"], "mutation": {"path": "p/core.py"}},
             {"project": "p", "version": "1.0", "split": "test", "tests": ["tests"], "mutation": {"path": "p/held.py"}},
             {"project": "evalproj", "version": "2.0", "split": "test", "tests": ["check_x.py"],
              "mutation": {"path": "evalproj/x.py"}}]
    write(mined, "tasks.jsonl", "\n".join(json.dumps(t) for t in tasks) + "\n")
    write(mined, "src/p-1.0/p/core.py", "def core():\n    return 2\n")
    write(mined, "src/p-1.0/p/held.py", "def held():\n    return 3\n")
    write(mined, "src/p-1.0/p/util.py", "def util():\n    return 4\n")
    write(mined, "src/p-1.0/tests/helpers.py", "h = 1\n")
    write(mined, "src/evalproj-2.0/evalproj/x.py", "def x():\n    return 5\n")
    write(mined, "src/evalproj-2.0/evalproj/other.py", "def other():\n    return 6\n")
    write(mined, "src/evalproj-2.0/check_x.py", "import evalproj\n")
    return str(lib), str(mined)


def test_sources_leave_out_tests_evaluation_code_duplicates_and_unreadable_files(tmp_path):
    lib, mined = fake_sources(tmp_path)
    skipped = corpus.Skipped()
    docs = list(corpus.stdlib_documents(lib, max_bytes=200, skipped=skipped))
    docs += corpus.mined_documents(mined, {"p": "MIT", "evalproj": "BSD-3-Clause"}, max_bytes=200, skipped=skipped)
    built = corpus.build(docs, heldout_fraction=0.5, skipped=skipped)
    kept = sorted((d.source, d.path, d.licence) for s in corpus.SPLITS for d in built.splits[s])
    assert kept == [("mined/p", "p/core.py", "MIT"), ("mined/p", "p/util.py", "MIT"),
                    ("stdlib", "a.py", "PSF-2.0"), ("stdlib", "pkg/b.py", "PSF-2.0")]
    # Tests: test_y.py (by name), the files under pkg/tests, test/ and idle_test, the mined
    # project's tests/ and the evaluation project's check_x.py (one of its test paths); site-packages
    # is not walked. Evaluation code: the test-split task's file and the evaluation project's modules.
    assert skipped == corpus.Skipped(tests=6, evaluation=3, undecodable=1, too_large=1, duplicates=1)
    for split in corpus.SPLITS:  # the split is the hash's alone (an independent computation)
        for d in built.splits[split]:
            h = hashlib.sha256(d.text.encode()).hexdigest()
            assert split == ("heldout" if int(h[:8], 16) / 2**32 < 0.5 else "train")
    with pytest.raises(ValueError, match="no licence recorded for project 'p'"):
        list(corpus.mined_documents(mined, {}))


def test_written_corpus_and_manifest_agree(tmp_path):
    lib, mined = fake_sources(tmp_path)
    docs = list(corpus.stdlib_documents(lib, max_bytes=200))
    docs += corpus.mined_documents(mined, {"p": "MIT"}, max_bytes=200)
    built = corpus.build(docs, heldout_fraction=0.5)
    manifest = corpus.write(built, str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == manifest
    for split in corpus.SPLITS:
        texts = corpus.read_texts(str(tmp_path / "out"), split)
        assert texts == built.texts(split)
        rows = [f for f in manifest["files"] if f["split"] == split]
        assert manifest["splits"][split] == {"files": len(rows), "bytes": sum(len(t.encode()) for t in texts)}
        assert [r["sha256"] for r in rows] == [hashlib.sha256(t.encode()).hexdigest() for t in texts]
    assert manifest["sources"]["mined/p"]["licence"] == "MIT"
    assert sum(s["train"]["bytes"] + s["heldout"]["bytes"] for s in manifest["sources"].values()) == \
        sum(f["bytes"] for f in manifest["files"])
    with pytest.raises(FileNotFoundError, match="prepare_corpus"):
        corpus.read_texts(str(tmp_path / "nowhere"), "train")
    with pytest.raises(ValueError, match="heldout_fraction"):
        corpus.build([], heldout_fraction=1.0)


def test_bpe_on_the_standard_library_round_trips_compresses_and_keeps_special_tokens(tmp_path):
    docs = list(itertools.islice(corpus.stdlib_documents(), 70))
    train, heldout = [d.text for d in docs[:60]], [d.text for d in docs[60:]]
    tok = bpe.save(bpe.train(train, 1500), str(tmp_path / "tok"))
    assert load_tokenizer(str(tmp_path / "tok")).vocab_size == tok.vocab_size == 1500
    assert [tok.special_tokens[s] for s in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    for text in ["def f(x):\n\treturn x  # ünïcode 🙂 \\\n", "    \n\n  x = '<|im_end|>'\r\n", "\x00\x7f", ""]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text and not set(ids) & set(range(len(SPECIAL_TOKENS)))
    ids, mask = tok.encode_builtin_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
                                           add_generation_prompt=False)
    assert ids.count(tok.im_start_id) == 2 and ids.count(tok.im_end_id) == 2 and sum(mask) >= 2
    ratio = bpe.bytes_per_token(tok, heldout)
    assert ratio > 2.0 and bpe.bytes_per_token(ByteTokenizer(), heldout) == 1.0  # held-out files, not trained on
    with pytest.raises(ValueError, match="vocab_size must exceed 263"):
        bpe.train(train, 263)
