"""The attention benchmark runs end to end at small sizes and writes its table, JSON and PNG."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_bench_attention_quick(tmp_path):
    path = tmp_path / "bench.json"
    out = subprocess.run(
        [sys.executable, "-m", "experiments.bench_attention", "--quick", "--lengths=512", "--modes=fwd,fwdbwd",
         "--repeats=1", f"--out={path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "summary" in out.stdout and "vs dense" in out.stdout
    result = json.loads(path.read_text())
    rows = {(r["T"], r["mode"], r["variant"]): r for r in result["rows"]}
    for mode in ("fwd", "fwdbwd"):
        for variant in ("dense", "flash", "nsa", "squid", "prefill_docs", "prefill_dense"):
            row = rows[(512, mode, variant)]
            assert row["median_s"] > 0 and row["speedup_vs_dense"] > 0, row
        assert rows[(512, mode, "dense")]["speedup_vs_dense"] == 1.0
    assert (tmp_path / "bench.png").stat().st_size > 10_000
