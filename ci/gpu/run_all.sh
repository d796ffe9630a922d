#!/usr/bin/env bash
# Everything the H200 has to check, in one device call: the h100 suite, the goldens and a
# benchmark-history run, and the tooling checks (timers, export). Results are packed into
# $OUT/results.tar.gz (the device tool brings back few files), with the suite summary beside it.
#
#   GITHUB_SHA=<commit> OUT=<dir> bash ci/gpu/run_all.sh
# Environment: SUITE_S (seconds for the suite, default 200), TOOLING_S (default 90),
# TOOLING_SKIP (tooling sections to skip, default "autotune,default_cache").
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the output folder}"
FINAL=$OUT
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}"
mkdir -p "$WORK/suite" "$WORK/golden_and_bench" "$WORK/tooling"
echo "== suite"
OUT=$WORK/suite SKIP_BENCH=1 SUITE_TIMEOUT=${SUITE_S:-200} bash ci/gpu_suite.sh 2>&1 | tail -25
echo "== goldens and benchmark history"
OUT=$WORK/golden_and_bench bash ci/gpu/golden_and_bench.sh 2>&1 | grep -E "^(==|status|new |ok |slower|[a-z_]+\[)" | head -60
echo "== tooling checks"
timeout "${TOOLING_S:-90}" python3 ci/gpu/tooling.py --out "$WORK/tooling" --budget-s "${TOOLING_S:-90}" \
  --skip "${TOOLING_SKIP:-autotune,default_cache}" 2>&1 | tail -15
tar czf "$FINAL/results.tar.gz" -C "$WORK" .
cp "$WORK/suite/summary.md" "$FINAL/" 2>/dev/null
echo "== packed $(du -h "$FINAL/results.tar.gz" | cut -f1) into results.tar.gz"
