"""How often the nightly regression check cries wolf, and whether it catches real slowdowns.

`python -m bench.trial` measures the hardware family's benchmark cases in
`--baseline` runs (the history), then in `--runs` further runs on unchanged
code. Each further run is checked against the history as the nightly checks it
(`bench.history.check`), three ways: as measured (every flag is a false
alarm), with a planted slowdown of one op (`--op`, its times multiplied by
1 + `--slow`: it must be flagged in every run) and with a planted small change
(1 + `--small`: it must not be flagged). The measured run is then appended to
the history, as the nightly appends it.

  XLA_FLAGS="$(python -c 'from bench import history; print(history.CPU_XLA_FLAGS)')" \
  python -m bench.trial [--baseline 5] [--runs 10] [--op layer_norm] [--slow 0.2]
                        [--small 0.03] [--out FILE.json] [--records FILE.jsonl]

(on a CPU host the nightly times with those flags; without them the trial warns).
"""

import argparse
import json
import os
import sys

import jax

from bench import history

_TIME_FIELDS = ("device_time_median_ms", "device_time_min_ms")


def planted(records: list[dict], op: str, factor: float) -> list[dict]:
  """`records` with the times of `op` multiplied by `factor`."""
  out = []
  for r in records:
    r = dict(r)
    if r["op"] == op:
      for field in _TIME_FIELDS:
        if r.get(field) is not None:
          r[field] *= factor
    out.append(r)
  return out


def flagged(records: list[dict], past: list[dict], op: str | None = None) -> int:
  """How many of `records` (of `op`; or all, counting any failure) the check flags."""
  rows = history.check(records, past)
  if op is None:
    return sum(r.failed for r in rows)
  return sum("SLOWER" in r.status for r in rows if r.record["op"] == op)


def trial(measure, *, baseline: int, runs: int, op: str, slow: float, small: float) -> dict:
  """Runs the trial; `measure()` returns one run's records."""
  past = []
  for _ in range(baseline):
    past += measure()
  per_run = []
  for i in range(runs):
    recs = measure()
    per_run.append(
      {
        "run": i,
        "measurements": len(recs),
        "false_alarms": flagged(recs, past),
        f"{op}_slowed_flagged": flagged(planted(recs, op, 1 + slow), past, op),
        f"{op}_measurements": sum(r["op"] == op for r in recs),
        f"{op}_small_change_flagged": flagged(planted(recs, op, 1 + small), past, op),
      }
    )
    past += recs
  return {"baseline_runs": baseline, "op": op, "slow": slow, "small": small, "runs": per_run}


def summary(result: dict) -> str:
  op, runs = result["op"], result["runs"]
  n = len(runs)
  alarms = sum(r["false_alarms"] for r in runs)
  total = sum(r["measurements"] for r in runs)
  caught = sum(r[f"{op}_slowed_flagged"] == r[f"{op}_measurements"] for r in runs)
  small = sum(r[f"{op}_small_change_flagged"] for r in runs)
  return (
    f"{n} runs on unchanged code after {result['baseline_runs']} baseline runs: "
    f"{alarms} of {total} measurements flagged (false alarms); "
    f"+{result['slow']:.0%} planted in {op}: every measurement of it flagged in {caught} of "
    f"{n} runs; +{result['small']:.0%} planted: {small} flags"
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m bench.trial", description=__doc__)
  parser.add_argument("--baseline", type=int, default=5)
  parser.add_argument("--runs", type=int, default=10)
  parser.add_argument("--op", default="layer_norm")
  parser.add_argument("--slow", type=float, default=0.20)
  parser.add_argument("--small", type=float, default=0.03)
  parser.add_argument("--family", default=None)
  parser.add_argument("--iterations", type=int, default=30)
  parser.add_argument("--out", default=None, help="write the per-run counts here (JSON)")
  parser.add_argument("--records", default=None, help="append every measured record here")
  args = parser.parse_args(argv)
  if jax.default_backend() == "cpu" and history.CPU_XLA_FLAGS not in os.environ.get(
    "XLA_FLAGS", ""
  ):
    print(f"bench.trial: multi-threaded CPU timings; the nightly sets {history.CPU_XLA_FLAGS}")
  timer = history.default_timer(iterations=args.iterations)

  def measure():
    recs = history.run(args.family, timer=timer, log=lambda _: None)
    if args.records:
      history.append(recs, args.records)
    return recs

  result = trial(
    measure,
    baseline=args.baseline,
    runs=args.runs,
    op=args.op,
    slow=args.slow,
    small=args.small,
  )
  line = summary(result)
  print(line)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({**result, "summary": line}, f, indent=1)
  op = args.op
  runs = result["runs"]
  ok = all(
    r["false_alarms"] == 0
    and r[f"{op}_slowed_flagged"] == r[f"{op}_measurements"]
    and r[f"{op}_small_change_flagged"] == 0
    for r in runs
  )
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
