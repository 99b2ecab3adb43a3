#!/usr/bin/env bash
# The GPU check of the kernels, in one command on a CUDA machine with jax (CUDA build), triton and
# jax-triton importable:
#
#     bash experiments/gpu_check.sh OUT_DIR
#
# 1. every kernel test (tests/kernels, all cases), with the Triton kernels compiled through
#    jax-triton (kernels._triton.configure() picks compiled launches on a CUDA backend);
# 2. experiments.bench_attention: XLA, Triton and cuDNN faces, bf16, up to T = 65,536;
# 3. experiments.bench_moe: XLA and Triton faces, bf16, the default sizes.
#
# STAGES (environment) selects a subset of the three. Each stage has its own time limit (seconds,
# from the environment: TESTS_S, ATTENTION_S, MOE_S) so a stage that hangs or runs long cannot
# starve the others; each writes its log, and the benchmarks their JSON (bench_attention after
# every length), into OUT_DIR (the figures into FIGURES_DIR, default OUT_DIR); stages.log has the
# environment and each stage's exit status.
# The exit status is that of the first stage that failed (0 when all passed). Results stay in
# OUT_DIR (the kernel tests also summarised as gpu_kernel_tests.json); publishing them is a
# separate, deliberate step: python -m experiments.gpu_report OUT_DIR --publish.
set -uo pipefail
out=${1:?usage: bash experiments/gpu_check.sh OUT_DIR}
mkdir -p "$out"
figures=${FIGURES_DIR:-$out}  # the PNGs (redrawn from the JSON by experiments.figures)
mkdir -p "$figures"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
note() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$out/stages.log"; }
run_stage() {  # run_stage NAME SECONDS COMMAND...
    local name=$1 limit=$2 rc
    shift 2
    note "$name: start (limit ${limit}s)"
    timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    tail -n 60 "$out/$name.log"
    note "$name: exit $rc"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 - <<'EOF'
import importlib.metadata as md
import jax
for name in ("jax", "jaxlib", "triton", "jax-triton", "flax"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
print("devices", jax.devices())
from kernels import _triton
_triton.configure()
print("triton kernels:", _triton.available() or "compiled through jax-triton")
EOF
} 2>&1 | tee -a "$out/stages.log"

per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=90)
stages=" ${STAGES:-kernel_tests bench_attention bench_moe} "  # a subset, e.g. STAGES=bench_moe
stage() {  # stage NAME SECONDS COMMAND...: run it if STAGES names it
    [[ $stages == *" $1 "* ]] || { note "$1: not selected"; return; }
    run_stage "$@"
}
stage kernel_tests "${TESTS_S:-220}" python3 -m pytest -v --slow -n "${TEST_WORKERS:-8}" -p no:cacheprovider \
    "${per_test[@]}" --junitxml="$out/kernel_tests.xml" -rfEs tests/kernels
stage bench_attention "${ATTENTION_S:-200}" python3 -m experiments.bench_attention --impls=xla,triton,cudnn \
    --dtype=bfloat16 --lengths="${ATTENTION_LENGTHS:-4096,16384,65536}" --repeats=5 --max_dense_bytes=${MAX_DENSE_BYTES:-8e10} \
    --out="$out/gpu_bench_attention.json" --png="$figures/gpu_bench_attention.png"
stage bench_moe "${MOE_S:-110}" python3 -m experiments.bench_moe --impls=xla,triton --dtype=bfloat16 --repeats=5 \
    --out="$out/gpu_bench_moe.json" --png="$figures/gpu_bench_moe.png"
if [ -f "$out/kernel_tests.xml" ]; then
    python3 -m experiments.gpu_report "$out" | tee -a "$out/stages.log"  # -> gpu_kernel_tests.json
fi
exit $status
