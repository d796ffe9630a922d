#!/usr/bin/env bash
# The GPU suite, with or without nox (`nox -s gpu_tests` runs this; the device image has no
# nox): the GPU matrix and kernel tests in pytest-xdist workers sharing the GPU and one set of
# compile caches, then the benchmarks, writing a summary (JSON + Markdown), the JUnit XML, the
# benchmark JSON and the log to $OUT (default $TOKAMAX_RESULTS_DIR/gpu_run, else
# bench/out/gpu_run: ignored by git).
#
#   bash ci/gpu_suite.sh [extra pytest args, e.g. -k attention]
# Environment:
#   OUT, SKIP_BENCH=1, SUITE_TIMEOUT (seconds for the test part, default 420; 0: no limit),
#   SUITE_WORKERS   pytest-xdist workers (where xdist is installed; carried as a wheel in .whl/
#                   on offline hosts): default min(cores - 2, 14, GPU GiB / 8); 0 runs in-process
#   SUITE_DIST      xdist's --dist mode (default: xdist's own, load)
#   SUITE_MEM_FRACTION  each worker's cap on GPU memory (default 0.9 / workers), no preallocation
#   TOKAMAX_COMPILATION_CACHE  JAX's persistent cache and Triton's cache, shared by the workers
#                   (default /tmp/tokamax_compile_cache; "off": none). Compiling dominates the
#                   suite: the same reference or XLA program compiles once for all workers
#   SUITE_XLA_FLAGS added to XLA_FLAGS for the tests only (default --xla_gpu_autotune_level=0:
#                   no gemm autotuning while testing numerics; "" keeps XLA's autotuning)
#   TEST_TIMEOUT    per test, where pytest-timeout is installed
#   TOKAMAX_ALLOW_CPU=1  run on a host without a GPU (to check this script; the CPU matrix runs)
#   SUITE_HOST_CHECKS=1  also the host-only checks (marker host_only), which the CPU suite runs
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-${TOKAMAX_RESULTS_DIR:-bench/out}/gpu_run}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # pytest-xdist, jax-triton etc. carried as wheels (offline host).
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}"
cache="${TOKAMAX_COMPILATION_CACHE-/tmp/tokamax_compile_cache}"
if [ -n "$cache" ] && [ "$cache" != off ]; then
  export TOKAMAX_COMPILATION_CACHE="$cache"
  mkdir -p "$cache"
else
  unset TOKAMAX_COMPILATION_CACHE
fi
# Triton needs a writable cache; the device image's HOME may have none. One for all workers.
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-${TOKAMAX_COMPILATION_CACHE:-/tmp}/triton}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # also for the probe below: it must not take the GPU.
python3 -c "import jax; d = jax.devices()[0]; print(jax.__version__, d.platform, d.device_kind)" | tee "$OUT/device.txt"
platform=$(awk '{print $2}' "$OUT/device.txt")
if [ "$platform" != gpu ] && [ "${TOKAMAX_ALLOW_CPU:-0}" != 1 ]; then
  echo "gpu_suite: no GPU here (jax sees '${platform:-nothing}'): the GPU suite needs an NVIDIA GPU" \
    "and jax with CUDA. On a CPU host run 'nox -s tests' (TOKAMAX_ALLOW_CPU=1 runs this anyway)." >&2
  exit 2
fi

# Workers sized to the host: compiling is CPU work (leave two cores to the controller and the
# compilers' threads), and every worker needs room on the one GPU.
cores=$(nproc 2>/dev/null || echo 4)
gpu_gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
gpu_gib=$(( ${gpu_gib:-65536} / 1024 ))
workers=$(( cores - 2 < 14 ? cores - 2 : 14 ))
workers=$(( gpu_gib / 8 < workers ? gpu_gib / 8 : workers ))
workers=${SUITE_WORKERS:-$(( workers < 1 ? 1 : workers ))}
PARALLEL=()
# The tests' own environment (not the benchmarks'): a cap on each worker's GPU memory, XLA flags.
TEST_ENV=(XLA_FLAGS="${XLA_FLAGS:-} ${SUITE_XLA_FLAGS---xla_gpu_autotune_level=0}")
if [ "$workers" -gt 0 ] && python3 -c "import xdist" 2>/dev/null; then
  PARALLEL=(-n "$workers" ${SUITE_DIST:+--dist "$SUITE_DIST"})
  fraction="${SUITE_MEM_FRACTION:-$(python3 -c "print(f'{0.9 / $workers:.3f}')")}"
  TEST_ENV+=(XLA_PYTHON_CLIENT_MEM_FRACTION="$fraction")
else
  echo "gpu_suite: pytest-xdist not found (or SUITE_WORKERS=0): one process" >&2
  workers=0
fi
if python3 -c "import pytest_timeout" 2>/dev/null; then PARALLEL+=(--timeout "${TEST_TIMEOUT:-240}"); fi
echo "gpu_suite: $workers workers (${cores} cores, ${gpu_gib} GiB GPU), memory fraction" \
  "${fraction:-default}, compile caches ${TOKAMAX_COMPILATION_CACHE:-off}, ${TEST_ENV[0]}" | tee -a "$OUT/device.txt"
# Not the host-only checks (kernels in their interpreters, TPU exports: the CPU suite's), unless
# SUITE_HOST_CHECKS=1.
MARKERS="not bench"
if [ "${SUITE_HOST_CHECKS:-0}" != 1 ]; then MARKERS="not bench and not host_only"; fi
# SIGINT, so that pytest still writes the summary and junit of what ran when time is up.
env "${TEST_ENV[@]}" timeout -s INT -k 30 "${SUITE_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -m "$MARKERS" "${PARALLEL[@]}" \
  --summary-json="$OUT/summary.json" --summary-md="$OUT/summary.md" \
  -o junit_family=xunit2 --junitxml="$OUT/junit.xml" "$@" 2>&1 | tee "$OUT/log.txt"
status=${PIPESTATUS[0]}
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout "${BENCH_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider suites/test_bench.py --bench \
    --benchmark-json="$OUT/bench.json" 2>&1 | tail -40 | tee "$OUT/bench_log.txt"
fi
echo "pytest exit status: $status" | tee -a "$OUT/summary.md"
exit "$status"
