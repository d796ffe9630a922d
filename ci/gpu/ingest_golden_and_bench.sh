#!/usr/bin/env bash
# Brings home what ci/gpu/golden_and_bench.sh wrote to $OUT: the goldens into
# golden/data/<family>/, the benchmark records appended to bench/history.jsonl
# (records without a commit get COMMIT, default this checkout's HEAD), then
# rebuilds the dashboard. Usage: bash ci/gpu/ingest_golden_and_bench.sh DIR [COMMIT]
set -euo pipefail
DIR=$(cd "${1:?usage: ingest_golden_and_bench.sh DIR [COMMIT]}" && pwd)
cd "$(dirname "$0")/../.."
COMMIT=${2:-$(git rev-parse HEAD)}
PY=${PYTHON:-python3}
for fam in "$DIR"/golden/*/; do
  fam=$(basename "$fam")
  mkdir -p "golden/data/$fam"
  cp "$DIR/golden/$fam/goldens.npz" "$DIR/golden/$fam/manifest.json" "golden/data/$fam/"
  $PY - "golden/data/$fam/manifest.json" "$COMMIT" <<'PYEOF'
import json, sys
path, commit = sys.argv[1:]
m = json.load(open(path))
if m.get("commit", "unknown") in ("unknown", ""):
  m["commit"] = commit
json.dump(m, open(path, "w"), indent=1)
open(path, "a").write("\n")
PYEOF
  echo "goldens of $fam -> golden/data/$fam/"
done
if [ -f "$DIR/bench_records.jsonl" ]; then
  $PY -m bench.history ingest --commit "$COMMIT" "$DIR/bench_records.jsonl"
fi
$PY -m bench.dashboard
