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
"$work/venv/bin/pip" install -q torch==2.13.0
"$work/venv/bin/pip" install -q "$wheel[test]"
mkdir "$work/team"
cp "$repo/tests/outside_impl_example.py" "$work/team/team_kernel.py"
cd "$work/team"
export OPENBLAS_NUM_THREADS=1
"$work/venv/bin/magi-moe" check team_kernel:IMPL --backend cpu -- -q
"$work/venv/bin/magi-moe" audit --help > /dev/null
"$work/venv/bin/magi-moe" fuzz --help > /dev/null
echo "+ the installed conformance suite passed against team_kernel:IMPL from $work/team"
