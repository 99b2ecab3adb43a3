"""experiments/bench_sandbox.py runs end to end at a small size and writes what it promises."""

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.slow
def test_bench_sandbox_quick(tmp_path):
    path = tmp_path / "bench.json"
    out = subprocess.run([sys.executable, "-m", "experiments.bench_sandbox", "--quick", "--workers=1",
                          "--cases=true,python,python_min", "--rounds=1", "--profile", f"--out={path}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "x fresh" in out.stdout
    result = json.loads(path.read_text())
    methods = {(r["case"], r["method"]) for r in result["rows"]}
    assert {("true", "pool"), ("true", "fresh"), ("python", "pool_inprocess"), ("python", "fresh")} <= methods
    for r in result["rows"]:
        assert r["n"] > 0 and r["execs_per_s"] > 0 and r["p50_ms"] <= r["p99_ms"], r
        assert r["speedup_vs_fresh"] > 0
    assert result["guarantees"]["environment_cleared"] is True
    if shutil.which("unshare"):
        assert ("python_min", "unshare_min") in methods
        assert all("speedup_vs_unshare_min" in r for r in result["rows"] if r["case"] == "python_min")
    # The profile: every process of the pool accounted, for both modes; the inits and programs do
    # most of the work, and every execution faults pages in them.
    prof = result["profile"]
    assert {(r["mode"], r["role"]) for r in prof} == {
        (m, role) for m in ("inprocess", "exec_python_min")
        for role in ("pool process", "worker", "zygote", "inits + programs")} | {
        (m, role) for m in ("fork_floor_one", "fork_floor_two") for role in ("parent", "children")}
    for mode in ("inprocess", "exec_python_min", "fork_floor_one", "fork_floor_two"):
        rows = {r["role"]: r for r in prof if r["mode"] == mode}
        assert abs(sum(r["share"] for r in rows.values()) - 1.0) < 1e-6
        forked = rows.get("inits + programs", rows.get("children"))
        assert forked["cpu_ms"] > 0 and forked["faults"] > 0
    # A grandchild as well faults in about twice the pages of one child.
    kids = {r["mode"]: r["faults"] for r in prof if r["role"] == "children"}
    assert 1.5 < kids["fork_floor_two"] / kids["fork_floor_one"] < 3.0, kids
    assert "ms CPU per execution in all" in out.stdout
