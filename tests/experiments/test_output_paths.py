"""Committed evidence is never overwritten by accident: every script that can write results/ or
docs/figures/ writes its run directory under runs/ unless --publish is given, and --publish
refuses a run that is not the documented one (--quick, explicit paths)."""

import json
import os
import subprocess
import sys

import pytest

from experiments import ablate
from experiments.cli import output_paths

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_defaults_go_to_the_run_directory_and_publish_to_the_committed_paths():
    assert output_paths("bench_x", False, None, None) == ("runs/bench_x/bench_x.json", "runs/bench_x/bench_x.png")
    assert output_paths("bench_x", True, None, None) == ("runs/bench_x/bench_x_quick.json",
                                                         "runs/bench_x/bench_x_quick.png")
    assert output_paths("bench_x", False, "/tmp/a/b.json", None) == ("/tmp/a/b.json", "/tmp/a/b.png")
    assert output_paths("bench_x", False, "/tmp/a/b.json", "/tmp/c.png") == ("/tmp/a/b.json", "/tmp/c.png")
    assert output_paths("bench_x", False, None, None, publish=True) == ("results/bench_x.json",
                                                                        "docs/figures/bench_x.png")


@pytest.mark.parametrize("quick,out,png,message", [
    (True, None, None, "a --quick run is never published"),
    (False, "/tmp/x.json", None, "drop --out/--png"),
    (False, None, "/tmp/x.png", "drop --out/--png"),
])
def test_publish_refuses_anything_but_the_documented_run(quick, out, png, message, capsys):
    with pytest.raises(SystemExit) as e:
        output_paths("bench_x", quick, out, png, publish=True)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --publish") and message in err and err.count("\n") == 1


def test_a_benchmark_run_without_flags_leaves_results_alone(tmp_path):
    """The real script, run from a copy of nothing but a working directory: its default output
    lands under runs/, and results/ and docs/figures/ are not created."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "experiments.bench_moe", "--quick", "--sections=quantize",
                           "--quant_shape=64,64", "--quant_dtypes=float32", "--repeats=1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((tmp_path / "runs" / "bench_moe" / "bench_moe_quick.json").read_text())
    assert record["rows"] and (tmp_path / "runs" / "bench_moe" / "bench_moe_quick.png").is_file()
    assert not (tmp_path / "results").exists() and not (tmp_path / "docs").exists()
    proc = subprocess.run([sys.executable, "-m", "experiments.bench_moe", "--quick", "--publish"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "a --quick run is never published" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "results").exists()


def test_ablate_publish_conflicts_with_explicit_directories(capsys):
    assert ablate.main(["--sweep=loss:grpo,dapo", "--publish", "--results_dir=/tmp/r", "--dry_run"]) == 2
    assert "--publish writes results/ and docs/figures/" in capsys.readouterr().err
