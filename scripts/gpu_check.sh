#!/usr/bin/env bash
# One device call on the GPU machine: the CUDA test suite, the CUDA audit, then the benchmarks.
#   bash scripts/gpu_check.sh [tests|audit|bench|all] [extra pytest args]
# Results (logs, JUnit XML, audit report, benchmark JSON) land in $OUT (default ./gpu-results).
# Uses the machine's own torch/triton/pytest: nothing is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
OUT=${OUT:-gpu-results}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
step() { echo; echo "== $1 ($(date +%T))"; }

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/machine.txt"

status=0
if [[ $what == all || $what == tests ]]; then
  step "CUDA tests"
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -m "not slow and not benchmark" --backend cuda --backend cpu \
      -q -p no:cacheprovider --durations=15 --junitxml="$OUT/cuda-tests.xml" "$@" 2>&1 | tee "$OUT/cuda-tests.log" | tail -60
  status=$(( status | ${PIPESTATUS[0]} ))
fi
if [[ $what == all || $what == audit ]]; then
  step "CUDA audit"
  timeout "${AUDIT_TIMEOUT:-300}" python3 -m audit --backend cuda --out "$OUT/audit" 2>&1 | tail -60
  status=$(( status | ${PIPESTATUS[0]} ))
fi
if [[ $what == all || $what == bench ]] && [[ -f scripts/gpu_fused.sh ]]; then
  step "benchmarks"
  bash scripts/gpu_fused.sh 2>&1 | tail -80
  status=$(( status | ${PIPESTATUS[0]} ))
fi
step "done: status $status"
exit $status
