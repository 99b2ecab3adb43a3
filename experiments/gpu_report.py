"""Summarise a run of experiments/gpu_check.sh, and publish it deliberately.

    python -m experiments.gpu_report RUN_DIR             # RUN_DIR/gpu_kernel_tests.json
    python -m experiments.gpu_report RUN_DIR --publish   # also results/gpu_*.json, docs/figures/gpu_*.png

RUN_DIR is the directory gpu_check.sh wrote (kernel_tests.xml, stages.log, gpu_bench_*.json).
The kernel tests' JUnit XML becomes one JSON record: the environment lines of stages.log (GPU,
driver, jax / triton / jax-triton versions, how the kernels were launched), the counts, and every
test case with its outcome, time and, for a failure, the first line of its message. Nothing is
written under results/ or docs/figures/ without --publish; with it, the summary and both benchmark
JSONs are copied to results/ and the benchmark figures are redrawn from them into docs/figures/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import xml.etree.ElementTree as ET

from experiments.cli import summary

BENCHES = ("gpu_bench_attention", "gpu_bench_moe")


def kernel_tests_summary(xml_path: str, stages_log: str | None = None) -> dict:
    """The JUnit XML of the kernel tests (and the environment lines of stages.log) as a dict."""
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    cases, counts = [], {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for suite in suites:
        for case in suite.iter("testcase"):
            outcome, message = "passed", None
            for tag in ("failure", "error", "skipped"):
                found = case.find(tag)
                if found is not None:
                    outcome = "failed" if tag == "failure" else tag
                    message = ((found.get("message") or found.text or "").strip().splitlines() or [""])[0][:300]
                    break
            counts[outcome] += 1
            case_record = dict(test=f"{case.get('classname')}::{case.get('name')}", outcome=outcome,
                               time_s=float(case.get("time") or 0.0))
            if message:
                case_record["message"] = message
            cases.append(case_record)
    environment = []
    if stages_log and os.path.exists(stages_log):
        with open(stages_log) as f:
            environment = [line.rstrip("\n") for line in f if not line.startswith("==")]
    return dict(
        environment=environment,
        timestamp=suites[0].get("timestamp") if suites else None,
        wall_s=sum(float(s.get("time") or 0.0) for s in suites),
        counts=counts,
        total=len(cases),
        cases=cases,
    )


def publish(run_dir: str, root: str = ".") -> list[str]:
    """Copy the summary and the benchmark JSONs into results/ and redraw their figures into
    docs/figures/; returns the paths written. A benchmark missing from run_dir is left as it was."""
    from experiments.figures import script  # imports each benchmark without clashing flags

    written = []
    names = ["gpu_kernel_tests"] + [b for b in BENCHES if os.path.exists(os.path.join(run_dir, b + ".json"))]
    for name in names:
        dest = os.path.join(root, "results", name + ".json")
        shutil.copyfile(os.path.join(run_dir, name + ".json"), dest)
        written.append(dest)
    for name, module in zip(BENCHES, (script("bench_attention"), script("bench_moe"))):
        if name in names:
            with open(os.path.join(run_dir, name + ".json")) as f:
                record = json.load(f)
            png = os.path.join(root, "docs", "figures", name + ".png")
            module.plot(record["rows"], png, backend=f"{record['device']} ({record['backend']})")
            written.append(png)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=summary(__doc__))
    parser.add_argument("run_dir", help="the directory experiments/gpu_check.sh wrote")
    parser.add_argument("--publish", action="store_true",
                        help="copy the results to results/gpu_*.json and redraw docs/figures/gpu_*.png")
    args = parser.parse_args(argv)
    xml = os.path.join(args.run_dir, "kernel_tests.xml")
    if not os.path.exists(xml):
        print(f"error: {xml} not found (did the kernel_tests stage of gpu_check.sh run?)", file=sys.stderr)
        return 2
    record = kernel_tests_summary(xml, os.path.join(args.run_dir, "stages.log"))
    out = os.path.join(args.run_dir, "gpu_kernel_tests.json")
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    c = record["counts"]
    print(f"kernel tests: {c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped "
          f"in {record['wall_s']:.0f} s -> {out}")
    for case in record["cases"]:
        if case["outcome"] in ("failed", "error"):
            print(f"  {case['outcome']}: {case['test']}: {case.get('message', '')}")
    if args.publish:
        for path in publish(args.run_dir):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
