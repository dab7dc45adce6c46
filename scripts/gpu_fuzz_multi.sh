#!/usr/bin/env bash
# Fuzz campaigns on a 2-GPU host sharing one Redis example database (fuzz/README.md):
#   bash scripts/gpu_fuzz_multi.sh
# Three campaigns of FUZZ_BUDGET seconds each (default 90) on the CUDA backend, every one on
# its own Redis database number so none replays another's examples:
#   one    one worker, one GPU                                  (the baseline)
#   xdist  two pytest-xdist workers of one campaign, one per GPU (one machine, N GPUs)
#   hosts  two campaign processes, CUDA_VISIBLE_DEVICES=0 and 1, each with its own local
#          directory, one shared Redis database                  (how N machines run)
# then prints cases per second per worker and in total. Results land in $OUT (./gpu-results/fuzz-multi).
# Needs redis-server (REDIS_SERVER=path, or on PATH) and the redis client (importable, e.g. a
# carried folder on PYTHONPATH: pip download redis --no-deps, unzip into .gpu-deps/python).
# Without them the campaigns share a directory database instead, and the script says so.
# FUZZ_ARGS adds arguments to every campaign (default: --impl fused --impl native-det);
# FUZZ_BACKEND (default cuda) lets the script itself be tried on a CPU machine.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}/fuzz-multi; rm -rf "$OUT"; mkdir -p "$OUT"
BUDGET=${FUZZ_BUDGET:-90}
ARGS=${FUZZ_ARGS:---impl fused --impl native-det}
BACKEND=${FUZZ_BACKEND:-cuda}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}:$PWD/.gpu-deps/python PYTHONUNBUFFERED=1
python3 scripts/wheel_view.py  # the suite as magi_moe.audit/.fuzz/.tests: nothing is installed here
unset TRITON_INTERPRET

nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$OUT/machine.txt"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
[ "$gpus" -ge 2 ] || echo "note: $gpus GPU(s): the two-worker runs share one" | tee -a "$OUT/machine.txt"

server=${REDIS_SERVER:-$(command -v redis-server || true)}
port=
if [ -n "$server" ] && python3 -c "import redis" 2>/dev/null; then
  port=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  "$server" --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$OUT" > "$OUT/redis.log" 2>&1 &
  redis_pid=$!
  trap 'kill $redis_pid 2>/dev/null' EXIT
  for _ in $(seq 50); do python3 -c "import redis; redis.Redis(port=$port).ping()" 2>/dev/null && break; sleep 0.2; done
  echo "shared database: Redis on 127.0.0.1:$port ($("$server" --version | head -1))" | tee -a "$OUT/machine.txt"
else
  echo "NO REDIS (server: '${server:-none}', client importable: $(python3 -c 'import redis' 2>/dev/null && echo yes || echo no));" \
       "the campaigns share a directory database instead" | tee -a "$OUT/machine.txt"
fi
db_for() {  # database number N: its own Redis database, or its own directory without Redis
  if [ -n "$port" ]; then echo "redis://127.0.0.1:$port/$1"; else echo "$OUT/db-$1"; fi
}

campaign() {  # name, workers, db, seed, extra env...
  local name=$1 workers=$2 db=$3 seed=$4; shift 4
  env "$@" timeout $((BUDGET + 240)) python3 -m fuzz --backend "$BACKEND" --budget-seconds "$BUDGET" \
    --workers "$workers" --seed "$seed" --db "$db" --db-local "$OUT/$name-local" --out "$OUT/$name" \
    --no-confirm $ARGS > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? ($(grep -m1 'targets got time' "$OUT/$name.log"))"
}

campaign one 1 "$(db_for 1)" 1
campaign xdist 2 "$(db_for 2)" 1
campaign hosts-gpu0 0 "$(db_for 3)" 1 CUDA_VISIBLE_DEVICES=0 & host0=$!
campaign hosts-gpu1 0 "$(db_for 3)" 2 CUDA_VISIBLE_DEVICES=$(( gpus >= 2 ? 1 : 0 )) & host1=$!
wait "$host0" "$host1"  # not the Redis server, which runs until the script exits

python3 - "$OUT" <<'EOF' | tee "$OUT/throughput.txt"
import json, sys
from collections import defaultdict
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'run':12s} {'worker':8s} {'cases':>7s} {'seconds':>8s} {'cases/s':>8s}")
for name, runs in (("one", ["one"]), ("xdist", ["xdist"]), ("hosts", ["hosts-gpu0", "hosts-gpu1"])):
    total_cases, walls = 0, []
    for run in runs:
        try:
            summary = json.loads((out / run / "summary.json").read_text())
        except OSError:
            print(f"{run:12s} no summary (see {run}.log)")
            continue
        per = defaultdict(lambda: [0, 0.0])
        for row in summary["targets"]:
            worker = f"{run.removeprefix('hosts-') + ':' if run.startswith('hosts') else ''}{row['worker'] or '-'}"
            per[worker][0] += row["cases"]
            per[worker][1] += row["seconds"]
        for worker, (cases, secs) in sorted(per.items()):
            print(f"{name:12s} {worker:8s} {cases:7d} {secs:8.1f} {cases / secs if secs else 0:8.2f}")
        total_cases += summary["totals"]["cases"]
        walls.append(summary["wall_seconds"])
        print(f"{name:12s} failures {summary['totals']['failures']}, targets without time "
              f"{summary['totals']['targets_without_time']} of {summary['totals']['targets']}")
    if walls:
        print(f"{name:12s} {'total':8s} {total_cases:7d} {max(walls):8.1f} {total_cases / max(walls):8.2f}")
EOF
