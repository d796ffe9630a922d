#!/usr/bin/env bash
# The h100 goldens and one benchmark-history run, in one GPU call (issue 8).
#
# On the H200, at the repo root (or as the `golden` step of ci/gpu/run_all.sh):
#   OUT=/some/dir bash ci/gpu/golden_and_bench.sh
# Dry run on a CPU (the cpu family, its small benchmark shapes):
#   OUT=/tmp/gb DRY=1 bash ci/gpu/golden_and_bench.sh
# Writes (at most 5 files, 2 folders deep):
#   $OUT/log.txt                          everything printed
#   $OUT/golden/<family>/goldens.npz      the regenerated goldens ...
#   $OUT/golden/<family>/manifest.json    ... and their manifest
#   $OUT/bench_records.jsonl              one JSON record per measurement
#   $OUT/env.txt                          device, driver, versions
# Bring them home with: bash ci/gpu/ingest_golden_and_bench.sh <folder holding them>
set -o pipefail
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -z "${DRY:-}" ] && ls .whl/jax_triton-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/jax_triton-*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
# The device copy has no .git: the commit comes from GITHUB_SHA (bench.environment reads it).
if [ -z "${GITHUB_SHA:-}" ] && [ -f .gpu_commit ]; then export GITHUB_SHA=$(cat .gpu_commit); fi
# Both benchmark invocations below make one run of the history.
COMMIT=${GITHUB_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export TOKAMAX_RUN_ID="${COMMIT:0:12}@$(date -u +%FT%T+00:00)"
BUDGET_S=${BUDGET_S:-60}
ITER=${ITER:-20}
if [ -n "${DRY:-}" ]; then ITER=3; BUDGET_S=60; fi
{
  echo "== $(date -u +%FT%TZ) golden_and_bench commit=${GITHUB_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi"
    $PY -c "import jax; print('jax', jax.__version__, jax.devices())"
    $PY -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
    $PY -c "import jax_triton; print('jax_triton', jax_triton.__version__)" 2>&1 | tail -1
  } | tee "$OUT/env.txt"
  FAMILY=$($PY -c "from tokamax_harness import hardware; print(hardware.detect().family)")
  echo "== goldens of family $FAMILY: regenerate, and what changed against the committed ones"
  t0=$SECONDS
  $PY -m golden --regen --jobs "${GOLDEN_JOBS:-5}" --out "$OUT/golden"
  echo "== goldens took $((SECONDS - t0)) s"
  echo "== benchmarks ($FAMILY matrix, budget ${BUDGET_S} s), checked against bench/history.jsonl"
  t0=$SECONDS
  # Attention forward and forward+backward; the other ops forward only (the anchors).
  $PY -m bench.history run --family "$FAMILY" --no-append --out "$OUT/bench_records.jsonl" \
    --ops dot_product_attention --features plain --iterations "$ITER" --budget-s "$BUDGET_S"
  $PY -m bench.history run --family "$FAMILY" --no-append --out "$OUT/bench_records.jsonl" \
    --ops layer_norm,gated_linear_unit,ragged_dot,linear_softmax_cross_entropy_loss \
    --features plain,swiglu,default,sum --modes fwd --iterations "$ITER" --budget-s "$BUDGET_S"
  echo "== benchmarks took $((SECONDS - t0)) s"
} 2>&1 | tee "$OUT/log.txt"
