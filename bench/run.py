"""The timed benchmark runner: our implementations against their anchors, in one process.

For each benchmark case of a hardware family (the op database's `bench` calls,
read through `bench.cases`) and each mode (forward, or a training step:
forward and VJP), it times every implementation of the op that runs here and
`implementation=None` (contender "None": the pick, forward and gradient) and
the anchors in the same process: the library's cuDNN implementation for
attention, `jax.lax` for ragged_dot (the op database's anchors) and XLA for
every op. Time is `tokamax_harness.timing.device_time` (CUPTI kernel time on NVIDIA
GPUs, wallclock elsewhere), the median over rotated inputs.

  python -m bench.run [--family h100] [--ops OPS] [--impls IMPLS] [--only SUBSTRINGS]
                      [--modes fwd,fwd_bwd] [--rounds N] [--sweep]
                      [--vary FIELD=V1,V2] [--out FILE]

`--rounds N` times all contenders of a case in turn N times (interleaved, for
noisy pairs; odd rounds in reverse order); a record's time is the median of its round medians, and
`extra.ratio_median_of_rounds` the median of the per-round ratios to the
anchor. `--sweep` also times each implementation's autotuning candidates
(`_get_autotuning_configs` on the bound arguments, through `with_config`);
`--vary FIELD=V1,V2` (repeatable) times the heuristics' config with that one field
set to each value (JSON values), for an A/B of a kernel option; `--vary F1+F2=A1+A2,B1+B2`
sets two fields together.
`--kernels` adds each contender's per-kernel CUPTI times (`extra.kernels_ms`; GPU
only) and `--hlo DIR` saves each compiled program's optimised HLO.
`--out` writes the records in the schema of `bench.records`.
"""

import argparse
import dataclasses
import enum
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax

from bench import cases as cases_lib
from bench import history, records
from tokamax_harness import bench as bench_lib
from tokamax_harness import hardware, timing

# The anchor a record is compared with, per op: the first of these timed in the run.
ANCHORS = {
  "dot_product_attention": ("cudnn", "xla"),
  "ragged_dot": ("jax.lax", "xla"),
}
DEFAULT_ANCHORS = ("xla",)
# The contender that calls the public op with `implementation=None` (what it picks here).
AUTO = "None"


@dataclasses.dataclass
class Contender:
  """One timed function of a case: an implementation, a config of one, or an anchor."""

  name: str
  fn: Callable
  config: dict | None = None
  rounds_ms: list[float] = dataclasses.field(default_factory=list)
  method: str | None = None
  compiled: Any = None
  error: str | None = None
  kernels_ms: list | None = None
  temp_bytes: int | None = None  # The compiled program's temporaries (XLA memory analysis).

  @property
  def key(self) -> str:
    return self.name if self.config is None else f"{self.name} {self.config}"


def _jsonable(x: Any) -> Any:
  if isinstance(x, enum.Enum):
    return x.name
  if isinstance(x, bool | int | float | str) or x is None:
    return x
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, list | tuple):
    return [_jsonable(v) for v in x]
  return repr(x)


def config_dict(config: Any) -> dict:
  """A kernel config as a JSON object."""
  if dataclasses.is_dataclass(config):
    return _jsonable({f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
  return {"value": _jsonable(config)}


def sweep_configs(impl: cases_lib.Implementation, args: tuple, kwargs: dict) -> list[Any]:
  """The implementation's autotuning candidates for this call (none if it has no configs)."""
  instance = impl.instance
  if instance is None:
    return []
  bound = instance.bind(*args, **kwargs)
  configs = list(instance._get_autotuning_configs(bound.args))
  return sorted(configs, key=repr)


def varied_configs(
  impl: cases_lib.Implementation, args: tuple, kwargs: dict, vary: Mapping[str, Sequence[Any]]
) -> list[Any]:
  """The heuristics' config for this call with each field of `vary` set to each of its values
  (one field at a time, or the fields of a `F1+F2` key together; values equal to the
  heuristics' own, values its config class rejects and unknown fields are left out)."""
  instance = impl.instance
  if instance is None or not vary:
    return []
  base = instance._get_heuristics_config(instance.bind(*args, **kwargs).args)
  if not dataclasses.is_dataclass(base):
    return []
  names = {f.name for f in dataclasses.fields(base)}
  out = []
  for name, values in vary.items():
    fields = name.split("+")
    if not set(fields) <= names:
      continue
    for value in values:
      change = dict(zip(fields, value if len(fields) > 1 else (value,), strict=True))
      if any(getattr(base, f) != v for f, v in change.items()):
        try:
          out.append(dataclasses.replace(base, **change))
        except ValueError as e:
          print(f"--vary {change} left out: {e}", file=sys.stderr)
  return out


def _with_config(impl: cases_lib.Implementation, config: Any) -> Callable:
  instance = impl.instance.with_config(config)
  return lambda *a, **k: instance(*a, **k)


def _auto_fn(spec: Any) -> Callable:
  return lambda *a, **k: spec(*a, implementation=None, **k)


def _anchor_fn(anchor: cases_lib.Anchor) -> Callable:
  return lambda *a, **k: anchor(a, k)


def contenders(
  bcase: cases_lib.BenchCase,
  impls: Sequence[cases_lib.Implementation],
  args: tuple,
  kwargs: dict,
  *,
  implementations: Iterable[str] | None,
  sweep: bool,
  log: Callable[[str], None],
  vary: Mapping[str, Sequence[Any]] | None = None,
) -> list[Contender]:
  """What to time for one case: implementations (and their configs), then the anchors."""
  op = bcase.op
  anchor_names = ANCHORS.get(op, DEFAULT_ANCHORS)
  wanted = set(implementations) if implementations else None
  out = []
  for impl in impls:
    keep = wanted is None or impl.name in wanted or impl.name in anchor_names
    if not keep:
      continue
    if impl.reason is not None:
      log(f"SKIP {op}[{impl.name}] {bcase.id}: {impl.reason}")
      continue
    try:
      reason = impl.unsupported_reason(args, kwargs)
    except Exception as e:
      reason = f"unsupported_reason raised {type(e).__name__}: {e}"
    if reason is not None:
      log(f"SKIP {op}[{impl.name}] {bcase.id}: {reason}")
      continue
    out.append(Contender(impl.name, impl))
    if sweep and impl.name not in anchor_names:
      try:
        configs = sweep_configs(impl, args, kwargs)
      except Exception as e:
        log(f"SKIP sweep of {op}[{impl.name}] {bcase.id}: {type(e).__name__}: {str(e)[:200]}")
        configs = []
      out += [Contender(impl.name, _with_config(impl, c), config_dict(c)) for c in configs]
    if vary and impl.name not in anchor_names:
      try:
        varied = varied_configs(impl, args, kwargs, vary)
      except Exception as e:
        log(f"SKIP --vary of {op}[{impl.name}] {bcase.id}: {type(e).__name__}: {str(e)[:200]}")
        varied = []
      out += [Contender(impl.name, _with_config(impl, c), config_dict(c)) for c in varied]
  if out and (wanted is None or AUTO in wanted):
    out.append(Contender(AUTO, _auto_fn(cases_lib.spec(op))))
  for name, anchor in cases_lib.anchors(op).items():
    if wanted is None or name in wanted or name in anchor_names:
      out.append(Contender(name, _anchor_fn(anchor)))
  return out


def _compile(bcase: cases_lib.BenchCase, c: Contender, args_list: Sequence[tuple]):
  """The compiled timed program of a contender and its call arguments."""
  case, mode = bcase.case, bcase.mode
  splits = [history._split(case, a, k) for a, k in args_list]
  f = history.benchmark_fn(case, c.fn, splits[0], mode)
  values = [s.values() for s in splits]
  if mode == "fwd_bwd":
    fwd = history.benchmark_fn(case, c.fn, splits[0], "fwd")
    out = jax.eval_shape(lambda v: fwd(v), values[0])
    keys = jax.random.split(cases_lib.case_key(case), len(values))
    cotangents = [jax.random.normal(k, out.shape, out.dtype) for k in keys]
  else:
    cotangents = [None] * len(values)
  # One argument (a tuple): tokamax's CUPTI timer calls the compiled program with one.
  call_args = [((v, ct),) for v, ct in zip(values, cotangents, strict=True)]
  compiled = jax.jit(lambda a: f(*a)).lower(*call_args[0]).compile()
  return compiled, call_args


def per_kernel_ms(compiled: Callable, args: tuple, iterations: int = 5) -> list[list]:
  """[kernel name, median ms over iterations] for each kernel one call runs (CUPTI, GPU only)."""
  from jax.experimental.mosaic.gpu import profiler

  measure = profiler.Cupti(finalize=False).measure(compiled, aggregate=False, iterations=iterations)
  _, timings = measure(*args)
  if timings is None:
    return []
  names = [name for name, _ in timings[0]]
  return [
    [name, float(statistics.median(run[i][1] for run in timings))] for i, name in enumerate(names)
  ]


def _file_name(*parts: str) -> str:
  return re.sub(r"[^A-Za-z0-9_.=-]+", "_", "-".join(parts))[:200]


def round_order(contenders_: Sequence[Any], r: int) -> list[Any]:
  """The order of round r: reversed on odd rounds, so that over two rounds no contender always
  runs after another (a GEMM-bound call slows whatever follows it as the clock drops: the same
  loss program timed right after itself measured 1.05x, h200/bench_run_7c77bdc.json)."""
  return list(contenders_[::-1] if r % 2 else contenders_)


def time_case(
  bcase: cases_lib.BenchCase,
  contenders_: list[Contender],
  args_list: Sequence[tuple],
  *,
  rounds: int,
  iterations: int,
  warmup: int,
  log: Callable[[str], None],
  kernels: bool = False,
  hlo_dir: str | None = None,
) -> list[Contender]:
  """Times the contenders in `rounds` interleaved rounds; returns those that ran."""
  calls = {}
  for c in contenders_:
    try:
      c.compiled, calls[c.key] = _compile(bcase, c, args_list)
    except Exception as e:
      c.error = f"{type(e).__name__}: {str(e)[:300]}"
      log(f"ERROR {bcase.op}[{c.key}] {bcase.id}: {c.error}")
      continue
    analysis = c.compiled.memory_analysis()
    c.temp_bytes = getattr(analysis, "temp_size_in_bytes", None) if analysis else None
    if hlo_dir:
      os.makedirs(hlo_dir, exist_ok=True)
      name = _file_name(bcase.op, c.key, bcase.id) + ".hlo.txt"
      with open(os.path.join(hlo_dir, name), "w") as f:
        f.write(c.compiled.as_text())
  live = [c for c in contenders_ if c.error is None]
  for r in range(rounds):
    for c in round_order(live, r):
      if c.error is not None:
        continue
      try:
        t = timing.device_time(
          c.compiled, calls[c.key], warmup=warmup if r == 0 else 1, iterations=iterations
        )
      except Exception as e:
        c.error = f"{type(e).__name__}: {str(e)[:300]}"
        log(f"ERROR {bcase.op}[{c.key}] {bcase.id}: {c.error}")
        continue
      c.rounds_ms.append(t.median_ms)
      c.method = t.method
  if kernels and jax.default_backend() == "gpu":
    for c in live:
      if c.error is None:
        try:
          c.kernels_ms = per_kernel_ms(c.compiled, calls[c.key][0])
        except Exception as e:  # The timing stands without the breakdown.
          log(f"no kernel breakdown of {bcase.op}[{c.key}]: {type(e).__name__}: {str(e)[:200]}")
  return [c for c in live if c.error is None and c.rounds_ms]


def case_records(
  bcase: cases_lib.BenchCase, timed: list[Contender], env: dict, device: str, cost: Any
) -> list[records.Record]:
  """One record per timed contender but the anchor, each against the anchor of the run."""
  anchor_names = ANCHORS.get(bcase.op, DEFAULT_ANCHORS)
  plain = {c.name: c for c in timed if c.config is None}
  anchor = next((plain[n] for n in anchor_names if n in plain), None)
  others = [c for c in timed if c is not anchor] or ([anchor] if anchor else [])
  anchors_ms = {n: statistics.median(plain[n].rounds_ms) for n in anchor_names if n in plain}
  for name in cases_lib.anchors(bcase.op):
    if name in plain:
      anchors_ms[name] = statistics.median(plain[name].rounds_ms)
  case = bcase.case
  out = []
  for c in others:
    median = statistics.median(c.rounds_ms)
    extra: dict[str, Any] = {
      "rounds_ms": c.rounds_ms,
      "anchors_ms": anchors_ms,
      "feature": case.feature,
    }
    if c.name == AUTO:
      extra.update(_against_fastest(bcase.op, bcase.mode, plain, median))
    against = anchor if anchor is not None and c is not anchor else None
    if c.kernels_ms is not None:
      extra["kernels_ms"] = c.kernels_ms
    if c.temp_bytes is not None:
      extra["temp_bytes"] = c.temp_bytes
      if against is not None and against.temp_bytes:
        extra["anchor_temp_bytes"] = against.temp_bytes
    if against is not None:
      extra["anchor_rounds_ms"] = against.rounds_ms
      if against.kernels_ms is not None:
        extra["anchor_kernels_ms"] = against.kernels_ms
      extra["ratio_median_of_rounds"] = statistics.median(
        ours / theirs for ours, theirs in zip(c.rounds_ms, against.rounds_ms, strict=True)
      )
    if cost is not None and getattr(cost, "flops", None):
      flops = cost.flops * (3.5 if bcase.mode == "fwd_bwd" else 1.0)
      extra["tflops_per_s"] = flops / (median * 1e-3) / 1e12
    out.append(
      records.Record(
        device=device,
        commit=env["commit"],
        date=env["date"],
        op=bcase.op,
        implementation=c.name,
        case=case.id,
        shape=flat_shape(case.shape_dict),
        dtype=case.dtype,
        mode=bcase.mode,
        median_ms=median,
        anchor=against.name if against else None,
        anchor_ms=statistics.median(against.rounds_ms) if against else None,
        method=c.method,
        config=c.config,
        extra=extra,
      )
    )
  return out


def _against_fastest(
  op: str, mode: str, plain: dict[str, Contender], auto_ms: float
) -> dict[str, Any]:
  """`implementation=None` against the fastest named implementation timed in the same run.

  In a training step the rivals are the implementations with deterministic gradients, the
  ones `None` may pick there; a faster nondeterministic one is named beside them.
  """
  spec = cases_lib.spec(op)
  named = {n: statistics.median(c.rounds_ms) for n, c in plain.items() if n in spec.implementations}
  nondeterministic = {
    n
    for n in named
    if mode == "fwd_bwd" and spec.implementation_class(n).nondeterministic_gradients
  }
  rivals = {n: ms for n, ms in named.items() if n not in nondeterministic}
  if not rivals:
    return {}
  fastest = min(rivals, key=rivals.get)
  out = {
    "fastest": fastest,
    "fastest_ms": rivals[fastest],
    "ratio_to_fastest": auto_ms / rivals[fastest],
  }
  if nondeterministic:
    quickest = min(nondeterministic, key=named.get)
    if named[quickest] < rivals[fastest]:
      out["fastest_nondeterministic"] = quickest
      out["ratio_to_fastest_nondeterministic"] = auto_ms / named[quickest]
  return out


def flat_shape(shape: dict) -> dict[str, int]:
  """A case's dimensions as names to integers (a tuple `rows=(4, 8)` becomes rows0, rows1)."""
  out = {}
  for k, v in shape.items():
    if isinstance(v, tuple | list):
      out.update({f"{k}{i}": int(x) for i, x in enumerate(v)})
    else:
      out[k] = int(v)
  return out


def _matches(only: Sequence[str] | None, *labels: str) -> bool:
  return not only or any(s in label for s in only for label in labels)


def run(
  family: str | None = None,
  *,
  ops: Iterable[str] | None = None,
  implementations: Iterable[str] | None = None,
  only: Sequence[str] | None = None,
  modes: Iterable[str] | None = None,
  rounds: int = 1,
  sweep: bool = False,
  vary: Mapping[str, Sequence[Any]] | None = None,
  iterations: int = 30,
  warmup: int = 3,
  rotations: int = 2,
  budget_s: float | None = None,
  kernels: bool = False,
  hlo_dir: str | None = None,
  log: Callable[[str], None] = print,
  sink: Callable[[list[records.Record]], None] | None = None,
) -> list[records.Record]:
  """Times the family's benchmark cases; returns the records (see `bench.records`).

  Args:
    family: The hardware family whose cases to run (default: the hardware's).
    ops, implementations, modes: Restrict to these (anchors are always timed).
    only: Substrings; a case runs if one is in its op, its id or its id with the mode.
    rounds: Interleaved rounds of every contender of a case.
    sweep: Also time each implementation's autotuning candidates.
    vary: Field name -> values: also time the heuristics' config with each.
    iterations, warmup: Of `tokamax_harness.timing.device_time`.
    rotations: Distinct input sets, used in turn.
    budget_s: Starts no new case after this many seconds.
    kernels: Also record per-kernel CUPTI times (GPU only).
    hlo_dir: Where to save each compiled program's optimised HLO, if anywhere.
    log: Where progress and skips go.
    sink: Called with all records so far after each case (a run cut short keeps them).

  Returns:
    The records.
  """
  profile = hardware.detect()
  family = family or profile.family
  env = bench_lib.environment()
  device = jax.devices()[0].device_kind
  ops = set(ops) if ops else None
  modes = set(modes) if modes else None
  impls_of: dict[str, list] = {}
  start = time.monotonic()
  out: list[records.Record] = []
  inputs: dict = {}
  for bcase in cases_lib.bench_cases(family):
    case = bcase.case
    if (ops and bcase.op not in ops) or (modes and bcase.mode not in modes):
      continue
    if not _matches(only, bcase.op, case.id, bcase.id):
      continue
    if budget_s is not None and time.monotonic() - start > budget_s:
      log(f"SKIP {bcase.op} {bcase.id}: past the {budget_s:g} s budget")
      continue
    if bcase.op not in impls_of:
      impls_of[bcase.op] = cases_lib.implementations(bcase.op, profile)
    if case.id not in inputs:
      inputs.clear()  # Large inputs: keep one case's at a time.
      key = cases_lib.case_key(case)
      inputs[case.id] = [case.make_args(jax.random.fold_in(key, i)) for i in range(rotations)]
    args_list = inputs[case.id]
    args, kwargs = args_list[0]
    todo = contenders(
      bcase,
      impls_of[bcase.op],
      args,
      kwargs,
      implementations=implementations,
      sweep=sweep,
      log=log,
      vary=vary,
    )
    timed = time_case(
      bcase,
      todo,
      args_list,
      rounds=rounds,
      iterations=iterations,
      warmup=warmup,
      log=log,
      kernels=kernels,
      hlo_dir=hlo_dir,
    )
    try:
      cost = case.cost(args, kwargs)
    except Exception:
      cost = None
    recs = case_records(bcase, timed, env, device, cost)
    for r in recs:
      ratio = f", {r.ratio:.3f}x {r.anchor}" if r.ratio is not None else ""
      cfg = f" {r.config}" if r.config else ""
      log(f"{r.op}[{r.implementation}]{cfg} {r.case} {r.mode}: {r.median_ms:.4g} ms{ratio}")
    out += recs
    if sink is not None and recs:
      sink(out)
  return out


def _csv(s: str | None) -> list[str] | None:
  return [x for x in s.split(",") if x] if s else None


def parse_vary(items: Sequence[str] | None) -> dict[str, list[Any]]:
  """`FIELD=V1,V2` strings -> {field: [values]}, the values parsed as JSON (bare words as strings).

  `F1+F2=A1+A2,B1+B2` varies two fields together: {"F1+F2": [(A1, A2), (B1, B2)]}.
  """
  out: dict[str, list[Any]] = {}
  for item in items or ():
    name, sep, values = item.partition("=")
    fields = name.split("+")
    if not sep or not all(fields) or not values:
      raise ValueError(f"--vary expects FIELD=V1[,V2...] or F1+F2=A1+A2[,...], got {item!r}")
    for value in values.split(","):
      parts = value.split("+") if len(fields) > 1 else [value]
      if len(parts) != len(fields):
        raise ValueError(f"--vary {name}: {value!r} needs one value per field, joined by '+'")
      parsed = tuple(_json_or_word(v) for v in parts)
      out.setdefault(name, []).append(parsed if len(fields) > 1 else parsed[0])
  return out


def _json_or_word(text: str) -> Any:
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    return text


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
  parser.add_argument("--family", default=None, help="hardware family (default: this one's)")
  parser.add_argument("--ops", default=None, help="comma-separated op names")
  parser.add_argument("--impls", default=None, help="comma-separated implementation names")
  parser.add_argument("--only", default=None, help="comma-separated substrings of case ids")
  parser.add_argument("--modes", default=None, help="comma-separated: fwd,fwd_bwd")
  parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds per case")
  parser.add_argument("--sweep", action="store_true", help="also time autotuning candidates")
  parser.add_argument(
    "--vary",
    action="append",
    metavar="FIELD=V1,V2",
    help="time the heuristics' config with FIELD=V (F1+F2=A1+A2: two fields together)",
  )
  parser.add_argument("--iterations", type=int, default=30)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--rotations", type=int, default=2, help="distinct input sets")
  parser.add_argument("--budget-s", type=float, default=None, help="no new case after it")
  parser.add_argument("--kernels", action="store_true", help="per-kernel CUPTI times (GPU)")
  parser.add_argument("--hlo", default=None, metavar="DIR", help="save optimised HLO here")
  parser.add_argument("--out", default=None, help="write the records here (bench.records)")
  parser.add_argument("--note", default=None, help="the record file's note")
  args = parser.parse_args(argv)
  recs = run(
    args.family,
    ops=_csv(args.ops),
    implementations=_csv(args.impls),
    only=_csv(args.only),
    modes=_csv(args.modes),
    rounds=args.rounds,
    sweep=args.sweep,
    vary=parse_vary(args.vary),
    iterations=args.iterations,
    warmup=args.warmup,
    rotations=args.rotations,
    budget_s=args.budget_s,
    kernels=args.kernels,
    hlo_dir=args.hlo,
    sink=(lambda rs: records.write(args.out, rs, note=args.note)) if args.out else None,
  )
  if args.out and recs:
    print(f"wrote {len(recs)} records to {args.out}")
  if not recs:
    print("no records: nothing ran (see the SKIP and ERROR lines above)")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
