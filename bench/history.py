"""Benchmark history: one JSON record per measurement, appended to a versioned file, and its check.

`run` times the benchmark cases of a hardware family's matrix
(`bench.cases.bench_cases`) through every implementation that compiles
here, with the harness timer (`tokamax_harness.timing`), the ops' cost model
(`SPEC.cost`, via `tokamax_harness.bench.measurement`), the compiled program's memory
and the numerics drift against the high-precision reference (on the small
golden-size inputs of the same op, feature and dtype; the forward output in
both modes). `check` compares a run with earlier runs of the same thing and
flags slowdowns that stand out of the baseline's noise, and drift past
tolerance.

The regression rule (`verdict`). The baseline of a measurement is the last
`WINDOW` (10) earlier runs with the same identity (`IDENTITY`: device kind and
host, timer method, op, implementation, case, shape, dtype, mode; a CUPTI
time is never compared with a wallclock one). With fewer than `MIN_RUNS` (3)
such runs there is no timing verdict ("no baseline yet"). Otherwise, with
  base   = the median of the baseline runs' medians,
  spread = 1.4826 x median(|run median - base|) / base   (the robust, MAD-based
           relative spread of the baseline's own runs; 1.4826 makes it a
           standard deviation for normal noise),
  limit  = max(threshold, K x spread)   (threshold 5%, K = 3),
the measurement is SLOWER when
  (a) its median exceeds base x (1 + limit), and
  (b) where the record and its baseline carry their fastest samples
      (`device_time_min_ms`, the minimum over iterations and input rotations),
      the record's fastest exceeds the median of the baseline runs' fastest by
      the threshold: the slowdown holds across its samples, not only in their
      middle (a slow stretch of a loaded host inflates a median, not a minimum).
Wallclock measurements span at least MIN_SECONDS (short calls get more
iterations). On a CPU host the nightly times single-threaded XLA
(`ci/nightly.sh`), whose run-to-run spread is a few percent.
A quiet baseline (spread near 0) thus flags anything past the threshold; a
noisy one (a loaded CPU host) flags only what stands K spreads out. DRIFT is
judged against any baseline (one earlier run suffices): the error against the
reference is past tolerance while the baseline's was not, or grew by more
than `DRIFT_MARGIN` tolerance bounds.

Where runs go: `run` appends to bench/out/history.jsonl (ignored by git) and
checks against the tracked bench/history.jsonl plus that local file;
`--append-tracked` (the nightly) appends to the tracked file instead, and
`--history FILE` reads and appends FILE only; `--no-append` appends nowhere.

  python -m bench.history run [--check] [--threshold 0.05] [--append-tracked | --history FILE]
  python -m bench.history check --records FILE
  python -m bench.history ingest FILE...
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bench import cases as cases_lib
from tokamax._src import benchmarking
from tokamax_harness import bench, compare, grads, hardware, timing, tolerance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HISTORY = os.path.join(ROOT, "bench", "history.jsonl")  # Tracked: the nightly's runs.
LOCAL_HISTORY = os.path.join(ROOT, "bench", "out", "history.jsonl")  # Ignored: local runs.
THRESHOLD = 0.05  # The least slowdown (of the baseline median) that fails the check.
NOISE_K = 3.0  # ... or this many robust spreads of the baseline, if larger.
DRIFT_MARGIN = 1.0  # Drift growing by more than one tolerance bound fails it.
WINDOW = 10  # The baseline: this many earlier runs at most.
MIN_RUNS = 3  # Fewer baseline runs than this: no timing verdict.
MAD_TO_SIGMA = 1.4826
NO_BASELINE = "no baseline yet"

# Fields that identify one benchmarked thing across runs ("host" tells CPU machines apart).
# TOKAMAX_RUN_ID, where set, names the run (several invocations can make one run).
IDENTITY = (
  "device_kind",
  "host",
  "device_time_method",  # CUPTI kernel time and wallclock are not compared.
  "op",
  "implementation",
  "case",
  "shape_key",
  "dtype",
  "mode",
)

Timer = Callable[[Callable, Sequence[tuple]], timing.Timing]


# Wallclock measurements (CPU) span at least this long: short calls get more samples.
MIN_SECONDS = 0.3
# XLA_FLAGS of the nightly's CPU timings: single-threaded XLA, whose times vary a few percent
# between runs (multi-threaded ones switch between modes up to 2x apart on a small host).
CPU_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def default_timer(iterations: int = 30, warmup: int = 3) -> Timer:
  """The harness timer (CUPTI kernel time on NVIDIA GPUs, else wallclock of >= MIN_SECONDS)."""
  return lambda fn, args_list: timing.device_time(
    fn, args_list, warmup=warmup, iterations=iterations, min_seconds=MIN_SECONDS
  )


# --- measuring ----------------------------------------------------------------


def _is_array(x) -> bool:
  return isinstance(x, jax.Array | np.ndarray)


@dataclasses.dataclass(frozen=True)
class _Split:
  """A call's arguments as array leaves (traced) and everything else (static)."""

  leaves: tuple
  treedef: object
  dynamic: tuple[int, ...]  # Indices of array leaves.
  diff: tuple[int, ...]  # Indices of differentiable array leaves.

  def values(self) -> tuple:
    return tuple(self.leaves[i] for i in self.dynamic)

  def rebuild(self, values: Sequence) -> tuple[tuple, dict]:
    full = list(self.leaves)
    for i, v in zip(self.dynamic, values, strict=True):
      full[i] = v
    return jax.tree.unflatten(self.treedef, full)


def _split(case: cases_lib.Case, args: tuple, kwargs: dict) -> _Split:
  with_path, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
  diff_args = set(case.builder_diff(args))
  leaves, dynamic, diff = [], [], []
  for i, (path, leaf) in enumerate(with_path):
    leaves.append(leaf)
    if _is_array(leaf):
      dynamic.append(i)
      in_args = path[0].idx == 0
      if in_args and path[1].idx in diff_args and jnp.issubdtype(leaf.dtype, jnp.floating):
        diff.append(i)
  return _Split(tuple(leaves), treedef, tuple(dynamic), tuple(diff))


def benchmark_fn(case: cases_lib.Case, impl: Callable, split: _Split, mode: str) -> Callable:
  """A jittable function of (array leaves, cotangent) for `mode` ("fwd" or "fwd_bwd")."""

  def fwd(values, cotangent=None):
    del cotangent
    a, k = split.rebuild(values)
    return impl(*a, **k)

  if mode == "fwd":
    return fwd
  if mode != "fwd_bwd":
    raise ValueError(f"unknown mode {mode!r}")
  pos = [split.dynamic.index(i) for i in split.diff]

  def fwd_bwd(values, cotangent):
    def of_diff(diff_values):
      full = list(values)
      for p, v in zip(pos, diff_values, strict=True):
        full[p] = v
      return fwd(full)

    return grads.vjp(of_diff, ([values[p] for p in pos],), cotangent)

  return fwd_bwd


def drift(
  case: cases_lib.Case, impl: Callable, *, eager: bool = False, platform: str | None = None
) -> dict:
  """The implementation's error against the reference on the small golden-size inputs.

  Returns:
    drift_max_error (max abs error), drift_ratio (max of error / the policy's
    bound; above 1 is past tolerance somewhere), drift_ok (the harness
    comparator's verdict) and drift_shape.
  """
  small = cases_lib.small(case)
  args, kwargs = small.make_args(cases_lib.case_key(small))
  out = np.asarray(jax.tree.leaves(small.call(impl, args, kwargs, jit=not eager))[0])
  ref = np.asarray(jax.tree.leaves(small.reference(args, kwargs))[0])
  tol = tolerance.for_dtype(
    case.dtype, platform=platform or jax.default_backend(), has_matmul=case.has_matmul
  )
  err = np.abs(out.astype(np.float64) - ref)
  bound = tol.bound(ref, small.reduction_length)
  ratio = float(np.max(err / bound)) if err.size else 0.0
  report = compare.compare(out, ref, tol=tol, reduction_length=small.reduction_length)
  return {
    "drift_max_error": float(err.max()) if err.size else 0.0,
    "drift_ratio": ratio if np.isfinite(ratio) else 1e30,
    "drift_ok": bool(report.ok),
    "drift_shape": dict(small.shape),
    "drift_of": "forward output",
  }


def host() -> str:
  """The CPU model and core count (CPU timings compare only on the same kind of host)."""
  model = "unknown cpu"
  try:
    with open("/proc/cpuinfo") as f:
      model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
  except OSError:
    pass
  return f"{model} x{os.cpu_count()}"


def shape_key(shape: dict) -> str:
  return ",".join(
    f"{k}={'x'.join(map(str, v)) if isinstance(v, list | tuple) else v}"
    for k, v in sorted(shape.items())
  )


def run(
  family: str | None = None,
  *,
  ops: Iterable[str] | None = None,
  implementations: Iterable[str] | None = None,
  features: Iterable[str] | None = None,
  modes: Iterable[str] | None = None,
  timer: Timer | None = None,
  override: Callable | None = None,
  rotations: int = 2,
  budget_s: float | None = None,
  log: Callable[[str], None] = print,
  sink: Callable[[dict], None] | None = None,
) -> list[dict]:
  """Measures the family's benchmark cases through every native implementation here.

  Args:
    family: The matrix whose `BENCH` to run (default: the hardware's).
    ops, implementations, features, modes: Restrict to these.
    timer: (fn, args_list) -> Timing (default: the harness device timer).
    override: (case, impl) -> callable run instead of `impl` (tests plant
      slowdowns and numerics changes with it).
    rotations: Distinct input sets, used in turn.
    budget_s: Starts no new measurement after this many seconds.
    log: Where progress and skips go.

  Returns:
    One record per measurement (see `record`).
  """
  profile = hardware.detect()
  family = family or profile.family
  timer = timer or default_timer()
  env = bench.environment()
  run_id = os.environ.get("TOKAMAX_RUN_ID") or f"{env['commit'][:12]}@{env['date']}"
  start = time.monotonic()
  records = []
  inputs: dict = {}
  drifts: dict = {}
  ops = list(ops) if ops else None
  for op in cases_lib.OPS:
    if ops is not None and op not in ops:
      continue
    impls = cases_lib.implementations(op, profile)
    for bcase in cases_lib.bench_cases(family, op=op):
      case, mode = bcase.case, bcase.mode
      if (features and case.feature not in features) or (modes and mode not in modes):
        continue
      for impl in impls:
        if implementations and impl.name not in implementations:
          continue
        label = f"{op}[{impl.name}] {case.id} {mode}"
        if budget_s is not None and time.monotonic() - start > budget_s:
          log(f"SKIP {label}: past the {budget_s:g} s budget")
          continue
        if impl.reason is not None:
          log(f"SKIP {label}: {impl.reason}")
          continue
        if case.id not in inputs:
          inputs.clear()  # Large inputs: keep one case's at a time.
          key = cases_lib.case_key(case)
          inputs[case.id] = [case.make_args(jax.random.fold_in(key, i)) for i in range(rotations)]
        args_list = inputs[case.id]
        try:
          reason = impl.unsupported_reason(*args_list[0])
        except Exception as e:
          reason = f"unsupported_reason raised {type(e).__name__}: {e}"
        if reason is not None:
          log(f"SKIP {label}: {reason}")
          continue
        fn = override(case, impl) if override else impl
        try:
          rec = _measure(case, mode, impl.name, fn, args_list, timer)
          dkey = (case.id, impl.name)
          if dkey not in drifts:
            try:
              drifts[dkey] = drift(case, fn, platform=profile.platform)
            except Exception as e:  # Timing stands; the drift is reported as unknown.
              log(f"drift of {label} failed: {type(e).__name__}: {str(e)[:300]}")
              drifts[dkey] = {"drift_ratio": None, "drift_ok": None, "drift_error": str(e)[:300]}
          rec.update(drifts[dkey])
        except Exception as e:
          log(f"ERROR {label}: {type(e).__name__}: {str(e)[:300]}")
          continue
        rec.update(
          run_id=run_id,
          commit=env["commit"],
          date=env["date"],
          jax_version=env["jax_version"],
          platform=profile.platform,
          host=host() if profile.platform == "cpu" else None,
        )
        records.append(rec)
        if sink is not None:  # Written as it comes, so that a run cut short keeps it.
          sink(rec)
        log(
          f"{label}: {rec['device_time_median_ms']:.4g} ms"
          + (f", {rec['tflops_per_s']:.4g} TFLOP/s" if rec.get("tflops_per_s") else "")
          + (f", {rec['gb_per_s']:.4g} GB/s" if rec.get("gb_per_s") else "")
          + (
            f", drift {rec['drift_ratio']:.3g} of tolerance"
            if rec["drift_ratio"] is not None
            else ""
          )
        )
  return records


def _measure(case, mode, impl_name, fn, args_list, timer) -> dict:
  splits = [_split(case, a, k) for a, k in args_list]
  f = benchmark_fn(case, fn, splits[0], mode)
  values = [s.values() for s in splits]
  cotangent = None
  if mode == "fwd_bwd":
    out = jax.eval_shape(lambda v: benchmark_fn(case, fn, splits[0], "fwd")(v), values[0])
    keys = jax.random.split(cases_lib.case_key(case), len(values))
    cotangents = [jax.random.normal(k, out.shape, out.dtype) for k in keys]
  else:
    cotangents = [cotangent] * len(values)
  # One argument (a tuple): tokamax's CUPTI timer calls the compiled program with one.
  call_args = [((v, c),) for v, c in zip(values, cotangents, strict=True)]
  compiled = jax.jit(lambda a: f(*a)).lower(*call_args[0]).compile()
  result = timer(compiled, call_args)
  args, kwargs = args_list[0]
  m = bench.measurement(
    op=case.op,
    implementation=impl_name,
    case=case.feature,
    mode=mode,
    shapes=case.shape_dict,
    dtype=case.dtype,
    result=result,
    cost=case.cost(args, kwargs),
  )
  rec = m.as_dict()
  rec["shape_key"] = shape_key(case.shape_dict)
  rec["peak_memory_bytes"] = benchmarking._peak_memory_bytes(compiled)
  return rec


# --- history ------------------------------------------------------------------


def load(path: str = HISTORY) -> list[dict]:
  """Every record in the history file (none if it does not exist)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def append(records: Iterable[dict], path: str = HISTORY) -> int:
  """Appends records not already there (same run_id and identity); returns how many."""
  seen = {(r.get("run_id"), identity(r)) for r in load(path)}
  new = [r for r in records if (r.get("run_id"), identity(r)) not in seen]
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "a") as f:
    for r in new:
      f.write(json.dumps(r, sort_keys=True, default=str) + "\n")
  return len(new)


def identity(r: dict) -> tuple:
  return tuple(
    r.get(k) if k != "shape_key" else r.get(k) or shape_key(r["shapes"]) for k in IDENTITY
  )


@dataclasses.dataclass(frozen=True)
class Verdict:
  """A median against its baseline runs' medians (the rule in the module docstring)."""

  slower: bool | None  # None: fewer than MIN_RUNS baseline runs.
  baseline_ms: float | None
  spread: float | None  # Relative robust spread of the baseline runs.
  limit: float | None  # The slowdown allowed: max(threshold, k x spread).
  runs: int


def verdict(
  record: dict,
  past: Sequence[dict],
  *,
  threshold: float = THRESHOLD,
  k: float = NOISE_K,
  min_runs: int = MIN_RUNS,
) -> Verdict:
  """Whether `record` is slower than its baseline `past` (same identity, earlier runs)."""
  meds = [h["device_time_median_ms"] for h in past if h.get("device_time_median_ms")]
  if not meds:
    return Verdict(None, None, None, None, 0)
  base = statistics.median(meds)
  if len(meds) < min_runs:
    return Verdict(None, base, None, None, len(meds))
  mad = statistics.median(abs(m - base) for m in meds)
  spread = MAD_TO_SIGMA * mad / base if base > 0 else 0.0
  limit = max(threshold, k * spread)
  now = record["device_time_median_ms"]
  slower = now > base * (1.0 + limit)
  fastest = record.get("device_time_min_ms")
  past_fastest = [h["device_time_min_ms"] for h in past if h.get("device_time_min_ms")]
  if slower and fastest is not None and past_fastest:
    # The slowdown holds across the record's samples: its fastest one is slower than the
    # baseline runs' fastest by the threshold too (a slow stretch inflates a median only).
    slower = fastest > statistics.median(past_fastest) * (1.0 + threshold)
  return Verdict(slower, base, spread, limit, len(meds))


@dataclasses.dataclass(frozen=True)
class Row:
  """One measurement against its baseline."""

  record: dict
  status: str  # "ok", "SLOWER", "DRIFT", "SLOWER+DRIFT", "new" or NO_BASELINE
  baseline_ms: float | None
  baseline_drift: float | None
  runs: int
  limit: float | None = None  # The slowdown allowed (see `verdict`).

  @property
  def change(self) -> float | None:
    if self.baseline_ms is None:
      return None
    return self.record["device_time_median_ms"] / self.baseline_ms - 1.0

  @property
  def failed(self) -> bool:
    return self.status not in ("ok", "new", NO_BASELINE)


def check(
  records: Sequence[dict],
  history: Sequence[dict],
  *,
  threshold: float = THRESHOLD,
  drift_margin: float = DRIFT_MARGIN,
  window: int = WINDOW,
  k: float = NOISE_K,
) -> list[Row]:
  """Each record against the earlier runs of the same thing on the same device kind.

  A record is SLOWER by the rule of the module docstring (`verdict`: past
  max(`threshold`, `k` robust spreads) of the last `window` earlier runs, its
  fastest sample slower than their median too; "no baseline yet" with fewer
  than 3); DRIFT when its error against the reference is past tolerance (the
  comparator fails or exceeds every bound) while the baseline's was not, or
  grew by more than `drift_margin` tolerance bounds. "new": no earlier run.
  """
  run_ids = {r.get("run_id") for r in records}
  earlier: dict[tuple, list[dict]] = {}
  for h in history:
    if h.get("run_id") not in run_ids:
      earlier.setdefault(identity(h), []).append(h)
  rows = []
  for r in records:
    past = sorted(earlier.get(identity(r), []), key=lambda h: h.get("date", ""))[-window:]
    if not past:
      rows.append(Row(r, "new", None, None, 0))
      continue
    v = verdict(r, past, threshold=threshold, k=k)
    past_drift = [h["drift_ratio"] for h in past if h.get("drift_ratio") is not None]
    base_drift = statistics.median(past_drift) if past_drift else None
    base_ok = all(h.get("drift_ok") is not False for h in past)
    slower = bool(v.slower)
    now_drift = r.get("drift_ratio")
    drifted = now_drift is not None and (
      (base_ok and r.get("drift_ok") is False)
      or (base_drift is not None and now_drift > base_drift + drift_margin)
    )
    status = "+".join(s for s, on in (("SLOWER", slower), ("DRIFT", drifted)) if on)
    status = status or ("ok" if v.slower is not None else NO_BASELINE)
    rows.append(Row(r, status, v.baseline_ms, base_drift, len(past), v.limit))
  return rows


def table(rows: Sequence[Row], *, threshold: float = THRESHOLD) -> str:
  """A readable table, failures first."""
  header = (
    "status",
    "op",
    "impl",
    "case",
    "shape",
    "dtype",
    "mode",
    "base ms",
    "now ms",
    "change",
    "limit",
    "drift base",
    "drift now",
    "runs",
  )
  body = []
  for row in sorted(rows, key=lambda x: (not x.failed, x.record["op"], x.record["implementation"])):
    r = row.record
    body.append(
      (
        row.status,
        r["op"],
        r["implementation"],
        r["case"],
        r.get("shape_key") or shape_key(r["shapes"]),
        r["dtype"],
        r["mode"],
        "-" if row.baseline_ms is None else f"{row.baseline_ms:.4g}",
        f"{r['device_time_median_ms']:.4g}",
        "-" if row.change is None else f"{100 * row.change:+.1f}%",
        "-" if row.limit is None else f"{100 * row.limit:.1f}%",
        "-" if row.baseline_drift is None else f"{row.baseline_drift:.3g}",
        "-" if r.get("drift_ratio") is None else f"{r['drift_ratio']:.3g}",
        str(row.runs),
      )
    )
  widths = [max(len(str(x)) for x in col) for col in zip(header, *body, strict=False)]
  fmt = lambda cells: "  ".join(f"{c:<{w}}" for c, w in zip(cells, widths, strict=True))
  lines = [fmt(header), fmt(["-" * w for w in widths])] + [fmt(b) for b in body]
  failed = [r for r in rows if r.failed]
  lines.append(
    f"{len(failed)} of {len(rows)} measurements regressed (slowdown: the median past "
    f"max({100 * threshold:g}%, {NOISE_K:g} robust spreads of the baseline runs) = limit, "
    f"and the fastest sample slower than the baseline median; drift in tolerance bounds; "
    f"{sum(r.status == NO_BASELINE for r in rows)} with no baseline yet "
    f"(fewer than {MIN_RUNS} earlier runs))"
  )
  return "\n".join(lines)


# --- command line -------------------------------------------------------------


def _csv(s: str | None):
  return s.split(",") if s else None


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m bench.history", description=__doc__)
  parser.add_argument("command", nargs="?", default="run", choices=("run", "check", "ingest"))
  parser.add_argument("files", nargs="*", help="ingest: record files (JSON lines)")
  parser.add_argument(
    "--history",
    default=None,
    help="the history file (JSON lines); run: read and append only this file "
    "(default: append to bench/out/history.jsonl, check against it and the tracked file)",
  )
  parser.add_argument(
    "--append-tracked",
    action="store_true",
    help="run: append to the tracked bench/history.jsonl (the nightly)",
  )
  parser.add_argument("--check", action="store_true", help="run: fail on regressions")
  parser.add_argument("--threshold", type=float, default=THRESHOLD, help="slowdown, e.g. 0.05")
  parser.add_argument("--drift-margin", type=float, default=DRIFT_MARGIN)
  parser.add_argument("--window", type=int, default=WINDOW)
  parser.add_argument("--k", type=float, default=NOISE_K, help="robust spreads allowed")
  parser.add_argument("--no-append", action="store_true", help="run: leave the history alone")
  parser.add_argument("--out", default=None, help="run: also write the records here")
  parser.add_argument("--records", default=None, help="check: the records to check")
  parser.add_argument("--family", default=None)
  parser.add_argument("--commit", default=None, help="ingest: the commit of records without one")
  parser.add_argument("--ops", default=None, help="comma-separated")
  parser.add_argument("--impls", default=None, help="comma-separated")
  parser.add_argument("--features", default=None, help="comma-separated")
  parser.add_argument("--modes", default=None, help="comma-separated: fwd,fwd_bwd")
  parser.add_argument("--iterations", type=int, default=30)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--budget-s", type=float, default=None)
  args = parser.parse_intermixed_args(argv)
  if args.append_tracked and args.history:
    parser.error("--append-tracked and --history name two files: give one")
  if args.command == "ingest":
    target = args.history or HISTORY
    for path in args.files:
      n = append([_with_commit(r, args.commit) for r in load(path)], target)
      print(f"{path}: appended {n} records to {target}")
    return 0
  if args.command == "run":
    target = args.history or (HISTORY if args.append_tracked else LOCAL_HISTORY)
    sources = [target] if args.history or args.append_tracked else [HISTORY, LOCAL_HISTORY]
  else:
    target = args.history or HISTORY
    sources = [target]
  history = [r for path in sources for r in load(path)]
  if args.command == "check":
    records = load(args.records) if args.records else _latest_run(history)
  else:
    records = run(
      args.family,
      ops=_csv(args.ops),
      implementations=_csv(args.impls),
      features=_csv(args.features),
      modes=_csv(args.modes),
      timer=default_timer(args.iterations, args.warmup),
      budget_s=args.budget_s,
      sink=(lambda rec: append([rec], args.out)) if args.out else None,
    )
    if not args.no_append:
      n = append(records, target)
      print(f"appended {n} records to {target}")
  rows = check(
    records,
    history,
    threshold=args.threshold,
    drift_margin=args.drift_margin,
    window=args.window,
    k=args.k,
  )
  print(table(rows, threshold=args.threshold))
  if (args.check or args.command == "check") and any(r.failed for r in rows):
    print("FAILED: regressions against earlier runs on the same device kind (table above).")
    return 1
  return 0


def _with_commit(record: dict, commit: str | None) -> dict:
  """The record with `commit` filled in where the run could not tell (no .git on device)."""
  if not commit or record.get("commit") not in (None, "", "unknown"):
    return record
  run_id = record.get("run_id", "")
  return {**record, "commit": commit, "run_id": commit[:12] + run_id.removeprefix("unknown")}


def _latest_run(history: list[dict]) -> list[dict]:
  if not history:
    return []
  last = max(history, key=lambda r: r.get("date", ""))["run_id"]
  return [r for r in history if r.get("run_id") == last]


if __name__ == "__main__":
  sys.exit(main())
