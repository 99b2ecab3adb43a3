"""experiments.gpu_report: the kernel tests' JUnit XML as JSON, and nothing published without
--publish."""

import json
import os

from experiments import gpu_report

XML = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest"
errors="1" failures="1" skipped="1" tests="4" time="12.5" timestamp="2026-01-01T00:00:00">
<testcase classname="tests.kernels.test_flash" name="test_a[xla]" time="1.5" />
<testcase classname="tests.kernels.test_flash" name="test_b" time="2.0"><failure message="AssertionError: not close&#10;detail">trace</failure></testcase>
<testcase classname="tests.kernels.test_nsa" name="test_c" time="0.1"><skipped message="CPU dispatch rule" /></testcase>
<testcase classname="tests.kernels.test_nsa" name="test_d" time="0.2"><error message="fixture broke">trace</error></testcase>
</testsuite></testsuites>"""


def test_summary_counts_every_outcome_and_keeps_the_environment(tmp_path):
    (tmp_path / "kernel_tests.xml").write_text(XML)
    (tmp_path / "stages.log").write_text("NVIDIA H200, 580\njax 0.11.2\n== 10:00:00 kernel_tests: start\n")
    s = gpu_report.kernel_tests_summary(str(tmp_path / "kernel_tests.xml"), str(tmp_path / "stages.log"))
    assert s["counts"] == {"passed": 1, "failed": 1, "error": 1, "skipped": 1} and s["total"] == 4
    assert s["environment"] == ["NVIDIA H200, 580", "jax 0.11.2"] and s["wall_s"] == 12.5
    by_test = {c["test"]: c for c in s["cases"]}
    assert by_test["tests.kernels.test_flash::test_b"] == dict(
        test="tests.kernels.test_flash::test_b", outcome="failed", time_s=2.0, message="AssertionError: not close")
    assert by_test["tests.kernels.test_nsa::test_c"]["message"] == "CPU dispatch rule"
    assert "message" not in by_test["tests.kernels.test_flash::test_a[xla]"]


def test_cli_writes_into_the_run_dir_only_and_names_a_missing_xml(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a publish would write results/ here
    assert gpu_report.main([str(tmp_path)]) == 2
    assert "kernel_tests.xml not found" in capsys.readouterr().err
    (tmp_path / "kernel_tests.xml").write_text(XML)
    assert gpu_report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 passed, 1 failed, 1 errors, 1 skipped" in out and "failed: tests.kernels.test_flash::test_b" in out
    assert json.loads((tmp_path / "gpu_kernel_tests.json").read_text())["total"] == 4
    assert not os.path.exists(tmp_path / "results")


def test_publish_copies_the_results_and_draws_the_figures(tmp_path):
    run, root = tmp_path / "run", tmp_path / "root"
    run.mkdir()
    for d in ("results", "docs/figures"):
        (root / d).mkdir(parents=True)
    (run / "gpu_kernel_tests.json").write_text(json.dumps({"counts": {}}))
    rows = [dict(T=t, variant=v, op=v.split("_")[0], impl=("cudnn" if v.endswith("cudnn") else "xla"), mode=m,
                 median_s=1e-3 * t / 512, temp_bytes=2**20) for t in (512, 1024) for v in ("dense", "dense_cudnn")
            for m in ("fwd", "fwdbwd")]
    rows.append(dict(T=1024, variant="nsa_triton", op="nsa", impl="triton", mode="fwd", failed="CompilationError: x"))
    (run / "gpu_bench_attention.json").write_text(json.dumps(dict(device="GPU X", backend="gpu", rows=rows)))
    written = gpu_report.publish(str(run), root=str(root))
    assert sorted(os.path.relpath(p, root) for p in written) == [
        "docs/figures/gpu_bench_attention.png", "results/gpu_bench_attention.json", "results/gpu_kernel_tests.json"]
    assert (root / "docs/figures/gpu_bench_attention.png").stat().st_size > 10_000
