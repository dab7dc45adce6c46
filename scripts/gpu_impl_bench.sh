#!/usr/bin/env bash
# An outside implementation's speed on a lent GPU, and where the fused layer's time goes:
#
#   scripts/gpu_impl_bench.sh [SPEC] [STEP...]
#
# SPEC: the implementation (default magi_moe.tests.outside_grouped_example:IMPL). Steps (default all):
#   bench    python -m magi_moe.bench --anchors --impl SPEC: it beside fused, fused-layer and the
#            plain PyTorch baseline, kernel and layer level, errors checked before timing
#   history  pytest-benchmark on the same cases: one run saved, a second compared with it
#   layer    the fused layer against its kernel: both timed in one run, each launch alone
#            (--breakdown: route = the layer's router, layer = the whole layer), and the
#            layer's kernels by torch.profiler
# Results go to $OUT (or ./gpu-out): logs and JSON. ITERS: timed calls per path (default 30);
# HISTORY_K: which benchmark tests (-k, default impl_anchor); COMPARE_FAIL: e.g. median:10%,
# pytest-benchmark's fail threshold for the second run (default none: the comparison is shown).
set -uo pipefail
SPEC=${1:-magi_moe.tests.outside_grouped_example:IMPL}
shift || true
STEPS=${*:-bench history layer}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"${PYTHON:-python3}" scripts/wheel_view.py  # the suite as magi_moe.audit/.fuzz/.tests: nothing is installed here
unset TRITON_INTERPRET
PY=${PYTHON:-python3}
ITERS=${ITERS:-30}

$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    2>&1 | tee "$OUT/env.txt"
for step in $STEPS; do
  case $step in
    bench)
      timeout "${BENCH_TIMEOUT:-240}" $PY -m magi_moe.bench --anchors --impl "$SPEC" --iters "$ITERS" \
          --warmup 3 --no-graphs --json "$OUT/impl-bench.json" 2>&1 | tee "$OUT/impl-bench.log" ;;
    history)
      for run in save compare; do
        extra=--benchmark-autosave
        [ $run = compare ] && extra="--benchmark-compare ${COMPARE_FAIL:+--benchmark-compare-fail=$COMPARE_FAIL}"
        timeout 180 $PY -m pytest -q -p no:cacheprovider tests/benchmarks -k "${HISTORY_K:-impl_anchor}" \
            --impl "$SPEC" --backend cuda --benchmark-storage "file://$OUT/benchmark-history" \
            $extra --benchmark-columns=median,iqr,rounds 2>&1 | tail -40 | tee "$OUT/history-$run.log"
      done ;;
    layer)
      timeout 200 $PY -m magi_moe.bench --anchors --paths fused,fused-layer --breakdown \
          --iters "$((ITERS * 2))" --warmup 10 --no-graphs --json "$OUT/layer.json" 2>&1 | tee "$OUT/layer.log"
      for tokens in 4096 16384; do
        timeout 60 $PY scripts/profile_host.py "$tokens" --layer 2>&1 | tail -40 | tee "$OUT/profile-layer-$tokens.log"
      done ;;
    *) echo "unknown step $step (bench, history, layer)" >&2; exit 2 ;;
  esac
done
