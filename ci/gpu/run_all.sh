#!/usr/bin/env bash
# What the H200 has to check, in one device call: the steps named in STEPS, each under its own
# time limit, results packed into $OUT/results.tar.gz (the device tool brings back few files)
# with the suite summary beside it.
#
#   GITHUB_SHA=<commit> OUT=<dir> STEPS="suite bench golden tooling" bash ci/gpu/run_all.sh
#
# Steps (seconds in <STEP>_S override the default limit):
#   suite     the h100 matrix and kernel tests, GPU-only checks included (ci/gpu_suite.sh),
#             summary.md/json; SUITE_ARGS go to pytest (e.g. --resume-from JUNIT to finish a run
#             cut by the time limit), SUITE_K to its -k (an expression with spaces)
#   bench     the timed runner over the h100 family (python -m bench.run: ours against cuDNN,
#             jax.lax and XLA in the same process), records in bench/records.py's schema;
#             BENCH_ARGS go to it, e.g. "--only causal --rounds 4", "--sweep", "--kernels"
#             (per-kernel CUPTI times), "--hlo DIR"; PTXAS=1 logs ptxas's register/spill report
#   step      the README example's training step (python -m bench.step: xla, None and plain
#             jnp in one process), records in bench/records.py's schema
#   regen     regenerate the goldens in place (GOLDEN_OPS: comma-separated ops, default all; one
#             process per op), so that a later suite step checks them; copies in regen/<family>/
#   golden    goldens and one benchmark-history run (ci/gpu/golden_and_bench.sh; bring them home
#             with ci/gpu/ingest_golden_and_bench.sh)
#   tooling   timers and export (ci/gpu/tooling.py; TOOLING_SKIP, default autotune,default_cache)
#   autotune  step autotuning and the default cache (ci/gpu/tooling.py; AUTOTUNE_SKIP, default
#             timers,export: add autotune to spend the whole limit on the default cache;
#             AUTOTUNE_FUNCTIONS: comma-separated names of tooling.benchmark_functions, default all)
#   cache_ab  the shipped default cache against the heuristics, interleaved rounds
#             (ci/gpu/cache_ab.py; the functions of AUTOTUNE_FUNCTIONS)
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
if [ -z "${GITHUB_SHA:-}" ] && [ -f .gpu_commit ]; then export GITHUB_SHA=$(cat .gpu_commit); fi
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton_cache}"
export TOKAMAX_COMMIT=${GITHUB_SHA:-unknown} GITHUB_SHA=${GITHUB_SHA:-}

RAN=()
step() {  # step NAME DEFAULT_SECONDS COMMAND...
  local name=$1 default=$2 var
  shift 2
  var="$(echo "$name" | tr a-z A-Z)_S"
  mkdir -p "$WORK/$name"
  echo "== $name (limit ${!var:-$default} s)"
  local t0=$SECONDS
  timeout "${!var:-$default}" "$@" >"$WORK/$name/log.txt" 2>&1
  echo "== $name: exit $? after $((SECONDS - t0)) s"
  tail -"${TAIL:-12}" "$WORK/$name/log.txt"
  # Packed after every step, so that a call cut short still brings back what finished. Only this
  # run's steps: a device machine's /tmp has been seen to hold an earlier session's step folders.
  RAN+=("$name")
  tar czf "$FINAL/results.tar.gz" -C "$WORK" "${RAN[@]}"
  cp "$WORK/suite/summary.md" "$FINAL/" 2>/dev/null
}

regen_goldens() {  # regen_goldens DIR: regenerates into golden/data, keeps a copy in DIR.
  python3 -m golden --regen --jobs "${GOLDEN_JOBS:-5}" ${GOLDEN_OPS:+--ops "$GOLDEN_OPS"} || return
  local family
  family=$(python3 -c "from tokamax_harness import hardware; print(hardware.detect().family)")
  cp -r "golden/data/$family" "$1/"
}
export -f regen_goldens  # `timeout` runs it through bash.

for s in ${STEPS:-suite bench golden tooling}; do
  case $s in
    regen) step regen 120 bash -c 'regen_goldens "$0"' "$WORK/regen" ;;
    suite) step suite 240 env OUT="$WORK/suite" SKIP_BENCH=1 SUITE_TIMEOUT=$((${SUITE_S:-240} - 40)) \
      bash ci/gpu_suite.sh ${SUITE_ARGS:-} ${SUITE_K:+-k "$SUITE_K"} ;;
    bench) step bench 200 env ${PTXAS:+MOSAIC_GPU_DUMP_PTXAS=1} python3 -m bench.run --family h100 \
      --budget-s $((${BENCH_S:-200} - 40)) --out "$WORK/bench/records.json" ${BENCH_ARGS:-} ;;
    step) step step 60 python3 -m bench.step --out "$WORK/step/records.json" ;;
    golden) step golden 150 env OUT="$WORK/golden" bash ci/gpu/golden_and_bench.sh ;;
    tooling) step tooling 90 python3 ci/gpu/tooling.py --out "$WORK/tooling" --budget-s "${TOOLING_S:-90}" \
      --skip "${TOOLING_SKIP:-autotune,default_cache}" ;;
    autotune) step autotune 300 python3 ci/gpu/tooling.py --out "$WORK/autotune" --budget-s "${AUTOTUNE_S:-300}" \
      --skip "${AUTOTUNE_SKIP:-timers,export}" --functions "${AUTOTUNE_FUNCTIONS:-}" ;;
    cache_ab) step cache_ab 150 python3 ci/gpu/cache_ab.py --out "$WORK/cache_ab/records.json" \
      --functions "${AUTOTUNE_FUNCTIONS:-}" ;;
    *) echo "unknown step $s" ;;
  esac
done
echo "== packed $(du -h "$FINAL/results.tar.gz" | cut -f1) into results.tar.gz"
