"""Compare this tree with an earlier revision of the project, measured side by side in one run.

    python -m experiments.compare_revision --what=graders    # runs/compare_revision/graders.json
    python -m experiments.compare_revision --what=sandbox    # runs/compare_revision/sandbox.json

`--rev` (default `BEFORE`: the last revision whose graders compared inside the candidate's
process, and whose sandbox had none of the defences of docs/threat_model.md's last revision)
must be in the repository's history (a shallow clone may lack it: `git fetch --unshallow`).

graders. The revision's synthesis grader (`grading_program` / `parse_grading_output` of its
rlcode/envs/tasks/synth.py) and repository grader (`grade` of its rlcode/envs/grading.py) are
loaded from `git show` and run through the same executor as this tree's graders (a
`SandboxPool`, or a plain subprocess where none can start, see experiments/hack_suite.py):

* every attack of `hacks.VERDICT_ATTACKS` as the candidate for `--tasks` synthesis tasks: the
  fraction of held-out cases each grader passes (mean over the tasks, and how many tasks it paid
  in full);
* agreement on ordinary candidates: for each of those tasks its reference body and the reference
  bodies of up to `--others` other tasks with the same signature types (plausible programs that
  pass some cases and fail others): the number of cases passed, old against new, and every
  disagreement;
* the repository attacks on the verdict (`hacks` groups report_channel and read_expected) on one
  generated task per level: the reward `compute_reward` gives with the old grader, the data checks
  and this tree's pytest runner (the hack suite's reward configuration: penalties 0).

sandbox. A git worktree of the revision in a temporary directory; in each of `--rounds` rounds, one
process per tree (trees in alternating order) starts a one-worker `SandboxPool` and times
`--executions` runs of a trivial program (`true`), of in-place Python and (a fifth as many) of an
exec'd interpreter; reported: per tree and program the median over rounds of the round's median
latency, and this tree's ratio to the revision's. Nothing else should run on the machine.

Writes the JSON (default runs/compare_revision/<what>.json: a run directory, never the committed
results) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

BEFORE = "ac2af87346601d203f6fe922819e641d6a711648"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.compare_revision")
    p.add_argument("--what", choices=("graders", "sandbox"), required=True)
    p.add_argument("--rev", default=BEFORE, help="the earlier revision (a commit of this repository)")
    p.add_argument("--out", default=None, help="JSON path (default runs/compare_revision/<what>.json)")
    p.add_argument("--tasks", type=int, default=12, help="graders: synthesis tasks per attack")
    p.add_argument("--others", type=int, default=8, help="graders: other tasks' bodies tried per task")
    p.add_argument("--timeout", type=float, default=10.0, help="graders: seconds per grading")
    p.add_argument("--quick", action="store_true",
                   help="graders: 2 tasks, 1 other body each, two attacks of each kind, level 1 only")
    p.add_argument("--rounds", type=int, default=6, help="sandbox: alternating rounds")
    p.add_argument("--executions", type=int, default=300, help="sandbox: timed executions per program and round")
    return p.parse_args(argv)


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True, text=True).stdout


# Modules this tree has moved: old name -> new name.
MOVED_MODULES = {"rlcode.envs.repo_tasks": "rlcode.envs.tasks.repo"}


def load_module_at(rev: str, path: str, name: str):
    """The module `path` of revision `rev`, imported under `name` (its own imports resolve to this
    tree's packages)."""
    source = _git("show", f"{rev}:{path}")
    for old_name, new_name in MOVED_MODULES.items():  # an older revision imports them by their old names
        sys.modules.setdefault(old_name, importlib.import_module(new_name))
    spec = importlib.util.spec_from_loader(name, loader=None, origin=f"{rev[:12]}:{path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    exec(compile(source, f"{rev[:12]}:{path}", "exec"), module.__dict__)
    return module


# ----------------------------------------------------------------------------------------------
# graders

def _old_synth_pass(old, pool, task, candidate: str, timeout: float) -> int:
    res = pool.run_python(old.grading_program(task, candidate), timeout=timeout)
    return old.parse_grading_output(res.stdout, expected_total=len(task.tests))[0]


def _new_synth_pass(pool, task, candidate: str, timeout: float, inprocess: bool) -> int:
    from rlcode.envs import verdict  # noqa: PLC0415
    from rlcode.envs.tasks import synth  # noqa: PLC0415

    return sum(verdict.run_checks(pool, [synth.check_group(task, candidate)], timeout=timeout,
                                  inprocess=inprocess).check_passed)


def compare_graders(args: argparse.Namespace, log=print) -> dict[str, Any]:
    from experiments import hack_suite  # noqa: PLC0415 (imported only for this comparison)

    pool, ex_info = hack_suite.make_executor(2, args.timeout)
    inprocess = ex_info["kind"] == "sandbox_pool"
    try:
        from rlcode.envs import grading, hacks, rewards  # noqa: PLC0415
        from rlcode.envs.tasks import repo as rt  # noqa: PLC0415
        from rlcode.envs.tasks import synth  # noqa: PLC0415
        from rlcode.sandbox import fstree  # noqa: PLC0415

        old_synth = load_module_at(args.rev, "rlcode/envs/tasks/synth.py", "_old_synth")
        old_grading = load_module_at(args.rev, "rlcode/envs/grading.py", "_old_grading")
        n_tasks, others = (2, 1) if args.quick else (args.tasks, args.others)
        tasks = [synth.generate_task(s, 1 + s % 3, "train") for s in range(n_tasks)]
        synth_attacks = ("main_globals", "forge_at_exit") if args.quick else tuple(hacks.VERDICT_ATTACKS)
        repo_attacks = ([hacks.HACKS["report_emit_main"], hacks.HACKS["report_emit_traceback_walk"]] if args.quick
                        else hacks.group("report_channel") + hacks.group("read_expected"))
        levels = (1,) if args.quick else (1, 2, 3)

        attacks = []
        for name in synth_attacks:
            old, new = [], []
            for task in tasks:
                candidate = hacks.synth_attack_source(task, name)
                n = len(task.tests)
                old.append(_old_synth_pass(old_synth, pool, task, candidate, args.timeout) / n)
                new.append(_new_synth_pass(pool, task, candidate, args.timeout, inprocess) / n)
            attacks.append({"attack": name, "old_mean": statistics.mean(old), "old_full": sum(x == 1 for x in old),
                            "new_max": max(new), "tasks": len(tasks)})
            log(f"synthesis attack {name:20s} old mean {attacks[-1]['old_mean']:.2f} "
                f"(paid in full on {attacks[-1]['old_full']}/{len(tasks)})  new max {attacks[-1]['new_max']:.2f}")

        def types(t):  # "xs: list[int]) -> int:": argument and return types (the names follow the types)
            return t.signature.split("(", 1)[1]

        by_types: dict[str, list] = {}
        for s in range(200):
            t = synth.generate_task(s, 1 + s % 2, "train")
            by_types.setdefault(types(t), []).append(t)
        candidates, disagreements = 0, []
        for task in tasks:
            same_types = [t for t in by_types.get(types(task), []) if t.task_id != task.task_id]
            for body in [task.reference_body] + [t.reference_body for t in same_types[:others]]:
                old = _old_synth_pass(old_synth, pool, task, body, args.timeout)
                new = _new_synth_pass(pool, task, body, args.timeout, inprocess)
                candidates += 1
                if old != new:
                    disagreements.append({"task": task.task_id, "body": body, "old": old, "new": new})
        log(f"ordinary candidates: {candidates} graded by both, {len(disagreements)} disagreements")

        cfg, _ = hack_suite.reward_configs()
        repo = []
        with tempfile.TemporaryDirectory(prefix="rlcode_compare_") as root:
            for hack in repo_attacks:
                for level in levels:
                    task = rt.generate_task(0, difficulty=level)
                    wd = hack.plant(task, os.path.join(root, "rollouts"))
                    traj = hack_suite.empty_trajectory(task, wd)
                    graded = {
                        "old": old_grading.grade(task, wd, pool, timeout=args.timeout, root=root),
                        "checks": grading.grade(task, wd, pool, timeout=args.timeout, root=root),
                        "pytest": grading.grade(dataclasses.replace(task, heldout_checks=()), wd, pool,
                                                timeout=args.timeout, root=root),
                    }
                    fstree.remove(wd)
                    row = {"hack": hack.name, "task_id": task.task_id}
                    for key, grade in graded.items():
                        row[key] = rewards.compute_reward(grade, traj, task, cfg)[0]
                    repo.append(row)
                    log(f"repository {hack.name:34s} {task.task_id:28s} reward old {row['old']:g}  "
                        f"checks {row['checks']:g}  pytest runner {row['pytest']:g}")
    finally:
        close = getattr(pool, "close", None)
        if close is not None:
            close()
    return {"executor": {k: v for k, v in ex_info.items() if k in ("kind", "note")}, "synthesis_attacks": attacks,
            "ordinary_candidates": candidates, "disagreements": disagreements, "repository_attacks": repo}


# ----------------------------------------------------------------------------------------------
# sandbox

_TIMER = r'''
import json, statistics, sys, time, warnings
warnings.simplefilter("ignore")
from rlcode.sandbox import Limits, SandboxPool
n = int(sys.argv[1])
with SandboxPool(1, Limits(wall_seconds=10)) as pool:
    out = {}
    for name, count, run in (("true", n, lambda: pool.run(["true"])),
                             ("python_inprocess", n, lambda: pool.run_python("pass", inprocess=True)),
                             ("python_exec", max(1, n // 5), lambda: pool.run_python("pass"))):
        for _ in range(10):
            run()
        times = []
        for _ in range(count):
            t = time.perf_counter()
            res = run()
            times.append(time.perf_counter() - t)
            assert res.status == "ok", res
        out[name] = statistics.median(times) * 1e3
print(json.dumps(out))
'''


def _time_tree(tree: str, executions: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.run([sys.executable, "-c", _TIMER, str(executions)], cwd=tree, env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare_sandbox(args: argparse.Namespace, log=print) -> dict[str, Any]:
    before = tempfile.mkdtemp(prefix="rlcode_rev_")
    _git("worktree", "add", "--detach", before, args.rev)
    rounds: dict[str, list[dict[str, float]]] = {"before": [], "now": []}
    try:
        for r in range(args.rounds):
            order = ("before", "now") if r % 2 == 0 else ("now", "before")
            for which in order:
                rounds[which].append(_time_tree(before if which == "before" else ROOT, args.executions))
                log(f"round {r + 1}/{args.rounds} {which:6s} " + "  ".join(
                    f"{k} {v:.2f} ms" for k, v in rounds[which][-1].items()))
    finally:
        _git("worktree", "remove", "--force", before)
    medians = {w: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for w, rs in rounds.items()}
    ratio = {k: medians["now"][k] / medians["before"][k] for k in medians["now"]}
    return {"rounds": rounds, "median_ms": medians, "now_over_before": ratio}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        _git("cat-file", "-e", f"{args.rev}^{{commit}}")
    except subprocess.CalledProcessError:
        print(f"revision {args.rev} is not in this repository's history (a shallow clone? "
              "git fetch --unshallow)", file=sys.stderr)
        return 2
    out = args.out or os.path.join("runs", "compare_revision", f"{args.what}.json")
    start = time.monotonic()
    record = compare_graders(args) if args.what == "graders" else compare_sandbox(args)
    record.update(command=shlex.join(["python", "-m", "experiments.compare_revision",
                                      *(sys.argv[1:] if argv is None else argv)]),
                  rev=args.rev, seconds=round(time.monotonic() - start, 1))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    if args.what == "sandbox":
        print("\nprogram            before (ms)  now (ms)  now / before")
        for k, ratio in record["now_over_before"].items():
            print(f"{k:18s} {record['median_ms']['before'][k]:11.2f} {record['median_ms']['now'][k]:9.2f} "
                  f"{ratio:12.3f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
