"""The bf16 vs MXFP8 MoE training experiment runs end to end at a tiny size and logs both runs."""

import json
import os
import subprocess
import sys

import pytest

from rlcode.train.metrics import read_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_moe_precision_quick(tmp_path):
    out = tmp_path / "mp.json"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.moe_precision", "--quick", "--steps=6", "--eval_every=3",
         "--num_tasks=150", "--batch=4", "--seq=64", f"--workdir={tmp_path / 'runs'}", f"--out={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MXFP8 vs bf16" in proc.stdout
    record = json.loads(out.read_text())
    runs = {r["precision"]: r for r in record["runs"]}
    assert set(runs) == {"bf16", "mxfp8"}
    for name, run in runs.items():
        assert len(run["train_curve"]) == 6 and [s for s, _ in run["eval_curve"]] == [3, 6]
        scalars = read_scalars(tmp_path / "runs" / name)
        assert [s for s, _ in scalars["train/loss"]] == list(range(1, 7))
        assert "train/moe_aux_loss" in scalars and "eval/loss" in scalars
    # Same seed, same data, same initial parameters: the first losses agree to quantisation error
    # but are not identical (the MXFP8 path is really taken).
    first_bf16, first_mx = runs["bf16"]["train_curve"][0], runs["mxfp8"]["train_curve"][0]
    assert first_bf16 != first_mx and abs(first_bf16 - first_mx) < 0.05 * first_bf16
    assert abs(record["gap_final_eval"]) < 0.5
    assert (tmp_path / "mp.png").stat().st_size > 5_000
