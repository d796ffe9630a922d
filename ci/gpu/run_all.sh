#!/usr/bin/env bash
# What the H200 has to check, in one device call: the steps named in STEPS, each under its own
# time limit, results packed into $OUT/results.tar.gz (the device tool brings back few files)
# with the suite summary beside it.
#
#   GITHUB_SHA=<commit> OUT=<dir> STEPS="suite golden_bench tooling" bash ci/gpu/run_all.sh
#
# Steps (seconds in <STEP>_S override the default limit; <STEP>_ARGS replace the flags of the
# attention_mosaic, mosaic_mm and triton_mm_norm scripts):
#   suite             the h100 matrix and kernel tests (ci/gpu_suite.sh), summary.md/json; SUITE_ARGS
#                     go to pytest (e.g. --resume-from JUNIT to finish a run cut by the time limit),
#                     SUITE_K to its -k (an expression with spaces, which SUITE_ARGS cannot carry)
#   golden_bench      goldens and one benchmark-history run (ci/gpu/golden_and_bench.sh)
#   history_ops       the benchmark-history run of the ops other than attention, forward
#   tooling           timers and export (ci/gpu/tooling.py; TOOLING_SKIP, default autotune,default_cache)
#   autotune          step autotuning and the default cache (ci/gpu/tooling.py, timers/export skipped)
#   attention_mosaic  Mosaic attention against cuDNN (ci/gpu/attention_mosaic.py --skip-checks)
#   attention_triton  Triton attention timings (ci/gpu/attention_triton.py --skip-tests)
#   mosaic_mm         Mosaic ragged_dot and GLU timings (ci/gpu/mosaic_mm.py --part bench)
#   triton_mm_norm    Triton layer_norm, GLU and ragged_dot timings (ci/gpu/triton_mm_norm.py)
#   glu_rounds        XLA against Mosaic SwiGLU, interleaved rounds (ci/gpu/glu_rounds.py; GLU_ROUNDS_ARGS)
#   profile           per-kernel device time of training steps, ours and anchors (ci/gpu/kernel_profile.py;
#                     PROFILE_ONLY: substrings of case names; PTXAS=1 logs ptxas's register and spill report;
#                     PROFILE_ARGS=--hlo saves each case's optimised HLO)
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

for s in ${STEPS:-suite golden_bench tooling}; do
  case $s in
    suite) step suite 240 env OUT="$WORK/suite" SKIP_BENCH=1 SUITE_TIMEOUT=$((${SUITE_S:-240} - 40)) \
      bash ci/gpu_suite.sh ${SUITE_ARGS:-} ${SUITE_K:+-k "$SUITE_K"} ;;
    golden_bench) step golden_bench 150 env OUT="$WORK/golden_bench" bash ci/gpu/golden_and_bench.sh ;;
    history_ops) step history_ops 100 python3 -m bench.history run --family h100 --no-append \
      --out "$WORK/history_ops/bench_records.jsonl" --iterations 20 --budget-s "${HISTORY_BUDGET_S:-70}" \
      --ops layer_norm,gated_linear_unit,ragged_dot,linear_softmax_cross_entropy_loss \
      --features plain,swiglu,default,sum --modes fwd ;;
    tooling) step tooling 90 python3 ci/gpu/tooling.py --out "$WORK/tooling" --budget-s "${TOOLING_S:-90}" \
      --skip "${TOOLING_SKIP:-autotune,default_cache}" ;;
    autotune) step autotune 300 python3 ci/gpu/tooling.py --out "$WORK/autotune" --budget-s "${AUTOTUNE_S:-300}" \
      --skip timers,export ;;
    attention_mosaic) step attention_mosaic 120 python3 ci/gpu/attention_mosaic.py ${ATTENTION_MOSAIC_ARGS:---skip-checks} \
      --out "$WORK/attention_mosaic/attention_mosaic.json" ;;
    attention_triton) step attention_triton 90 python3 ci/gpu/attention_triton.py --skip-tests \
      --out "$WORK/attention_triton" --commit "$TOKAMAX_COMMIT" ;;
    mosaic_mm) step mosaic_mm 120 python3 ci/gpu/mosaic_mm.py ${MOSAIC_MM_ARGS:---part bench} \
      --out "$WORK/mosaic_mm/mosaic_mm.json" ;;
    triton_mm_norm) step triton_mm_norm 150 python3 ci/gpu/triton_mm_norm.py ${TRITON_MM_NORM_ARGS:---skip-correctness} \
      --out "$WORK/triton_mm_norm" ;;
    glu_rounds) step glu_rounds 200 python3 ci/gpu/glu_rounds.py ${GLU_ROUNDS_ARGS:-} \
      --out "$WORK/glu_rounds/glu_rounds.json" ;;
    profile) step profile 150 env ${PTXAS:+MOSAIC_GPU_DUMP_PTXAS=1} python3 ci/gpu/kernel_profile.py --only "${PROFILE_ONLY:-}" \
      --out "$WORK/profile/kernel_profile.json" ${PROFILE_ARGS:-} ;;
    *) echo "unknown step $s" ;;
  esac
done
echo "== packed $(du -h "$FINAL/results.tar.gz" | cut -f1) into results.tar.gz"
