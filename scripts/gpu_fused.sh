#!/usr/bin/env bash
# The fused path's GPU checks and measurements, in one command for a lent H200 (or any CUDA GPU).
#
#   scripts/gpu_fused.sh [all|sweep|bench]     (default: all)
#
# sweep: the tile sweep (python -m tuner) over the four docs/ANCHORS.md cases (every
#        candidate's output checked against a reference candidate), written to
#        magi_moe/kernels/tiles/fused.json; SWEEP_ARGS replaces "--anchors" (e.g. "--tokens
#        16384 --merge": one class re-swept, the rest of the table kept), SWEEP_TIMEOUT its
#        time limit (160 s);
# then (every mode) the benchmark with the tile table; then (all, bench) the pytest-benchmark
# GPU cases; then (every mode) the CUDA tests.
# CUDA tests: tests/test_fused.py, tests/test_packed_weights.py and the implementation matrix
# for fused (production shapes, determinism, no host sync, no allocation once warm).
# Results go to $OUT (or ./gpu-out): logs, the benchmark JSON and the tile table.
# BENCH_PATHS, BENCH_ROUNDS: the benchmark's paths and rounds; BENCH_ARGS: more benchmark
# arguments (e.g. --breakdown: each launch timed alone); FUSED_TESTS=0 skips the tests.
set -uo pipefail
MODE=${1:-all}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
PY=${PYTHON:-python3}
"$PY" scripts/wheel_view.py  # the suite as magi_moe.audit/.fuzz/.tests: nothing is installed here
PATHS=${BENCH_PATHS:-native,native-det,fused,fused-layer,native-layer,routing,fused-routing}

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"

if [ "$MODE" != bench ]; then  # its own process: a candidate that faults cannot spoil the rest
  timeout "${SWEEP_TIMEOUT:-160}" $PY -m tuner ${SWEEP_ARGS:---anchors} --write \
      --json "$OUT/sweep.json" 2>&1 | tail -60 | tee "$OUT/sweep.log"
  cp magi_moe/kernels/tiles/fused.json "$OUT/fused.json" 2>/dev/null
fi
timeout "${BENCH_TIMEOUT:-130}" $PY -m magi_moe.benchmark --anchors --paths $PATHS --iters 100 --warmup 10 \
    --rounds "${BENCH_ROUNDS:-2}" ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"

if [ "$MODE" != sweep ]; then
  timeout 120 $PY -m pytest -q -p no:cacheprovider tests/benchmarks -m cuda \
      --benchmark-json "$OUT/pytest-bench.json" 2>&1 | tail -30 | tee "$OUT/pytest-bench.log"
fi

[ "${FUSED_TESTS:-1}" = 0 ] && exit 0
timeout 120 $PY -m pytest -q -p no:cacheprovider -m "cuda and not benchmark" --hypothesis-profile ci \
    tests/test_fused.py tests/test_packed_weights.py \
    tests/test_implementations.py --impl fused 2>&1 | tail -30 | tee "$OUT/tests.log"
