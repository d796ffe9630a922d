#!/usr/bin/env bash
# Nightly: the suites of the hardware at hand (long cases included), the goldens, the
# benchmarks appended to the tracked bench/history.jsonl (--append-tracked; a plain local run
# appends to the ignored bench/out/history.jsonl) with their regression check, then the dashboard.
#   bash ci/nightly.sh   (PYTHON=interpreter, LOG_DIR=logs, BENCH_THRESHOLD=slowdown, default 0.05,
#                         SUITES=test paths, default suites)
# Every step runs even if an earlier one fails; the exit status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
# The README's environment where it exists, else python3 from PATH.
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY=${PYTHON:-python3}
if ! "$PY" -c "import jax" 2>/dev/null; then
  echo "nightly: $PY cannot import jax; set up the README's .venv first (or set PYTHON)" >&2
  exit 2
fi
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}" TOKAMAX_NIGHTLY=1 PYTHONUNBUFFERED=1
export TOKAMAX_HYPOTHESIS_PROFILE=${TOKAMAX_HYPOTHESIS_PROFILE:-harness-nightly}
LOG_DIR=${LOG_DIR:-/tmp/tokamax-nightly}
mkdir -p "$LOG_DIR"
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
failed=()
step() {  # step NAME COMMAND...: runs it, logs it, remembers a failure.
  local name=$1; shift
  echo "== $name: $*"
  if "$@" 2>&1 | tee "$LOG_DIR/$STAMP-$name.log"; then echo "== $name: ok"
  else echo "== $name: FAILED"; failed+=("$name"); fi
}
step suites "$PY" -m pytest -q --run-long --summary-md "$LOG_DIR/$STAMP-summary.md" ${SUITES:-suites}
step golden "$PY" -m golden
# CPU timings single-threaded (bench.history.CPU_XLA_FLAGS; CPU-only flags, inert on a GPU), as
# the process's CPU time in 10 interleaved rounds with each op's anchor (bench.history.run;
# about a minute on 2 cores).
BENCH_FLAGS=$("$PY" -c "from bench import history; print(history.CPU_XLA_FLAGS)" 2>/dev/null)
step bench env XLA_FLAGS="${XLA_FLAGS:-} $BENCH_FLAGS" "$PY" -m bench.history run --append-tracked \
  --check --threshold "${BENCH_THRESHOLD:-0.05}"
step dashboard "$PY" -m bench.dashboard
if [ ${#failed[@]} -gt 0 ]; then
  echo "nightly: FAILED steps: ${failed[*]} (logs in $LOG_DIR)"
  exit 1
fi
echo "nightly: all steps passed (logs in $LOG_DIR; dashboard bench/out/site/index.html)"
