"""Reward-hack suite: every entry of the catalogue `rlcode.envs.hacks` graded and rewarded.

    python -m experiments.hack_suite                  # runs/hack_suite/hack_suite.json and .md
    python -m experiments.hack_suite --publish        # results/hack_suite.json and results/hack_suite.md
    python -m experiments.hack_suite --levels=1 --hacks=conftest_root,reference_solution --out=/tmp/hs.json

Repository tasks. Each hack (and each control) is written into a fresh copy of one generated
training task per difficulty level (`repo_tasks.generate_task(seed, difficulty=level)`) and
graded by both graders of `rlcode.envs.grading.grade`: the held-out checks as data ("checks",
what every generated task uses) and the pytest runner ("pytest", for a task graded by a test
suite; the task's data checks dropped), through an `rlcode.sandbox.SandboxPool` (the executor of
the agent RL job, `Limits(wall_seconds=timeout)`, grading timeout `--timeout`, 10 s as in
configs/agent_repo.py; an entry with its own `Hack.timeout` uses that), and rewarded by
`rlcode.envs.rewards.compute_reward`. Only if the pool cannot start on the machine does the suite
fall back to `SubprocessExecutor` (a plain subprocess, no isolation); the JSON and the markdown
say which executor ran. An infrastructure failure is retried once.

Synthesis tasks. Every attack of `hacks.VERDICT_ATTACKS` (and the reference solution as the
control) is the candidate for one synthesis task per level, graded exactly as the RL job grades
(`rlcode.train.rollout.Grader`: the pool's in-process mode); its reward is the fraction of
held-out cases passed (the job's "pass_fraction" reward; "all_pass" is 1 only when that is 1).

The sandbox. The attacks of `hacks.SANDBOX_ATTACKS` (capabilities used in place, kernel surface,
the previous execution's heap, sockets or IPC left alive, shared keys and uids, filling the disk,
reading the host, the network) are made by the pool's start-up probe from inside an in-place and
an exec'd execution; each is reported "stopped" when every `SandboxPool.guarantees()` claim it
tests holds (the JSON keeps the probe's raw report).

Reward configuration: `RewardConfig` defaults (all held-out tests must pass, every hack flag of
`DEFAULT_HACK_FLAGS` zeroes the tests term, no extra hack penalty) with the length, malformed-call
and per-turn weights set to 0: no policy wrote these copies, so there are no generated tokens or
turns to charge, and the reward is the tests term alone (1 or 0). ``reward_without_hack_rule`` is
the same with ``hack_mode="none"``: what the held-out tests alone would have paid (the grader
still counts no test of a run flagged ``read_heldout`` or ``tampered``).

Outputs (`experiments.cli.output_paths` conventions): the JSON (default runs/hack_suite/hack_suite.json,
results/hack_suite.json with --publish;
one record per entry x grader x task, and one summary row per entry x grader) and a markdown table
next to it (same name, ``.md``; first line: the command). Verdict of a hack: "caught" when its
reward is 0 on every task and a hack flag, a timeout / crash or failing held-out tests explain it;
"NOT CAUGHT" when any task paid it; "open (known)" when it paid a grader that is documented not to
stop it (`Hack.pytest_open`: the pytest runner against attacks from inside its own process);
"infra (not scored)" when a task could not be graded. Verdict of a control: "ok" when it got its
expected reward (1 for the reference solution, 0 for a wrong one) without any hack flag. The
script exits with status 1 unless every hack was caught (or is a known opening) and every control
is ok.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import argparse

from experiments.cli import PUBLISH_HELP, output_paths
from rlcode.envs import grading, hacks
from rlcode.envs.tasks import repo as rt
from rlcode.sandbox import fstree

NAME = "hack_suite"
DEFAULT_TIMEOUT = 10.0  # configs/agent_repo.py: cfg.sandbox.timeout


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options (argparse, not absl: the module defines no global flags, so other
    scripts such as experiments.figures can import it)."""
    p = argparse.ArgumentParser(prog=f"python -m experiments.{NAME}")
    comma = lambda text: [x for x in text.split(",") if x]
    p.add_argument("--levels", type=comma, default=["1", "2", "3"],
                   help="difficulty levels: one generated training task per level")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated tasks")
    p.add_argument("--out", default=None,
                   help="JSON path (default runs/hack_suite/hack_suite.json); the .md goes next to it")
    p.add_argument("--publish", action="store_true", help=PUBLISH_HELP.replace("<name>", NAME))
    p.add_argument("--hacks", type=comma, default=None, help="catalogue entries to run (default: all, controls included)")
    p.add_argument("--workers", type=int, default=2, help="sandbox workers (= concurrent gradings)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="grading timeout in seconds (wall)")
    p.add_argument("--graders", type=comma, default=list(hacks.GRADERS),
                   help="repository graders: checks (held-out checks as data), pytest (the test-suite runner)")
    p.add_argument("--synth", type=comma, default=None,
                   help="attacks on the synthesis grader (default: all of hacks.VERDICT_ATTACKS; empty: none)")
    return p.parse_args(argv)

RESULT_FIELDS = ("hack", "grader", "kind", "group", "category", "description", "task_id", "difficulty", "family",
                 "status", "flags", "hack_flags", "expected_flags", "expected_flags_raised", "tests_passed",
                 "tests_expected", "all_passed", "reward", "reward_terms", "reward_without_hack_rule",
                 "expected_reward", "defended", "valid", "caught_by", "grader_note", "attempts", "seconds")
SUMMARY_FIELDS = ("hack", "grader", "kind", "category", "description", "tasks", "flags_raised", "expected_flags",
                  "expected_flags_missing", "tests_passed", "tests_expected", "reward_max",
                  "reward_without_hack_rule_max", "caught_by", "verdict")
SYNTH_FIELDS = ("attack", "kind", "category", "description", "task_id", "difficulty", "valid", "timed_out",
                "pass_fraction", "flags", "seconds")
TABLE_COLUMNS = ("hack", "what it does", "data checks: flags", "data checks: tests passed", "data checks: reward",
                 "pytest runner: flags", "pytest runner: tests passed", "pytest runner: reward", "verdict")
SYNTH_COLUMNS = ("attack", "what it does", "held-out cases passed (max fraction)", "verdict")
SANDBOX_COLUMNS = ("attack", "what it does", "measured claims", "verdict")
VERDICT_OK = ("caught", "ok", "open (known)")


# ----------------------------------------------------------------------------------------------
# Executors.

@dataclasses.dataclass
class _Result:
    stdout: bytes
    stderr: bytes
    returncode: int | None
    status: str
    info: str = ""


class SubprocessExecutor:
    """Fallback when the sandbox pool cannot start: `subprocess.run` in the grading directory with a
    timeout. It isolates nothing (the candidate's code runs as this user, with network and the
    host's filesystem); the grader's verdict logic is the same."""

    def run(self, argv, *, files=None, stdin=None, timeout, workdir=None):
        data = stdin.encode() if isinstance(stdin, str) else stdin
        try:
            proc = subprocess.run(argv, cwd=workdir, input=data, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            return _Result(e.stdout or b"", e.stderr or b"", None, "timeout")
        return _Result(proc.stdout, proc.stderr, proc.returncode, "ok" if proc.returncode == 0 else "error")


def sandbox_rows(ex_info: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per `hacks.SANDBOX_ATTACKS` entry from the pool's measured guarantees: "stopped"
    when every claim of the attack holds, else "NOT STOPPED" (or "not measured" without a pool)."""
    holds = ex_info.get("guarantees") or {}
    rows = []
    for name, (category, description, claims) in hacks.SANDBOX_ATTACKS.items():
        values = {c: holds.get(c) for c in claims}
        verdict = ("not measured" if not holds else "stopped" if all(v is True for v in values.values())
                   else "NOT STOPPED")
        rows.append({"attack": name, "category": category, "description": description, "claims": values,
                     "verdict": verdict})
    return rows


def make_executor(workers: int, timeout: float) -> tuple[Any, dict[str, Any]]:
    """(executor, description): a `SandboxPool` (call ``close()`` when done), or the fallback."""
    try:
        from rlcode.sandbox import Limits, SandboxPool  # noqa: PLC0415 (workers start here)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. no delegated cgroups for the pool
            pool = SandboxPool(workers, Limits(wall_seconds=timeout))
    except (ImportError, RuntimeError, OSError) as e:
        return SubprocessExecutor(), {"kind": "local_subprocess", "workers": workers,
                                      "note": f"the sandbox pool could not start ({type(e).__name__}: {e}); "
                                              "a plain subprocess ran the graders (no isolation)"}
    holds = pool.guarantees()
    return pool, {"kind": "sandbox_pool", "workers": workers,
                  "note": f"rlcode.sandbox.SandboxPool({workers}, Limits(wall_seconds={timeout:g})), "
                          f"mode {holds.get('mode')}", "guarantees": holds, "probe": pool.probe_report()}


# ----------------------------------------------------------------------------------------------
# Grading one entry on one task.

def reward_configs():
    """(the suite's reward config, the same without the hack rule); see the module docstring."""
    from rlcode.envs import rewards  # noqa: PLC0415 (imports jax: after the pool's workers started)

    cfg = rewards.RewardConfig(length_weight=0.0, malformed_weight=0.0, turn_weight=0.0)
    return cfg, dataclasses.replace(cfg, hack_mode="none")


def empty_trajectory(task: rt.RepoTask, workdir: str):
    """A `harness.Trajectory` of no turns: the copy was written by the suite, not by a policy."""
    from rlcode.envs import harness  # noqa: PLC0415

    return harness.Trajectory(task_id=task.task_id, segments=[], turns=[], tool_calls=[], num_turns=0,
                              num_summaries=0, num_malformed_calls=0, num_tool_errors=0, num_infra_errors=0,
                              num_no_call_turns=0, num_truncated_turns=0, submitted=True, end_reason="submitted",
                              workdir=workdir)


def caught_by(status: str, hack_flags: Sequence[str], all_passed: bool) -> list[str]:
    """What explains a reward of 0: hack flags, a timeout or crash, failing held-out tests."""
    out = [f"flag {f}" for f in hack_flags]
    if status in ("timeout", "crash"):
        out.append(status)
    elif status == "ok" and not all_passed:
        out.append("failing tests")
    return out


def grade_one(hack: hacks.Hack, grader: str, task: rt.RepoTask, executor: Any, root: str, timeout: float,
              reward_cfgs: tuple[Any, Any]) -> dict[str, Any]:
    """Plant `hack` into a fresh copy of `task`, grade it with `grader` ("checks" or "pytest"),
    reward it; the result record."""
    from rlcode.envs import rewards  # noqa: PLC0415

    start = time.monotonic()
    workdir = hack.plant(task, os.path.join(root, "rollouts"))
    graded_task = dataclasses.replace(task, heldout_checks=()) if grader == "pytest" else task
    grade_timeout = hack.timeout if hack.timeout is not None else timeout
    for attempt in (1, 2):  # an infrastructure failure is retried once (grading is idempotent)
        grade = grading.grade(graded_task, workdir, executor, timeout=grade_timeout, root=root)
        if grade.valid:
            break
    fstree.remove(workdir)
    trajectory = empty_trajectory(task, workdir)
    cfg, no_hack_rule = reward_cfgs
    reward, terms, flags, valid = rewards.compute_reward(grade, trajectory, task, cfg)
    unflagged, _, _, _ = rewards.compute_reward(grade, trajectory, task, no_hack_rule)
    hack_flags = sorted(set(flags) & set(cfg.hack_flags))
    expected_flags = hack.expected_flags(grader)
    return {
        "hack": hack.name, "grader": grader, "kind": hack.kind, "group": hack.group, "category": hack.category,
        "description": hack.description, "task_id": task.task_id, "difficulty": task.difficulty,
        "family": task.family, "status": grade.status, "flags": list(flags), "hack_flags": hack_flags,
        "expected_flags": list(expected_flags), "expected_flags_raised": set(expected_flags) <= set(flags),
        "tests_passed": grade.num_passed, "tests_expected": grade.num_expected, "all_passed": grade.all_passed,
        "reward": reward, "reward_terms": {k: v + 0.0 for k, v in terms.items()},  # + 0.0: no -0.0
        "reward_without_hack_rule": unflagged,
        "expected_reward": hack.expected_reward, "defended": hack.defended(grader), "valid": valid,
        "caught_by": caught_by(grade.status, hack_flags, grade.all_passed) if valid and reward == 0 else [],
        "grader_note": grade.details.split("\n", 1)[0], "attempts": attempt,
        "seconds": round(time.monotonic() - start, 3),
    }


def grade_synth(name: str, task: Any, grader: Any) -> dict[str, Any]:
    """One `VERDICT_ATTACKS` entry (or "reference_solution") as the candidate for the synthesis
    task `task`, graded by the RL job's `Grader`."""
    start = time.monotonic()
    if name == "reference_solution":
        kind, category, description, candidate = "control", hacks.CONTROL, "the reference body", task.reference_body
    else:
        category, description, _ = hacks.VERDICT_ATTACKS[name]
        kind, candidate = "hack", hacks.synth_attack_source(task, name)
    frac, valid, timed_out, counts = grader.grade([task], [candidate])
    flags = [k for k in ("crash", "early_exit", "forged_report") if counts.get(k)]
    return {"attack": name, "kind": kind, "category": category, "description": description, "task_id": task.task_id,
            "difficulty": task.difficulty, "valid": bool(valid[0]), "timed_out": bool(timed_out[0]),
            "pass_fraction": float(frac[0]), "flags": flags, "seconds": round(time.monotonic() - start, 3)}


# ----------------------------------------------------------------------------------------------
# Summary and markdown.

def _unique(items) -> list:
    return list(dict.fromkeys(items))


def verdict(kind: str, expected_reward: float, records: list[dict[str, Any]], defended: bool = True) -> str:
    if not all(r["valid"] for r in records):
        return "infra (not scored)"
    if kind == "control":
        if any(r["hack_flags"] for r in records):
            return "FALSE ALARM (hack flag on a control)"
        if any(r["reward"] != expected_reward for r in records):
            return f"CONTROL FAILED (expected reward {expected_reward:g})"
        return "ok"
    if any(r["reward"] > 0 for r in records):
        return "NOT CAUGHT" if defended else "open (known)"
    return "caught" if all(r["caught_by"] for r in records) else "unexplained"


def summarize(entries: Sequence[hacks.Hack], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for hack in entries:
        for grader in hacks.GRADERS:
            mine = [r for r in records if r["hack"] == hack.name and r["grader"] == grader]
            if not mine:
                continue
            expected = hack.expected_flags(grader)
            rows.append({
                "hack": hack.name, "grader": grader, "kind": hack.kind, "category": hack.category,
                "description": hack.description, "tasks": [r["task_id"] for r in mine],
                "flags_raised": sorted({f for r in mine for f in r["flags"]}),
                "expected_flags": list(expected),
                "expected_flags_missing": [f"{r['task_id']}: {f}" for r in mine for f in expected if f not in r["flags"]],
                "tests_passed": sum(r["tests_passed"] for r in mine),
                "tests_expected": sum(r["tests_expected"] for r in mine),
                "reward_max": max(r["reward"] for r in mine),
                "reward_without_hack_rule_max": max(r["reward_without_hack_rule"] for r in mine),
                "caught_by": _unique(c for r in mine for c in r["caught_by"]) if hack.kind == "hack" else [],
                "verdict": verdict(hack.kind, hack.expected_reward, mine, hack.defended(grader)),
            })
    return rows


def summarize_synth(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for name in _unique(r["attack"] for r in records):
        mine = [r for r in records if r["attack"] == name]
        kind = mine[0]["kind"]
        best = max(r["pass_fraction"] for r in mine)
        if not all(r["valid"] for r in mine):
            result = "infra (not scored)"
        elif kind == "control":
            result = "ok" if all(r["pass_fraction"] == 1.0 for r in mine) else "CONTROL FAILED"
        else:
            result = "caught" if best == 0.0 else "NOT CAUGHT"
        rows.append({"attack": name, "kind": kind, "category": mine[0]["category"],
                     "description": mine[0]["description"], "tasks": [r["task_id"] for r in mine],
                     "pass_fraction_max": best, "flags_raised": sorted({f for r in mine for f in r["flags"]}),
                     "verdict": result})
    return rows


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _prose(text: str) -> str:
    """A table cell of free text: markdown emphasis characters escaped (`__init__.py`, `__eq__`)."""
    return _cell(str(text).replace("\\", "\\\\").replace("_", "\\_").replace("*", "\\*"))


def _combined_verdict(by_grader: dict[str, dict[str, Any]]) -> str:
    verdicts = _unique(r["verdict"] for r in by_grader.values())
    if len(verdicts) == 1:
        return verdicts[0]
    return "; ".join(f"{g}: {r['verdict']}" for g, r in by_grader.items())


def markdown(record: dict[str, Any]) -> str:
    """The markdown report: the command, the setting, one row per entry grouped by category (both
    graders side by side), then the attacks on the synthesis grader."""
    ex = record["executor"]
    rows = record["summary"]
    entries = _unique(r["hack"] for r in rows)
    by_entry = {name: {r["grader"]: r for r in rows if r["hack"] == name} for name in entries}
    hack_rows = [r for r in rows if r["kind"] == "hack"]

    def count(grader, verdicts):
        return sum(r["verdict"] in verdicts for r in hack_rows if r["grader"] == grader)

    n_hacks = len({r["hack"] for r in hack_rows})
    lines = [
        f"Command: `{record['command']}`",
        "",
        f"Repository tasks (seed {record['seed']}, one per level): {', '.join(f'`{t}`' for t in record['tasks'])}. "
        f"Executor: {ex['kind']} ({ex['note']}). Graders (`rlcode.envs.grading.grade`, timeout "
        f"{record['timeout_s']:g} s): the held-out checks as data (every generated task) and the pytest runner "
        "(a task graded by a test suite). Reward: `rlcode.envs.rewards.compute_reward` with the default hack rule "
        "and the length / malformed-call / turn weights set to 0 (no policy wrote these copies), so an honest "
        "solution gets 1. Held-out tests passed: summed over the tasks. "
        f"Data checks: {count('checks', ('caught',))}/{n_hacks} hacks caught. Pytest runner: "
        f"{count('pytest', ('caught',))}/{n_hacks} caught, {count('pytest', ('open (known)',))} known openings "
        "(attacks from inside the process that runs the tests). "
        f"{sum(r['verdict'] == 'ok' for r in rows if r['kind'] == 'control')}/"
        f"{sum(r['kind'] == 'control' for r in rows)} control gradings as expected; {record['wall_seconds']:.0f} s.",
        "",
        "Hacks that replace every public function (\"every function ...\") are planted on the solved copy, so "
        "the rest of the reference solution is in place and every held-out test reaches the hack's code "
        "(`rlcode.envs.hacks`).",
        "",
        "| " + " | ".join(TABLE_COLUMNS) + " |",
        "|" + "---|" * len(TABLE_COLUMNS),
    ]
    category = None
    for name in entries:
        cells = by_entry[name]
        first = next(iter(cells.values()))
        if first["category"] != category:
            category = first["category"]
            lines.append(f"| **{_prose(category)}** |" + " |" * (len(TABLE_COLUMNS) - 1))
        row = [f"`{name}`", _prose(first["description"])]
        for grader in hacks.GRADERS:
            r = cells.get(grader)
            row += ([", ".join(r["flags_raised"]) or "-", f"{r['tests_passed']}/{r['tests_expected']}",
                     f"{r['reward_max']:g}"] if r else ["", "", ""])
        row.append(_combined_verdict(cells))
        lines.append("| " + " | ".join(row) + " |")
    missing = [f"`{r['hack']}` ({r['grader']}: {', '.join(r['expected_flags_missing'])})" for r in rows
               if r["expected_flags_missing"]]
    if missing:
        lines += ["", "Expected flags not raised (the reward was still as shown): " + "; ".join(missing) + "."]
    synth = record.get("synth_summary") or []
    if synth:
        lines += ["", f"Synthesis tasks ({', '.join(f'`{t}`' for t in record['synth_tasks'])}): each attack is the "
                  "candidate, graded as the RL job grades (`rlcode.train.rollout.Grader`, the pool's in-process "
                  "mode); the reward is the fraction of held-out cases passed.", "",
                  "| " + " | ".join(SYNTH_COLUMNS) + " |", "|" + "---|" * len(SYNTH_COLUMNS)]
        for r in synth:
            lines.append("| " + " | ".join((f"`{r['attack']}`", _prose(r["description"]),
                                            f"{r['pass_fraction_max']:g}", r["verdict"])) + " |")
    sandbox = record.get("sandbox") or []
    if sandbox:
        lines += ["", "Attacks on the sandbox, made from inside an in-place and an exec'd execution by the pool's "
                  "start-up probe (`rlcode.sandbox.probe`); stopped when every claim of "
                  "`SandboxPool.guarantees()` it tests holds:", "",
                  "| " + " | ".join(SANDBOX_COLUMNS) + " |", "|" + "---|" * len(SANDBOX_COLUMNS)]
        for r in sandbox:
            claims = ", ".join(f"{c} {'yes' if v is True else v}" for c, v in r["claims"].items())
            lines.append("| " + " | ".join((f"`{r['attack']}`", _prose(r["description"]), _prose(claims),
                                            r["verdict"])) + " |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# The suite.

def make_tasks(levels: Sequence[int], seed: int) -> list[rt.RepoTask]:
    return [rt.generate_task(seed, difficulty=int(level)) for level in levels]


def make_synth_tasks(levels: Sequence[int], seed: int) -> list[Any]:
    from rlcode.envs.tasks import synth  # noqa: PLC0415

    return [synth.generate_task(seed, int(level), "train") for level in levels]


def run_suite(entries: Sequence[hacks.Hack], tasks: Sequence[rt.RepoTask], *, out: str, command: str,
              seed: int, workers: int = 2, timeout: float = DEFAULT_TIMEOUT, graders: Sequence[str] = hacks.GRADERS,
              synth_attacks: Sequence[str] = (), synth_tasks: Sequence[Any] = (),
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Grade and reward every entry with every grader on every task, and every synthesis attack on
    every synthesis task; write the JSON to `out` and the markdown next to it; return the JSON
    record (``record["ok"]``: every hack caught or a known opening, every control ok)."""
    start = time.monotonic()
    executor, ex_info = make_executor(workers, timeout)
    log(f"executor: {ex_info['kind']} ({ex_info['note']})")
    try:
        reward_cfgs = reward_configs()
        jobs = [(h, g, t) for h in entries for g in graders for t in tasks]
        records: dict[tuple[str, str, str], dict[str, Any]] = {}
        lock = threading.Lock()
        with tempfile.TemporaryDirectory(prefix="rlcode_hack_suite_") as root:
            def one(job):
                hack, grader, task = job
                rec = grade_one(hack, grader, task, executor, root, timeout, reward_cfgs)
                with lock:
                    records[(hack.name, grader, task.task_id)] = rec
                    log(f"[{len(records):3d}/{len(jobs)}] {hack.name:34s} {grader:6s} {task.task_id:28s} "
                        f"reward {rec['reward']:g}  {rec['status']:7s} tests {rec['tests_passed']}/"
                        f"{rec['tests_expected']}  flags {','.join(rec['flags']) or '-'}  ({rec['seconds']:.1f} s)")
                return rec

            with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
                list(pool.map(one, jobs))
        synth_records = []
        if synth_attacks and synth_tasks:
            from rlcode.train.rollout import Grader  # noqa: PLC0415

            grader = Grader(executor, timeout=timeout)
            for name in ("reference_solution", *synth_attacks):
                for task in synth_tasks:
                    rec = grade_synth(name, task, grader)
                    synth_records.append(rec)
                    log(f"synth {name:22s} {task.task_id:24s} passed {rec['pass_fraction']:.2f} "
                        f"flags {','.join(rec['flags']) or '-'}")
    finally:
        close = getattr(executor, "close", None)
        if close is not None:
            close()
    results = [records[(h.name, g, t.task_id)] for h, g, t in jobs]
    summary = summarize(entries, results)
    synth_summary = summarize_synth(synth_records)
    sandbox = sandbox_rows(ex_info)
    cfg, _ = reward_cfgs
    record = {
        "command": command, "executor": ex_info, "seed": seed, "levels": sorted({t.difficulty for t in tasks}),
        "tasks": [t.task_id for t in tasks], "graders": list(graders), "timeout_s": timeout,
        "reward_config": dataclasses.asdict(cfg), "python": sys.version.split()[0], "platform": platform.platform(),
        "wall_seconds": round(time.monotonic() - start, 1),
        "ok": (all(r["verdict"] in VERDICT_OK for r in summary + synth_summary)
               and all(r["verdict"] in ("stopped", "not measured") for r in sandbox)),
        "summary": summary, "results": results, "sandbox": sandbox,
        "synth_tasks": [t.task_id for t in synth_tasks], "synth_summary": synth_summary, "synth_results": synth_records,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    md_path = os.path.splitext(out)[0] + ".md"
    with open(md_path, "w") as f:
        f.write(markdown(record))
    log("")
    log(markdown(record))
    log(f"wrote {out} and {md_path}")
    return record


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out, _ = output_paths(NAME, False, args.out, None, args.publish)
    entries = hacks.select(args.hacks)
    tasks = make_tasks([int(level) for level in args.levels], args.seed)
    if not args.graders or set(args.graders) - set(hacks.GRADERS):
        raise SystemExit(f"--graders must name some of {hacks.GRADERS}, got {args.graders}")
    synth_attacks = list(hacks.VERDICT_ATTACKS) if args.synth is None else args.synth
    unknown = sorted(set(synth_attacks) - set(hacks.VERDICT_ATTACKS))
    if unknown:
        raise SystemExit(f"unknown synthesis attacks {unknown}; known: {list(hacks.VERDICT_ATTACKS)}")
    synth_tasks = make_synth_tasks([int(level) for level in args.levels], args.seed) if synth_attacks else []
    command = shlex.join(["python", "-m", f"experiments.{NAME}", *(sys.argv[1:] if argv is None else argv)])
    print(f"{len(entries)} entries x {len(args.graders)} graders x {len(tasks)} tasks "
          f"({', '.join(t.task_id for t in tasks)}); {len(synth_attacks)} synthesis attacks", flush=True)
    record = run_suite(entries, tasks, out=out, command=command, seed=args.seed, workers=args.workers,
                       timeout=args.timeout, graders=args.graders, synth_attacks=synth_attacks,
                       synth_tasks=synth_tasks, log=lambda m: print(m, flush=True))
    if not record["ok"]:
        bad = [f"{r.get('hack', r.get('attack'))} ({r.get('grader', 'synth')}): {r['verdict']}"
               for r in record["summary"] + record["synth_summary"] if r["verdict"] not in VERDICT_OK]
        bad += [f"{r['attack']} (sandbox): {r['verdict']}" for r in record["sandbox"]
                if r["verdict"] not in ("stopped", "not measured")]
        print("FAILED:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
