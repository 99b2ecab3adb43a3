"""experiments/bench_sandbox.py runs end to end at a small size and writes what it promises."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.slow
def test_bench_sandbox_quick(tmp_path):
    path = tmp_path / "bench.json"
    out = subprocess.run([sys.executable, "-m", "experiments.bench_sandbox", "--quick", "--workers=1",
                          "--cases=true,python", "--rounds=1", f"--out={path}"],
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
