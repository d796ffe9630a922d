#!/usr/bin/env bash
# The GPU suite without nox (the device image has none): the same pytest command as
# `nox -s gpu_tests`, then the benchmarks, writing a summary (JSON + Markdown), the
# benchmark JSON and the log to $OUT (default $TOKAMAX_RESULTS_DIR/gpu_run, else bench/out/gpu_run: ignored by git).
#
#   bash ci/gpu_suite.sh [extra pytest args, e.g. -k attention]
# Environment: OUT, SKIP_BENCH=1, SUITE_TIMEOUT (seconds for the test part, default 420),
# SUITE_WORKERS (pytest-xdist workers where it is installed, default 6), TEST_TIMEOUT (per test).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-${TOKAMAX_RESULTS_DIR:-bench/out}/gpu_run}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # jax-triton etc. carried as wheels (offline host).
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}"
# Triton needs a writable cache; the device image's HOME may have none.
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton_cache}"
python3 -c "import jax; d = jax.devices()[0]; print(jax.__version__, d.platform, d.device_kind)" | tee "$OUT/device.txt"
# Compiling kernels dominates the suite: spread it over worker processes sharing the GPU.
PARALLEL=()
if python3 -c "import xdist" 2>/dev/null; then
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  PARALLEL=(-n "${SUITE_WORKERS:-6}")
fi
if python3 -c "import pytest_timeout" 2>/dev/null; then PARALLEL+=(--timeout "${TEST_TIMEOUT:-240}"); fi
# SIGINT, so that pytest still writes the summary and junit of what ran when time is up.
timeout -s INT -k 30 "${SUITE_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -m "not bench" "${PARALLEL[@]}" \
  --summary-json="$OUT/summary.json" --summary-md="$OUT/summary.md" \
  -o junit_family=xunit2 --junitxml="$OUT/junit.xml" "$@" 2>&1 | tee "$OUT/log.txt"
status=${PIPESTATUS[0]}
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout "${BENCH_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider suites/test_bench.py --bench \
    --benchmark-json="$OUT/bench.json" 2>&1 | tail -40 | tee "$OUT/bench_log.txt"
fi
echo "pytest exit status: $status" | tee -a "$OUT/summary.md"
exit "$status"
