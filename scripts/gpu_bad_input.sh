#!/usr/bin/env bash
# Bad input on a CUDA GPU, for a lent H200: nothing malformed reaches a kernel, and what the
# checks cost. Uses the machine's own torch/triton/pytest (nothing installed).
#
#   bash scripts/gpu_bad_input.sh [STEP ...]    STEP: tests sanitize cost (default: all three)
#
#   tests     tests/test_bad_input.py and tests/test_input_validation.py on the cuda backend
#             (the rows that used to crash run in child processes), JUnit XML + log
#   sanitize  scripts/bad_input_gpu.py sanitize under compute-sanitizer memcheck: every
#             malformed call refused, valid calls right afterwards, and 0 sanitizer errors;
#             then the negative control (one wild index with the checks bypassed), which the
#             sanitizer must report, or the clean run above proved nothing
#   cost      the fused layer path at S=4096 (magi2-ep4-local): CUDA events, median after
#             warm-up, with the input checks and with them patched out; the checks' host time;
#             trusted vs validated tables; no host sync (torch.cuda.set_sync_debug_mode)
# Each step has a timeout (STEP_TIMEOUT_<step> seconds). Results land in $OUT (./gpu-bad-input).
set -uo pipefail
cd "$(dirname "$0")/.."
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(tests sanitize cost)
OUT=${OUT:-gpu-bad-input}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 scripts/wheel_view.py  # the suite as magi_moe.audit/.fuzz/.tests: nothing is installed here
unset TRITON_INTERPRET
limit() { local v="STEP_TIMEOUT_$1"; echo "${!v:-$2}"; }
status=0
note() { echo "$*" | tee -a "$OUT/summary.txt"; }

SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)

nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/machine.txt"

for step in "${steps[@]}"; do
  echo; echo "== $step ($(date +%T))"
  case $step in
    tests)
      timeout "$(limit tests 300)" python3 -m pytest -q -p no:cacheprovider -W ignore \
        --backend cuda --hypothesis-profile ci -m "not slow and not benchmark" \
        tests/test_bad_input.py tests/test_input_validation.py \
        --junitxml="$OUT/tests.xml" > "$OUT/tests.log" 2>&1
      rc=$?; tail -15 "$OUT/tests.log"; note "tests: exit $rc"; status=$((status | rc)) ;;
    sanitize)
      if [ -z "$SANITIZER" ]; then note "sanitize: compute-sanitizer not found"; status=1; continue; fi
      # no caching allocator: memcheck then sees the bounds of every tensor, not of a pool
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$(limit sanitize 240)" "$SANITIZER" --tool memcheck \
        --error-exitcode 3 python3 scripts/bad_input_gpu.py sanitize > "$OUT/sanitize.log" 2>&1
      rc=$?; tail -20 "$OUT/sanitize.log"
      grep -q "ERROR SUMMARY: 0 errors" "$OUT/sanitize.log" || rc=$((rc | 4))
      note "sanitize: exit $rc ($(grep -o 'ERROR SUMMARY: [0-9]* error[s]*' "$OUT/sanitize.log" | tail -1))"
      status=$((status | rc))
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$(limit control 120)" "$SANITIZER" --tool memcheck \
        python3 scripts/bad_input_gpu.py sanitize --control > "$OUT/control.log" 2>&1
      found=$(grep -o 'ERROR SUMMARY: [0-9]* error[s]*' "$OUT/control.log" | tail -1)
      tail -8 "$OUT/control.log"
      if grep -Eq "ERROR SUMMARY: [1-9]" "$OUT/control.log"; then
        note "control: the sanitizer saw the bypassed wild read ($found)"
      else
        note "control: FAIL, the sanitizer saw nothing (${found:-no summary})"; status=$((status | 8))
      fi ;;
    cost)
      timeout "$(limit cost 180)" python3 scripts/bad_input_gpu.py cost --json "$OUT/cost.json" \
        > "$OUT/cost.log" 2>&1
      rc=$?; cat "$OUT/cost.log"; note "cost: exit $rc"; status=$((status | rc)) ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
echo; cat "$OUT/summary.txt"; echo "== all steps: status $status"
exit $status
