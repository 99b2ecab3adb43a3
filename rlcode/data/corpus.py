"""A corpus of real Python source, available offline and reproducibly.

Sources:

* ``stdlib``: the ``.py`` files of the running interpreter's standard library (PSF licence),
  without its test packages (any ``test``, ``tests`` or ``idle_test`` directory, test modules by
  name) and without ``site-packages``.
* ``mined/<project>``: the non-test files of the projects unpacked by
  ``experiments.prepare_mined`` (their licences are recorded there), leaving out every file of an
  evaluation project and every file that holds a test-split task: evaluation code is never
  pretraining data.

Every file is read as UTF-8 (a file that is not is left out and counted), line endings are
normalised to ``\\n``, and exact duplicates (by SHA-256 of that text) are kept once, the first in
source order. A file larger than `max_bytes` (generated tables) is left out and counted. The split
is decided by the hash alone: a file is held out when the first 8 hex digits of its SHA-256, as an
integer, fall below `heldout_fraction` of 2^32, so it does not depend on the order, the source or
the other files.

`write` stores ``train.jsonl`` and ``heldout.jsonl`` (one document per line: source, path,
sha256, text) and ``manifest.json`` (every file with its source, path, bytes, hash, split and
licence; totals per source and split; what was left out and why; the interpreter version).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Sequence

from rlcode.envs.tasks import mined

STDLIB_LICENCE = "PSF-2.0"
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
NOT_SOURCE_DIRS = frozenset({"__pycache__", "site-packages"})  # never walked
SPLITS = ("train", "heldout")


@dataclasses.dataclass(frozen=True)
class Document:
    source: str  # "stdlib" or "mined/<project>"
    path: str  # relative to the source's root, "/"-separated
    licence: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def is_test_path(path: str, tests: Sequence[str] = ()) -> bool:
    """A file inside a test directory or one of the `tests` paths, or a test module or conftest
    by name (`rlcode.envs.tasks.mined.is_test_file`)."""
    return any(p in TEST_DIRS for p in path.split("/")[:-1]) or mined.is_test_file(path, tests)


def split_of(sha256: str, heldout_fraction: float) -> str:
    return "heldout" if int(sha256[:8], 16) < heldout_fraction * 2**32 else "train"


def _python_files(root: str) -> Iterator[str]:
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in NOT_SOURCE_DIRS)
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")


@dataclasses.dataclass
class Skipped:
    tests: int = 0
    evaluation: int = 0
    undecodable: int = 0
    too_large: int = 0
    duplicates: int = 0


def _read(root: str, rel: str, max_bytes: int, skipped: Skipped) -> str | None:
    path = os.path.join(root, rel)
    if os.path.getsize(path) > max_bytes:
        skipped.too_large += 1
        return None
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError:
        skipped.undecodable += 1
        return None


def stdlib_documents(root: str | None = None, *, max_bytes: int = 1 << 20,
                     skipped: Skipped | None = None) -> Iterator[Document]:
    """The standard library's non-test ``.py`` files (`root`: default the running interpreter's)."""
    root = root or sysconfig.get_paths()["stdlib"]
    skipped = Skipped() if skipped is None else skipped
    for rel in _python_files(root):
        if is_test_path(rel):
            skipped.tests += 1
            continue
        text = _read(root, rel, max_bytes, skipped)
        if text is not None:
            yield Document("stdlib", rel, STDLIB_LICENCE, text)


def mined_documents(cache: str, licences: dict[str, str], *, max_bytes: int = 1 << 20,
                    skipped: Skipped | None = None) -> Iterator[Document]:
    """The non-test files of a prepared mined-task cache (``src/<project>-<version>/``) that are
    not evaluation code: no file of an evaluation project (``report.json``'s ``eval_projects``)
    and no file holding a test-split task (``tasks.jsonl``). `licences`: project -> licence."""
    skipped = Skipped() if skipped is None else skipped
    with open(os.path.join(cache, "report.json"), encoding="utf-8") as f:
        eval_projects = set(json.load(f).get("eval_projects", ()))
    held: set[tuple[str, str]] = set()
    tests: dict[str, tuple[str, ...]] = {}
    with open(os.path.join(cache, "tasks.jsonl"), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                tests[f"{d['project']}-{d['version']}"] = tuple(d.get("tests", ()))
                if d["split"] != "train":
                    held.add((f"{d['project']}-{d['version']}", d["mutation"]["path"]))
    src = os.path.join(cache, "src")
    for folder in sorted(os.listdir(src)):
        project = folder.rsplit("-", 1)[0]
        root = os.path.join(src, folder)
        project_tests = tests.get(folder, ())
        for rel in _python_files(root):
            if is_test_path(rel, project_tests):
                skipped.tests += 1
                continue
            if project in eval_projects or (folder, rel) in held:
                skipped.evaluation += 1
                continue
            if project not in licences:
                raise ValueError(f"{cache}: no licence recorded for project {project!r}")
            text = _read(root, rel, max_bytes, skipped)
            if text is not None:
                yield Document(f"mined/{project}", rel, licences[project], text)


@dataclasses.dataclass
class Corpus:
    """Deduplicated documents by split, and what was left out."""

    splits: dict[str, list[Document]]
    skipped: Skipped
    heldout_fraction: float

    def texts(self, split: str) -> list[str]:
        return [d.text for d in self.splits[split]]

    def manifest(self) -> dict:
        files, totals = [], {}
        for split in SPLITS:
            for d in self.splits[split]:
                n = len(d.text.encode("utf-8"))
                files.append({"source": d.source, "path": d.path, "bytes": n, "sha256": d.sha256, "split": split,
                              "licence": d.licence})
                t = totals.setdefault(d.source, {"licence": d.licence, **{s: {"files": 0, "bytes": 0} for s in SPLITS}})
                t[split]["files"] += 1
                t[split]["bytes"] += n
        by_split = {s: {"files": sum(f["split"] == s for f in files),
                        "bytes": sum(f["bytes"] for f in files if f["split"] == s)} for s in SPLITS}
        return {"python": sys.version.split()[0], "heldout_fraction": self.heldout_fraction, "splits": by_split,
                "sources": totals, "left_out": dataclasses.asdict(self.skipped), "files": files}


def build(documents: Iterable[Document], heldout_fraction: float = 0.05, skipped: Skipped | None = None) -> Corpus:
    """Deduplicate (first occurrence wins) and split by hash."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    skipped = Skipped() if skipped is None else skipped
    seen: set[str] = set()
    splits: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for d in documents:
        h = d.sha256
        if h in seen:
            skipped.duplicates += 1
            continue
        seen.add(h)
        splits[split_of(h, heldout_fraction)].append(d)
    return Corpus(splits, skipped, heldout_fraction)


def write(corpus: Corpus, out: str) -> dict:
    """``train.jsonl``, ``heldout.jsonl`` and ``manifest.json`` in `out`; returns the manifest."""
    os.makedirs(out, exist_ok=True)
    for split in SPLITS:
        tmp = os.path.join(out, f"{split}.jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for d in corpus.splits[split]:
                f.write(json.dumps({"source": d.source, "path": d.path, "sha256": d.sha256, "text": d.text}) + "\n")
        os.replace(tmp, os.path.join(out, f"{split}.jsonl"))
    manifest = corpus.manifest()
    with open(os.path.join(out, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def read_texts(out: str, split: str) -> list[str]:
    """The texts of one split of a written corpus, in order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = os.path.join(out, f"{split}.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no corpus here; run python -m experiments.prepare_corpus --out {out}")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]

