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

How a run measures (`run`): every measurement is compiled first, then timed in
`CPU_ROUNDS` (10) interleaved rounds on a CPU backend (1 elsewhere), each on
fresh input buffers, so that a slow stretch of the host or an unlucky memory
placement is one round of many; a record's time (`device_time_median_ms`) is
the median of its round medians (`device_time_rounds_ms`). Each case's first
anchor (`bench.cases.anchors`: plain jnp, jax.nn, jax.lax) is timed in the
same rounds and rides on the case's records (`anchor`, `anchor_rounds_ms`):
this cloud host's own speed drifts by up to 20% over minutes, unevenly across
ops, and moves an op and its anchor alike. On a CPU backend
the time is the process's CPU time (`timing.CPUTIME`, rounds of at least
MIN_SECONDS): a neighbour on a shared host stretches wallclock (2-4x under a
test run on this 2-core host), not the CPU time spent; the nightly times
single-threaded XLA (`CPU_XLA_FLAGS`, `ci/nightly.sh`). On NVIDIA GPUs it is
CUPTI kernel time.

The regression rule (`verdict`). The baseline of a measurement is the last
`WINDOW` (10) earlier runs with the same identity (`IDENTITY`: device kind and
host, timer method, op, implementation, case, shape, dtype, mode; times of
different timers are never compared). With fewer than `MIN_RUNS` (3) such runs
there is no timing verdict ("no baseline yet"). Otherwise, with
  base   = the median of the baseline runs' medians,
  noise  = the largest of (`noise`): the baseline runs' robust relative spread
           (1.4826 x median(|run median - base|) / base, a standard deviation for
           normal noise); the standard error of this record's median from its
           rounds' spread; and the timer's floor `NOISE_FLOOR` (3% for CPU and
           wallclock times, none for CUPTI: five baseline runs can look quieter
           than the host is),
  limit  = max(threshold, K x noise)   (threshold 5%, K = 3; 9% on a CPU host),
the measurement is SLOWER when
  (a) its median exceeds base x (1 + limit), and
  (b) the slowdown holds across its rounds: their lower quartile exceeds
      base x (1 + threshold) (a few slow rounds of a loaded host inflate a
      median, not three rounds in four). Records without rounds (older runs)
      need their fastest sample (`device_time_min_ms`) past the baseline runs'
      fastest by the threshold instead.
  (c) where the record and at least MIN_RUNS baseline runs carry the anchor's
      rounds: the op's time over its anchor's (the median of per-round ratios)
      exceeds the baseline runs' ratio by the same rule (limit from the
      ratios' noise): the host's drift moves both and is not a regression; a
      change that slows the anchor alike (a JAX or XLA upgrade) is not flagged.
Measured with `python -m bench.trial` on this 2-core CPU host
(bench/results/cpu/nightly_trial_f03cba3_layer_norm.json, ..._ragged_dot.json):
no false alarm in 2 x 140 measurements on unchanged code, no planted 3% change
flagged; a planted 20% slowdown of layer_norm flagged in 10 of 10 runs, of
ragged_dot in 7 of 10 (its forward+backward's ratio to its anchor is noisy:
condition (c) costs sensitivity where the anchor is noisy, and buys freedom
from the host's drift: 6 false alarms without it when drifted runs were judged).
DRIFT is judged against any baseline (one earlier run suffices): the error
against the reference is past tolerance while the baseline's was not, or grew
by more than `DRIFT_MARGIN` tolerance bounds.

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
import functools
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
NOISE_K = 3.0  # ... or this many noise spreads (`noise`), if larger.
# The least relative noise assumed of one run's median, per timing method (bench.trial on
# a 2-core CPU host); CUPTI kernel times have none assumed.
NOISE_FLOOR = {"cputime": 0.03, "wallclock": 0.03}
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


# Wallclock rounds (CPU) span at least this long: short calls get more samples.
MIN_SECONDS = 0.15
# Interleaved timing rounds per measurement on a CPU backend (fresh input buffers each).
CPU_ROUNDS = 10
ROUND_ITERATIONS = 5  # Timed calls per round at least (more where MIN_SECONDS asks).
# XLA_FLAGS of the nightly's CPU timings: single-threaded XLA, whose times vary a few percent
# between runs (multi-threaded ones switch between modes up to 2x apart on a small host).
CPU_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def default_timer(iterations: int = ROUND_ITERATIONS, warmup: int = 3) -> Timer:
  """The harness timer: CUPTI kernel time on NVIDIA GPUs, the process's CPU time on a CPU
  backend (a busy neighbour on a shared host stretches wallclock, not it), else wallclock;
  host-timed rounds span >= MIN_SECONDS."""

  def timer(fn, args_list):
    method = timing.CPUTIME if jax.default_backend() == "cpu" else "auto"
    return timing.device_time(
      fn, args_list, warmup=warmup, iterations=iterations, method=method, min_seconds=MIN_SECONDS
    )

  return timer


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


@dataclasses.dataclass
class _Job:
  """One measurement being taken: its compiled program and its rounds' timings."""

  label: str
  case: cases_lib.Case
  mode: str
  impl_name: str
  compiled: object
  call_args: Callable[[], list]  # Fresh input buffers (rotations) for one round.
  cost: object
  info: dict  # Drift and run fields.
  timings: list | None = dataclasses.field(default_factory=list)  # None: failed.
  anchor: "_Job | None" = None  # The op's anchor, timed in the same rounds.
  is_anchor: bool = False


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
  rounds: int | None = None,
  with_anchors: bool = True,
  budget_s: float | None = None,
  log: Callable[[str], None] = print,
  sink: Callable[[dict], None] | None = None,
) -> list[dict]:
  """Measures the family's benchmark cases through every native implementation here.

  Every measurement is compiled first; then `rounds` rounds time each in turn,
  on fresh input buffers each round, so that a slow stretch of the host or an
  unlucky memory placement is one round of many rather than a whole
  measurement. A record's time is the median of its round medians.

  Args:
    family: The matrix whose `BENCH` to run (default: the hardware's).
    ops, implementations, features, modes: Restrict to these.
    timer: (fn, args_list) -> Timing (default: the harness device timer).
    override: (case, impl) -> callable run instead of `impl` (tests plant
      slowdowns and numerics changes with it).
    rotations: Distinct input sets, used in turn.
    rounds: Interleaved timing rounds (default: `CPU_ROUNDS` on a CPU
      backend, where host timing is noisy, else 1).
    with_anchors: Also time each case's first anchor (`bench.cases.anchors`)
      in the same rounds; records carry it (`anchor_rounds_ms`), so that the
      check can tell the host's drift from the op's.
    budget_s: Starts no new measurement (or round) after this many seconds.
    log: Where progress and skips go.
    sink: Gets each record as it is made.

  Returns:
    One record per measurement (see `record`).
  """
  profile = hardware.detect()
  family = family or profile.family
  timer = timer or default_timer()
  if rounds is None:
    rounds = CPU_ROUNDS if jax.default_backend() == "cpu" else 1
  env = bench.environment()
  run_id = os.environ.get("TOKAMAX_RUN_ID") or f"{env['commit'][:12]}@{env['date']}"
  start = time.monotonic()
  over_budget = lambda: budget_s is not None and time.monotonic() - start > budget_s
  jobs = []
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
      args_list = None  # Large inputs: one case's at a time.
      n_before = len(jobs)
      for impl in impls:
        if implementations and impl.name not in implementations:
          continue
        label = f"{op}[{impl.name}] {case.id} {mode}"
        if over_budget():
          log(f"SKIP {label}: past the {budget_s:g} s budget")
          continue
        if impl.reason is not None:
          log(f"SKIP {label}: {impl.reason}")
          continue
        make_args = functools.partial(_inputs, case, rotations)
        args_list = args_list or make_args()
        try:
          reason = impl.unsupported_reason(*args_list[0])
        except Exception as e:
          reason = f"unsupported_reason raised {type(e).__name__}: {e}"
        if reason is not None:
          log(f"SKIP {label}: {reason}")
          continue
        fn = override(case, impl) if override else impl
        try:
          job = _prepare(label, case, mode, impl.name, fn, args_list, make_args)
          dkey = (case.id, impl.name)
          if dkey not in drifts:
            try:
              drifts[dkey] = drift(case, fn, platform=profile.platform)
            except Exception as e:  # Timing stands; the drift is reported as unknown.
              log(f"drift of {label} failed: {type(e).__name__}: {str(e)[:300]}")
              drifts[dkey] = {"drift_ratio": None, "drift_ok": None, "drift_error": str(e)[:300]}
          job.info.update(drifts[dkey])
        except Exception as e:
          log(f"ERROR {label}: {type(e).__name__}: {str(e)[:300]}")
          continue
        jobs.append(job)
      timed = with_anchors and len(jobs) > n_before
      anchor = _anchor_job(case, mode, rotations, args_list) if timed else None
      for job in jobs[n_before:] if anchor else ():
        job.anchor = anchor
      jobs += [anchor] if anchor else []
  for i in range(rounds):
    if i and over_budget():
      log(f"past the {budget_s:g} s budget after {i} of {rounds} rounds")
      break
    shift = i % max(len(jobs), 1)  # Each round starts at another measurement.
    for job in jobs[shift:] + jobs[:shift]:
      if job.timings is None:
        continue
      try:
        job.timings.append(timer(job.compiled, job.call_args()))
      except Exception as e:
        log(f"ERROR {job.label}: {type(e).__name__}: {str(e)[:300]}")
        job.timings = None
  records = []
  for job in jobs:
    if not job.timings or job.is_anchor:
      continue
    rec = _record(job)
    rec.update(job.info)
    if job.anchor is not None and job.anchor.timings:
      rec.update(
        anchor=job.anchor.impl_name,
        anchor_rounds_ms=[t.median_ms for t in job.anchor.timings],
        anchor_median_ms=statistics.median(t.median_ms for t in job.anchor.timings),
      )
    rec.update(
      run_id=run_id,
      commit=env["commit"],
      date=env["date"],
      jax_version=env["jax_version"],
      platform=profile.platform,
      host=host() if profile.platform == "cpu" else None,
    )
    records.append(rec)
    if sink is not None:
      sink(rec)
    log(
      f"{job.label}: {rec['device_time_median_ms']:.4g} ms"
      + (f", {rec['tflops_per_s']:.4g} TFLOP/s" if rec.get("tflops_per_s") else "")
      + (f", {rec['gb_per_s']:.4g} GB/s" if rec.get("gb_per_s") else "")
      + (f", drift {rec['drift_ratio']:.3g} of tolerance" if rec["drift_ratio"] is not None else "")
    )
  return records


def _anchor_job(case, mode, rotations, args_list) -> _Job | None:
  """The first of the op's anchors (a plain jnp or jax formulation), or None."""
  for name, anchor in cases_lib.anchors(case.op).items():
    fn = lambda *a, _anchor=anchor, **k: _anchor(a, k)
    make_args = functools.partial(_inputs, case, rotations)
    try:
      job = _prepare(
        f"{case.op}[{name}] {case.id} {mode}", case, mode, name, fn, args_list, make_args
      )
    except Exception:  # An anchor that cannot run this case: none.
      return None
    return dataclasses.replace(job, is_anchor=True)
  return None


def _inputs(case: cases_lib.Case, rotations: int) -> list[tuple[tuple, dict]]:
  """The case's `rotations` input sets (the same values every call, in fresh buffers)."""
  key = cases_lib.case_key(case)
  return [case.make_args(jax.random.fold_in(key, i)) for i in range(rotations)]


def _prepare(label, case, mode, impl_name, fn, args_list, make_args) -> _Job:
  """Compiles one measurement; its inputs are remade (fresh buffers) for every round."""
  splits = [_split(case, a, k) for a, k in args_list]
  f = benchmark_fn(case, fn, splits[0], mode)

  def call_args(args_list=None):
    splits = [_split(case, a, k) for a, k in (args_list or make_args())]
    values = [s.values() for s in splits]
    cotangents = [None] * len(values)
    if mode == "fwd_bwd":
      out = jax.eval_shape(lambda v: benchmark_fn(case, fn, splits[0], "fwd")(v), values[0])
      keys = jax.random.split(cases_lib.case_key(case), len(values))
      cotangents = [jax.random.normal(k, out.shape, out.dtype) for k in keys]
    # One argument (a tuple): tokamax's CUPTI timer calls the compiled program with one.
    return [((v, c),) for v, c in zip(values, cotangents, strict=True)]

  first = call_args(args_list)
  compiled = jax.jit(lambda a: f(*a)).lower(*first[0]).compile()
  args, kwargs = args_list[0]
  job = _Job(label, case, mode, impl_name, compiled, call_args, case.cost(args, kwargs), {})
  job.info["peak_memory_bytes"] = benchmarking._peak_memory_bytes(compiled)
  return job


def _record(job: _Job) -> dict:
  """The record of a measurement's rounds: all samples pooled, the median of round medians."""
  pooled = timing.Timing(
    tuple(t for r in job.timings for t in r.times_s),
    job.timings[0].method,
    job.timings[0].fallback_reason,
  )
  case = job.case
  rec = bench.measurement(
    op=case.op,
    implementation=job.impl_name,
    case=case.feature,
    mode=job.mode,
    shapes=case.shape_dict,
    dtype=case.dtype,
    result=pooled,
    cost=job.cost,
  ).as_dict()
  rounds_ms = [t.median_ms for t in job.timings]
  median = statistics.median(rounds_ms)
  rec["device_time_median_ms"] = median
  rec["device_time_rounds_ms"] = rounds_ms
  for field in ("tflops_per_s", "gb_per_s"):  # Rates at that median.
    if rec.get(field):
      rec[field] *= pooled.median_ms / median
  rec["shape_key"] = shape_key(case.shape_dict)
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
  spread: float | None  # The relative noise of one run's median (see `noise`).
  limit: float | None  # The slowdown allowed: max(threshold, k x spread).
  runs: int


def _rel_spread(values: Sequence[float]) -> float:
  """The MAD-based relative spread of `values` (a standard deviation for normal noise)."""
  mid = statistics.median(values)
  return MAD_TO_SIGMA * statistics.median(abs(v - mid) for v in values) / mid if mid > 0 else 0.0


def noise(record: dict, meds: Sequence[float]) -> float:
  """The relative noise of a run's median: the largest of the baseline runs' spread, the
  standard error of the record's median from its rounds, and the timer's floor."""
  rounds = record.get("device_time_rounds_ms") or ()
  own = 0.0
  if len(rounds) >= MIN_RUNS:  # The median's standard error: 1.2533 sigma / sqrt(n).
    own = 1.2533 * _rel_spread(rounds) / len(rounds) ** 0.5
  floor = NOISE_FLOOR.get(record.get("device_time_method"), 0.0)
  return max(_rel_spread(meds), own, floor)


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
  spread = noise(record, meds)
  limit = max(threshold, k * spread)
  slower = record["device_time_median_ms"] > base * (1.0 + limit)
  ratios = _anchor_ratios(record)
  past_ratios = [
    statistics.median(rs)
    for h in past
    if h.get("anchor") == record.get("anchor") and (rs := _anchor_ratios(h))
  ]
  if slower and ratios and len(past_ratios) >= min_runs:
    # The op slowed against its anchor, timed in the same rounds: the host's drift, which
    # moves both, is not a regression of the op.
    ratio = {"device_time_median_ms": statistics.median(ratios), "device_time_rounds_ms": ratios}
    ratio_limit = max(threshold, k * noise(dict(record, **ratio), past_ratios))
    slower = ratio["device_time_median_ms"] > statistics.median(past_ratios) * (1 + ratio_limit)
  rounds = record.get("device_time_rounds_ms")
  if slower and rounds and len(rounds) >= MIN_RUNS:
    # The slowdown holds across the rounds: three in four are past the threshold.
    slower = _quantile(rounds, 0.25) > base * (1.0 + threshold)
  elif slower and record.get("device_time_min_ms") is not None:
    # Records without rounds: the fastest sample is slower than the baseline runs' fastest
    # by the threshold too (a slow stretch of a loaded host inflates a median only).
    past_fastest = [h["device_time_min_ms"] for h in past if h.get("device_time_min_ms")]
    if past_fastest:
      slower = record["device_time_min_ms"] > statistics.median(past_fastest) * (1.0 + threshold)
  return Verdict(slower, base, spread, limit, len(meds))


def _anchor_ratios(record: dict) -> list[float]:
  """Per round, the record's time over its anchor's (none without an anchor)."""
  ours, theirs = record.get("device_time_rounds_ms"), record.get("anchor_rounds_ms")
  if not ours or not theirs or len(ours) != len(theirs):
    return []
  return [o / a for o, a in zip(ours, theirs, strict=True) if a > 0]


def _quantile(values: Sequence[float], q: float) -> float:
  """The `q` quantile of `values` (linear interpolation)."""
  return float(np.quantile(np.asarray(values, dtype=np.float64), q))


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

  A record is SLOWER by the rule of the module docstring (`verdict`: its
  median past max(`threshold`, `k` x `noise`) of the median of the last
  `window` earlier runs, three in four of its rounds past the threshold too,
  and its ratio to its anchor past the baseline's ratio likewise;
  "no baseline yet" with fewer than 3); DRIFT when its error against the reference is past tolerance (the
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
    f"max({100 * threshold:g}%, {NOISE_K:g} x noise) = limit, noise the largest of the "
    f"baseline runs' spread, the rounds' standard error and the timer's floor, and three "
    f"rounds in four past the threshold; drift in tolerance bounds; "
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
  parser.add_argument("--iterations", type=int, default=ROUND_ITERATIONS)
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
