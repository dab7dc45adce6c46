#!/usr/bin/env bash
# The installed suite, as an outside team meets it: build the wheel, install it with the test
# extra into a fresh virtual environment, and from another directory run the conformance suite
# (magi-moe check) against a copy of tests/outside_impl_example.py, plus the audit's entry point.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# built from a copy of the tracked (and new, unignored) files: no stale build/ leaks in
mkdir "$work/src"
(cd "$repo" && git ls-files -co --exclude-standard -z | xargs -0 tar cf - 2>/dev/null) | tar xf - -C "$work/src"
python3 -m pip wheel -q --no-deps -w "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/magi_moe-*.whl)
unzip -Z1 "$wheel" > "$work/contents.txt"  # a file, not a pipe: grep -q would cut unzip off (pipefail)
echo "+ built $(basename "$wheel"): $(grep -c '\.py$' "$work/contents.txt") modules"
grep -qx 'magi_moe/kernels/tiles/fused.json' "$work/contents.txt" || { echo "the wheel lacks the tile tables" >&2; exit 1; }
if grep -qE '^(audit|fuzz|tests)/' "$work/contents.txt"; then echo "the wheel installs a top-level audit/fuzz/tests" >&2; exit 1; fi
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --no-compile torch==2.13.0
"$work/venv/bin/pip" install -q --no-compile "$wheel[test]"
# pip compiles on one core; this on all (a file torch ships in newer syntax fails: harmless)
"$work/venv/bin/python" -m compileall -q -j0 "$work/venv/lib" > /dev/null || true
mkdir "$work/team"
cp "$repo/tests/outside_impl_example.py" "$work/team/team_kernel.py"
cd "$work/team"
export OPENBLAS_NUM_THREADS=1
export PATH="$work/venv/bin:$PATH"  # the printed reproduction lines say "python"
magi-moe check team_kernel:IMPL --backend cpu -- -q
magi-moe audit --help > /dev/null
magi-moe fuzz --help > /dev/null
echo "+ the installed conformance suite passed against team_kernel:IMPL from $work/team"

# Refused arguments: one line on stderr, exit 2, before any work.
expect_refusal() {
  local rc=0
  "$@" 2> "$work/err.txt" > /dev/null || rc=$?
  [ "$rc" -eq 2 ] && [ "$(grep -c . "$work/err.txt")" -eq 1 ] || {
    echo "expected one line and exit 2 from: $* (exit $rc)" >&2; cat "$work/err.txt" >&2; exit 1; }
}
expect_refusal magi-moe nope
expect_refusal magi-moe check team_kernel:einsum_forward
expect_refusal magi-moe audit --impl no_such_module:IMPL
expect_refusal magi-moe fuzz --budget-seconds nan
expect_refusal magi-moe fuzz --properties diferential
echo 'raise RuntimeError("no GPU here")' > team_no_gpu.py
expect_refusal magi-moe check team_no_gpu:IMPL
echo "+ bad arguments (a module raising at import too) are refused in one line with exit 2"

# The worked examples the wheel hands a team, written out and checked as written.
magi-moe example > /dev/null
magi-moe example layer --out team_layer.py
magi-moe check team_layer:IMPL --backend cpu -- -q
echo "+ magi-moe example layer, written out, passes magi-moe check"

# The team's module from the current directory, in the audit (plots included).
magi-moe audit --impl team_kernel:IMPL --no-kernels --no-mpcheck --no-controls --tokens 16 \
  --probe random --out audit-out > audit.log
ls audit-out/report.md audit-out/error_ratio_hist.png > /dev/null
echo "+ the audit imports team_kernel from $work/team (the campaign below, team_broken)"

# A campaign against a broken copy of the team's kernel; each reproduction line it prints runs
# as printed, where the team runs it (the [test] extra has no Triton: the copy is plain torch).
cat > team_broken.py <<'PY'
import dataclasses

from team_kernel import IMPL, einsum_forward


def off_by_one(x, table, weights, config, *, out):
    einsum_forward(x, table, weights, config, out=out)
    return out.add_(1)


BROKEN = dataclasses.replace(IMPL, name="team-broken", forward=off_by_one)
PY
rc=0
# the ci profile: one derandomised round, whatever the machine's speed
magi-moe fuzz --backend cpu --impl team_broken:BROKEN --properties differential --budget-seconds 60 \
  --profile ci --workers 0 --no-shrink --seed 3 --out fuzz-out --db fuzz-db > fuzz.log || rc=$?
[ "$rc" -eq 1 ] || { echo "the broken kernel's campaign exited $rc, not 1" >&2; tail -20 fuzz.log >&2; exit 1; }
failure() { python -c 'import json, sys; print(json.load(open("fuzz-out/summary.json"))["failures"][0][sys.argv[1]])' "$1"; }
repro=$(failure repro)
nodeid=$(failure nodeid)
rc=0; eval "$repro" > replay.log 2>&1 || rc=$?
[ "$rc" -eq 1 ] && grep -q '^FAIL:' replay.log || { echo "the printed replay line exited $rc" >&2; cat replay.log >&2; exit 1; }
rc=0; python -m magi_moe.fuzz rerun "$nodeid" --db fuzz-db --backend cpu --impl team_broken:BROKEN \
  --profile ci --no-shrink > rerun.log 2>&1 || rc=$?
[ "$rc" -eq 1 ] && grep -q "^FAILED .*test_property\[differential-team-broken@cpu\]" rerun.log || {
  echo "rerun of $nodeid exited $rc" >&2; tail -20 rerun.log >&2; exit 1; }
echo "+ the printed replay line and a rerun of $nodeid run from the installed wheel"
