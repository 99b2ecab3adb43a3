"""Fetch real Python projects from the package registry once, and mine bug-fix tasks from them.

    python -m experiments.prepare_mined                      # every project, 12 tasks each
    python -m experiments.prepare_mined --projects inflection,toolz --tasks_per_project 4

Each project is a source distribution pinned by name, version and SHA-256 (`PROJECTS`: small,
permissively licensed, pure Python, with a test suite that runs in about a second). The script
downloads it with pip into ``--cache`` (default ``.cache/mined``; nothing is downloaded again once
there), checks the hash, unpacks it, checks that its tests pass, and mines tasks
(`rlcode.envs.tasks.mined.mine`: a bug in a function the tests call, kept when the suite goes
green to red twice the same way within ``--max_seconds``). Every execution of a project's tests
runs in the sandbox pool.

Output in the cache: ``tasks.jsonl`` (one validated task per line, with its project, split,
mutation, failing and regression tests), ``report.json`` and ``report.md`` (per project: sites,
tried, kept, the reasons for rejection, tasks per difficulty, mean grading seconds). Splits:
every task of the projects in ``--eval_projects`` is "test", and for the others a hash of the
file puts about a fifth of the files in "test" (`mined.split_of`), so evaluation sees code that
training never saw. ``--publish`` also copies the report to ``results/mined_tasks.json``/``.md``.
The tests never run this script: they mine a small project they write themselves.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence

from experiments.cli import summary


@dataclasses.dataclass(frozen=True)
class Project:
    """A pinned source distribution: `package` is the code mined (a directory, or a module
    without ``.py``, relative to the unpacked root), `tests` the test paths, `pythonpath` what
    the tests need on the import path (e.g. ``src``)."""

    name: str
    version: str
    sha256: str
    licence: str
    package: str
    tests: tuple[str, ...]
    pythonpath: tuple[str, ...] = ()

    @property
    def sdist(self) -> str:
        return f"{self.name.replace('-', '_')}-{self.version}.tar.gz"


PROJECTS = {p.name: p for p in (
    Project("inflection", "0.5.1", "1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417", "MIT",
            "inflection", ("test_inflection.py",)),
    Project("six", "1.17.0", "ff70335d468e7eb6ec65b95b99d3a2836546063f63acc5171de367e834932a81", "MIT",
            "six", ("test_six.py",)),
    Project("toolz", "1.2.0", "9667a038e9d6ecba37995e26cb2f59ec6420b6ad8dd9677de59db9b956b08490", "BSD-3-Clause",
            "toolz", ("toolz/tests",)),
    Project("cachetools", "8.0.2", "30ac523adfc118b51d2b2e7bad8a0ddb31370dfe2700c7f10ca224f36ccf81e0", "MIT",
            "src/cachetools", ("tests",), ("src",)),
    Project("semver", "3.1.2", "bea193552413194252d33ff26ce0962b76669bd1c6fb17e8e203ac37f072feaf", "BSD-3-Clause",
            "src/semver", ("tests",), ("src",)),
)}
DEFAULT_EVAL_PROJECTS = ("semver",)


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(p: Project, cache: str) -> str:
    """The unpacked source tree of `p` under `cache` (downloaded and checked once)."""
    sdists = os.path.join(cache, "sdist")
    os.makedirs(sdists, exist_ok=True)
    path = os.path.join(sdists, p.sdist)
    if not os.path.exists(path):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", sdists,
               f"{p.name}=={p.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(path):
            raise SystemExit(f"{p.name} {p.version}: pip download failed: {proc.stderr.strip()[-500:]}")
    digest = sha256_of(path)
    if digest != p.sha256:
        raise SystemExit(f"{path}: SHA-256 {digest} differs from the pinned {p.sha256}")
    root = os.path.join(cache, "src", f"{p.name}-{p.version}")
    if not os.path.isdir(root):
        tmp = root + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(path) as tar:
            tar.extractall(tmp, filter="data")
        (top,) = os.listdir(tmp)
        os.replace(os.path.join(tmp, top), root)
        shutil.rmtree(tmp)
    return root


def tests_of(root: str, tests: Sequence[str]) -> list[str]:
    out = []
    for t in tests:
        full = os.path.join(root, t)
        if os.path.isfile(full):
            out.append(t)
            continue
        for folder, _, names in os.walk(full):
            out += [os.path.relpath(os.path.join(folder, n), root).replace(os.sep, "/") for n in sorted(names)
                    if n.endswith(".py")]
    return sorted(out)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.prepare_mined", description=summary(__doc__))
    p.add_argument("--projects", default=",".join(PROJECTS), help=f"comma-separated, of {', '.join(PROJECTS)}")
    p.add_argument("--tasks_per_project", type=int, default=12)
    p.add_argument("--eval_projects", default=",".join(DEFAULT_EVAL_PROJECTS),
                   help="projects whose every task is in the test split")
    p.add_argument("--cache", default=os.path.join(".cache", "mined"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds one run of a project's tests may take")
    p.add_argument("--max_seconds", type=float, default=20.0, help="slower validated tasks are left out")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--publish", action="store_true", help="also write results/mined_tasks.json and .md")
    args = p.parse_args(argv)
    names = [n for n in args.projects.split(",") if n]
    unknown = [n for n in names if n not in PROJECTS]
    if unknown or not names:
        p.error(f"--projects: unknown {unknown} (known: {', '.join(PROJECTS)})")
    if args.tasks_per_project < 1:
        p.error("--tasks_per_project must be >= 1")
    args.projects = names
    args.eval_projects = [n for n in args.eval_projects.split(",") if n]
    return args


def markdown(report: dict) -> str:
    lines = ["| project | version | licence | sites | tried | kept | validation rate | L1 | L2 | L3 | "
             "train | test | mean grading s |", "|---" * 13 + "|"]
    for name, r in report["projects"].items():
        lines.append(f"| {name} | {r['version']} | {r['licence']} | {r['sites']} | {r['tried']} | {r['kept']} | "
                     f"{r['validation_rate']:.2f} | {r['difficulty'].get('1', 0)} | {r['difficulty'].get('2', 0)} | "
                     f"{r['difficulty'].get('3', 0)} | {r['splits'].get('train', 0)} | {r['splits'].get('test', 0)} | "
                     f"{r['mean_seconds']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from rlcode.sandbox import Limits, SandboxPool  # the pool starts before anything imports jax

    args.cache = os.path.abspath(args.cache)
    os.makedirs(args.cache, exist_ok=True)
    roots = {name: fetch(PROJECTS[name], args.cache) for name in args.projects}
    pool = SandboxPool(args.workers, Limits(wall_seconds=args.timeout + 5.0))
    from rlcode.envs.tasks import mined
    report: dict = {"seed": args.seed, "eval_projects": args.eval_projects, "projects": {}}
    lines = []
    try:
        for name in args.projects:
            p, root = PROJECTS[name], roots[name]
            t0 = time.perf_counter()
            tasks, r = mined.mine(root, p.package, list(p.tests), pool, project=name, version=p.version,
                                  max_tasks=args.tasks_per_project, seed=args.seed, timeout=args.timeout,
                                  max_seconds=args.max_seconds, pythonpath=p.pythonpath,
                                  work=os.path.join(args.cache, "work", name), log=print)
            splits: dict[str, int] = {}
            for t in tasks:
                split = mined.split_of(name, t.mutation.path, args.eval_projects)
                splits[split] = splits.get(split, 0) + 1
                lines.append(json.dumps(dict(mined.as_json(t), split=split, package=p.package,
                                             tests=tests_of(root, p.tests), pythonpath=list(p.pythonpath))))
            diffs: dict[str, int] = {}
            for t in tasks:
                diffs[str(t.difficulty)] = diffs.get(str(t.difficulty), 0) + 1
            report["projects"][name] = dict(r, version=p.version, licence=p.licence, sha256=p.sha256,
                                            difficulty=diffs, splits=splits,
                                            mean_seconds=float(sum(t.seconds for t in tasks) / max(1, len(tasks))),
                                            wall_seconds=round(time.perf_counter() - t0, 1))
            print(f"{name}: {r['kept']} tasks of {r['tried']} tried ({r['sites']} sites), rejected {r['rejected']}")
    finally:
        pool.close()
    with open(os.path.join(args.cache, "tasks.jsonl"), "w") as f:
        f.write("\n".join(lines) + "\n")
    text = markdown(report)
    targets = [args.cache] + (["results"] if args.publish else [])
    for folder in targets:
        stem = "report" if folder == args.cache else "mined_tasks"
        with open(os.path.join(folder, stem + ".json"), "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(folder, stem + ".md"), "w") as f:
            f.write(text)
    print(text)
    print(f"wrote {len(lines)} tasks to {os.path.join(args.cache, 'tasks.jsonl')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
