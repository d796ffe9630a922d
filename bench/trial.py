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
  python -m bench.trial --replay FILE.jsonl [--op ragged_dot] ...   (judges recorded runs)

(on a CPU host the nightly times with those flags; without them the trial warns).
"""

import argparse
import json
import math
import os
import statistics
import sys

import jax

from bench import history, records


def planted(records: list[dict], op: str, factor: float) -> list[dict]:
  """`records` with every time of `op` (device_time_*_ms: median, min, max, rounds) x `factor`.

  Its anchor's times (anchor_*) stay: a change of the op, not of the host.
  """
  out = []
  for r in records:
    r = dict(r)
    if r["op"] == op:
      for field, v in r.items():
        if field.startswith("device_time_") and field.endswith("_ms") and v is not None:
          r[field] = [x * factor for x in v] if isinstance(v, list) else v * factor
    out.append(r)
  return out


def flagged(records: list[dict], past: list[dict], op: str | None = None) -> int:
  """How many of `records` (of `op`; or all, counting any failure) the check flags."""
  rows = history.check(records, past)
  if op is None:
    return sum(r.failed for r in rows)
  return sum("SLOWER" in r.status for r in rows if r.record["op"] == op)


def trial(measure, *, baseline: int, runs: int, op: str, slow: float, small: float) -> dict:
  """Runs the trial; `measure()` returns one run's records.

  Returns:
    The settings, per-run counts ("runs") and per measured thing ("series", by
    `history.identity`) its run medians, limits and flags in the judged runs.
  """
  past = []
  for _ in range(baseline):
    past += measure()
  per_run, series = [], {}
  for i in range(runs):
    recs = measure()
    rows = history.check(recs, past)
    for row in rows:
      s = series.setdefault(repr(history.identity(row.record)), _series(row.record, past))
      s["run_medians_ms"].append(row.record["device_time_median_ms"])
      s["limits"].append(row.limit)
      s["flagged"] += row.failed
    per_run.append(
      {
        "run": i,
        "measurements": len(recs),
        "false_alarms": sum(r.failed for r in rows),
        f"{op}_slowed_flagged": flagged(planted(recs, op, 1 + slow), past, op),
        f"{op}_measurements": sum(r["op"] == op for r in recs),
        f"{op}_small_change_flagged": flagged(planted(recs, op, 1 + small), past, op),
      }
    )
    past += recs
  return {
    "baseline_runs": baseline,
    "op": op,
    "slow": slow,
    "small": small,
    "runs": per_run,
    "series": series,
  }


def _series(record: dict, past: list[dict]) -> dict:
  key = history.identity(record)
  return {
    "record": {k: record.get(k) for k in (*history.IDENTITY, "shapes", "commit", "date")},
    "baseline_medians_ms": [h["device_time_median_ms"] for h in past if history.identity(h) == key],
    "run_medians_ms": [],
    "limits": [],
    "flagged": 0,
  }


def results(result: dict) -> list[dict]:
  """The trial as bench.records records: per measured thing, the median of its judged runs;
  `extra` holds every run's median, the baseline's, the limits and the flags."""
  out = []
  for s in result["series"].values():
    r, meds = s["record"], s["run_medians_ms"]
    out.append(
      {
        "device": r["device_kind"],
        "commit": r["commit"],
        "date": r["date"],
        "op": r["op"],
        "implementation": r["implementation"],
        "case": f"{r['shape_key']} {r['case']}",
        "shape": {
          k: int(math.prod(v)) if isinstance(v, list | tuple) else v for k, v in r["shapes"].items()
        },
        "dtype": r["dtype"],
        "mode": r["mode"],
        "median_ms": statistics.median(meds),
        "method": r["device_time_method"],
        "extra": {k: v for k, v in s.items() if k != "record"} | {"host": r["host"]},
      }
    )
  return out


def recorded_runs(records: list[dict]) -> list[list[dict]]:
  """`records` (of several runs) grouped by run_id, in the order they were recorded."""
  runs: dict[str, list[dict]] = {}
  for r in records:
    runs.setdefault(r["run_id"], []).append(r)
  return list(runs.values())


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
  parser.add_argument("--iterations", type=int, default=history.ROUND_ITERATIONS)
  parser.add_argument("--out", default=None, help="write the per-run counts here (JSON)")
  parser.add_argument(
    "--results",
    default=None,
    help="write the trial as bench.records records here (bench/results/<device>/...json)",
  )
  parser.add_argument("--records", default=None, help="append every measured record here")
  parser.add_argument(
    "--replay",
    default=None,
    help="measure nothing: take the runs from this --records file of an earlier trial "
    "(the rule, or another --op, judged on the same measurements)",
  )
  args = parser.parse_args(argv)
  if args.replay:
    runs = recorded_runs(history.load(args.replay))
    args.runs = min(args.runs, len(runs) - args.baseline)
    recorded = iter(runs)
    measure = lambda: next(recorded)
  else:
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
  if args.results:
    how = f"runs replayed from {os.path.basename(args.replay)}" if args.replay else "measured"
    note = f"bench.trial (the nightly regression check on unchanged code; {how}): {line}"
    records.write(args.results, results(result), note=note)
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
