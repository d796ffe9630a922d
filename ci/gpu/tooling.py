"""GPU checks of autotuning, benchmarking and export (issue 7).

Run on an NVIDIA GPU (jax-triton installed for the Triton kernels):
  python3 ci/gpu/tooling.py --out DIR [--dry] [--budget-s 400]

Sections, each recorded in DIR/tooling.json (rewritten after every section, so
a run cut short keeps what finished):
1. timers: `benchmark(..., method="cupti")` (kernel time) against the harness's
   device timer (profiler trace) and a CUDA-event timer (torch or cupy events
   around back-to-back queued calls), on the same compiled kernels; agreement
   within 5% is the check.
2. autotune: `tokamax.autotune` of the jitted gradient of a step with
   attention, layer_norm and ragged_dot (implementation=None, bf16), with a
   5-minute limit; then the step's time untuned (heuristics, no default cache)
   and tuned (inside the result), both by CUPTI; tuned must be no slower
   (2% noise allowance). The result goes to DIR/step_autotuning.json.
3. export: for every Mosaic and Triton implementation that imports here, the
   forward (and gradient) exported with DISABLE_JAX_EXPORT_CHECKS, serialized,
   deserialized and called: bitwise equal to the jitted function, and the
   kernel custom call present.
4. default cache: with the time left, the benchmark shapes of each op (forward
   and forward+backward) are tuned and merged with the step's result into
   DIR/<device kind>.json, the file to ship as src/tokamax/data/<device kind>.json.

--dry runs the plumbing on a CPU with small shapes (wallclock timers).
"""

import argparse
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import tokamax
from tokamax._src import benchmarking, export
from tokamax._src.autotuning import cache
from tokamax._src.ops.attention import spec as attention_spec
from tokamax._src.ops.gated_linear_unit import spec as glu_spec
from tokamax._src.ops.normalization import spec as norm_spec
from tokamax._src.ops.ragged_dot import spec as ragged_dot_spec
from tokamax_harness import bench

START = time.monotonic()
RESULTS: dict = {"sections": {}, "errors": []}


def elapsed() -> float:
  return time.monotonic() - START


def log(*parts) -> None:
  print(f"[tooling {elapsed():6.1f}s]", *parts, flush=True)


def save(out_dir: str) -> None:
  with open(os.path.join(out_dir, "tooling.json"), "w") as f:
    json.dump(RESULTS, f, indent=1, default=str)


def section(name: str, out_dir: str):
  """Decorator: runs a section, records its result or its error, saves."""

  def wrap(fn):
    def run(*args, **kwargs):
      log(f"== {name}")
      t = time.monotonic()
      try:
        RESULTS["sections"][name] = fn(*args, **kwargs)
      except Exception as e:
        RESULTS["errors"].append({"section": name, "error": f"{type(e).__name__}: {e}"[:2000]})
        traceback.print_exc()
      RESULTS.setdefault("section_seconds", {})[name] = round(time.monotonic() - t, 2)
      save(out_dir)

    return run

  return wrap


def environment() -> dict:
  dev = jax.devices()[0]
  commit = bench.current_commit()
  return {
    "device_kind": dev.device_kind,
    "platform": dev.platform,
    "jax": jax.__version__,
    "tokamax": tokamax.__version__,
    "commit": commit,
    "cupti_unavailable_reason": benchmarking.cupti_unavailable_reason(),
  }


# -- Timers -------------------------------------------------------------------------


def _event_api():
  """(name, make_event, elapsed_ms(start, end), synchronize) of a CUDA-event API, or None."""
  try:
    import torch

    if torch.cuda.is_available():
      return (
        "torch.cuda.Event",
        lambda: torch.cuda.Event(enable_timing=True),
        lambda start, end: start.elapsed_time(end),
        torch.cuda.synchronize,
      )
  except Exception:
    pass
  try:
    import cupy

    return (
      "cupy.cuda.Event",
      cupy.cuda.Event,
      cupy.cuda.get_elapsed_time,
      cupy.cuda.Device().synchronize,
    )
  except Exception:
    return None


def cuda_event_ms(fn, args, *, calls: int = 20, repeats: int = 5) -> tuple[float, str]:
  """Median over repeats of (end - start event) / calls for `calls` queued calls.

  JAX runs on its own stream, so the events time the interval between the host
  queueing the first call and the last call finishing; with the GPU kept busy by
  queued calls that is the device time per call.
  """
  api = _event_api()
  if api is None:
    raise RuntimeError("neither torch nor cupy CUDA events are available")
  name, event, elapsed_ms, synchronize = api
  jax.block_until_ready(fn(args))
  times = []
  for _ in range(repeats):
    synchronize()
    start, end = event(), event()
    start.record()
    outs = [fn(args) for _ in range(calls)]
    jax.block_until_ready(outs)
    end.record()
    end.synchronize()
    times.append(elapsed_ms(start, end) / calls)
    del outs
  return float(np.median(times)), name


def harness_ms(fn, args) -> tuple[float, str] | None:
  try:
    from tokamax_harness import timing
  except Exception:
    return None
  t = timing.device_time(fn, [(args,)], warmup=2, iterations=20, method="auto")
  return t.median_ms, t.method


def _ratios(row: dict) -> dict:
  for ref in ("harness_ms", "events_ms"):
    if ref in row:
      ratio = row["benchmark_ms"] / row[ref]
      row[f"ratio_to_{ref[:-3]}"] = ratio
      row[f"within_5pct_of_{ref[:-3]}"] = abs(ratio - 1) <= 0.05
  return row


def timers(dry: bool) -> dict:
  """The same compiled kernels timed three ways, in the same conditions.

  Each kernel first runs long enough to reach its steady clocks (an H200 at full
  tensor-core load settles below its idle boost clock); then `benchmark`'s CUPTI
  timer and the harness's timer alternate for a few rounds, so that both see the
  same clocks; CUDA events (queued calls, launch gaps included) come last.
  """
  s = 16 if dry else 1
  bf16 = jnp.bfloat16
  q = jax.ShapeDtypeStruct((4, 4096 // s, 32 // min(s, 8), 128), bf16)
  lhs = jax.ShapeDtypeStruct((16384 // s, 4096 // s), bf16)
  rhs = jax.ShapeDtypeStruct((8, 4096 // s, 2048 // s), bf16)
  sizes = jnp.asarray(ragged_dot_spec.generate_ragged_dot_group_sizes(16384 // s, 8, seed=0))
  kernels = {
    "attention_fwd_B4_T4096_N32_H128": (lambda q: tokamax.dot_product_attention(q, q, q), (q,)),
    "ragged_dot_M16384_K4096_N2048_G8": (lambda a, b: tokamax.ragged_dot(a, b, sizes), (lhs, rhs)),
  }
  method = "wallclock" if dry else "cupti"
  rows = []
  for name, (f, args) in kernels.items():
    fn, arrays = tokamax.standardize_function(f, *args)
    run = benchmarking.compile_benchmark(fn, arrays)
    compiled = jax.jit(fn).lower(arrays).compile()
    row = {"kernel": name, "dtype": "bfloat16", "benchmark_method": method, "rounds": []}
    steady_until = time.monotonic() + (0.1 if dry else 2.0)
    while time.monotonic() < steady_until:
      jax.block_until_ready([compiled(arrays) for _ in range(10)])
    for _ in range(3):
      b = run(arrays, iterations=20, method=method).median_evaluation_time_ms
      h = harness_ms(compiled, arrays)
      row["rounds"].append({"benchmark_ms": b, "harness_ms": h[0] if h else None})
      if h:
        row["harness_method"] = h[1]
    row["benchmark_ms"] = float(np.median([r["benchmark_ms"] for r in row["rounds"]]))
    if h:
      row["harness_ms"] = float(np.median([r["harness_ms"] for r in row["rounds"]]))
    if not dry:
      row["events_ms"], row["events_api"] = cuda_event_ms(compiled, arrays)
    rows.append(_ratios(row))
    log(name, row)
  ok = all(r.get("within_5pct_of_harness", False) for r in rows)
  return {"rows": rows, "cupti_within_5pct_of_harness": ok}


# -- Autotuning the step --------------------------------------------------------------


def step_shapes(dry: bool) -> dict:
  if dry:
    return {"b": 1, "t": 256, "n": 2, "h": 32, "g": 4, "n_out": 64}
  return {"b": 2, "t": 2048, "n": 16, "h": 128, "g": 8, "n_out": 1024}


def make_step(shapes: dict, dry: bool):
  b, t, n, h, g, n_out = (shapes[k] for k in ("b", "t", "n", "h", "g", "n_out"))
  sizes = jnp.asarray(ragged_dot_spec.generate_ragged_dot_group_sizes(b * t, g, seed=1))

  def loss(q, k, v, scale, rhs):
    # --dry: the chunked XLA attention, so that there is something to tune on a CPU.
    implementation = "xla_chunked" if dry else None
    o = tokamax.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    y = tokamax.layer_norm(o.reshape(b * t, n * h), scale, None)
    z = tokamax.ragged_dot(y, rhs, sizes)
    return jnp.mean(jnp.square(z.astype(jnp.float32)))

  bf16 = jnp.bfloat16
  args = (
    jax.ShapeDtypeStruct((b, t, n, h), bf16),
    jax.ShapeDtypeStruct((b, t, n, h), bf16),
    jax.ShapeDtypeStruct((b, t, n, h), bf16),
    jax.ShapeDtypeStruct((n * h,), bf16),
    jax.ShapeDtypeStruct((g, n * h, n_out), bf16),
  )
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))), args


def autotune_step(out_dir: str, dry: bool, budget_s: float) -> dict:
  shapes = step_shapes(dry)
  step, sds = make_step(shapes, dry)
  _, arrays = tokamax.standardize_function(lambda *a: a, *sds)
  found = [
    (b.op.spec.name, b.op.name, mode) for b, mode in tokamax.autotuning.find_ops(step, *arrays)
  ]
  log("ops found:", found)
  t = time.monotonic()
  with tokamax.config.override(use_default_cache=False):  # Tune, never read the shipped file.
    result = tokamax.autotune(step, *arrays, timeout_s=90, time_budget_s=budget_s, iterations=5)
  tune_s = time.monotonic() - t
  result.dump(os.path.join(out_dir, "step_autotuning.json"))
  fn, fn_args = tokamax.standardize_function(step, *arrays, seed=None)
  method = "wallclock" if dry else "cupti"
  with tokamax.config.override(use_default_cache=False):
    untuned = tokamax.benchmark(fn, fn_args, iterations=20, method=method)
    with result:
      tuned = tokamax.benchmark(fn, fn_args, iterations=20, method=method)
  summary = {
    "shapes": shapes,
    "dtype": "bfloat16",
    "ops_found": found,
    "autotune_seconds": tune_s,
    "under_5_minutes": tune_s < 300,
    "entries": [
      {
        "op": d.op,
        "implementation": d.implementation,
        "mode": d.mode,
        "config": d.config,
        "candidates": len(d.timings_ms) + len(d.errors),
        "failed": len(d.errors),
        "best_ms": d.timings_ms[0][1] if d.timings_ms else None,
        "worst_ms": d.timings_ms[-1][1] if d.timings_ms else None,
        "first_error": d.errors[0][1] if d.errors else None,
      }
      for d in result.data
    ],
    "untuned_step_ms": untuned.median_evaluation_time_ms,
    "tuned_step_ms": tuned.median_evaluation_time_ms,
    "timer": method,
  }
  summary["tuned_over_untuned"] = summary["tuned_step_ms"] / summary["untuned_step_ms"]
  summary["tuned_no_slower"] = summary["tuned_over_untuned"] <= 1.02
  log({k: v for k, v in summary.items() if k != "entries"})
  for e in summary["entries"]:
    log(" ", e)
  return summary


# -- Export -------------------------------------------------------------------------


def export_kernels(dry: bool) -> dict:
  sys.path.insert(0, os.getcwd())
  from suites.tooling.test_export import _kernel_example  # One source of the examples.

  rows = []
  for spec in (attention_spec.SPEC, norm_spec.SPEC, glu_spec.SPEC, ragged_dot_spec.SPEC):
    for name in spec.implementation_names:
      # --dry exercises the plumbing with the XLA chunked attention instead.
      if not (name.startswith(("mosaic", "triton")) or (dry and name == "xla_chunked")):
        continue
      row = {"op": spec.name, "implementation": name}
      rows.append(row)
      try:
        cls = spec.implementation_class_or_reason(name)
        if isinstance(cls, str):
          row["skipped"] = cls
          continue
        op = spec.get(name)
        sds, kwargs = _kernel_example(spec.name)
        record = jax.eval_shape(lambda *a: spec.canonicalize(*a, **kwargs), *sds)
        reason = op.unsupported_reason(record)
        if reason is not None:
          row["skipped"] = reason
          continue

        def fwd(*arrays, spec=spec, op=op, kwargs=kwargs):
          return _call(spec, op, arrays, kwargs)

        floats = tuple(
          i for i, a in enumerate(sds) if a is not None and jnp.issubdtype(a.dtype, jnp.floating)
        )
        fns = {
          "forward": fwd,
          "gradient": jax.grad(
            lambda *a, fwd=fwd: jnp.sum(jnp.square(fwd(*a).astype(jnp.float32))), argnums=floats
          ),
        }
        _, arrays = tokamax.standardize_function(lambda *a: a, *sds)
        arrays = list(arrays)
        if spec.name == "ragged_dot":
          arrays[2] = jnp.asarray(
            ragged_dot_spec.generate_ragged_dot_group_sizes(
              sds[0].shape[0], sds[2].shape[0], seed=2
            )
          )
        call_args = []
        it = iter(arrays)
        for a in sds:
          call_args.append(None if a is None else next(it))
        for what, f in fns.items():
          try:
            exported = jax.export.export(
              jax.jit(f), disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS
            )(*call_args)
            restored = jax.export.deserialize(exported.serialize())
            got = restored.call(*call_args)
            want = jax.jit(f)(*call_args)
            same = all(
              np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
              for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
            )
            row[what] = {
              "bitwise_equal": bool(same),
              "kernel_custom_calls": sorted(export.kernel_custom_calls(exported)),
              "serialized_bytes": len(exported.serialize()),
            }
          except Exception as e:
            row[what] = {"error": f"{type(e).__name__}: {e}"[:1000]}
      except Exception as e:  # A module that fails to load or trace.
        row["error"] = f"{type(e).__name__}: {e}"[:1000]
      log(row)
  verified = {
    family: any(
      r.get("forward", {}).get("bitwise_equal") and r["forward"].get("kernel_custom_calls")
      for r in rows
      if r["implementation"].startswith(family)
    )
    for family in ("mosaic", "triton")
  }
  return {"rows": rows, "round_trip_verified": verified}


def _call(spec, op, arrays, kwargs):
  record = spec.canonicalize(*arrays, **kwargs)
  return spec.finalize(record, op.apply(record))


# -- Default cache ------------------------------------------------------------------


def benchmark_functions(dry: bool):
  """(name, function, shapes) of the benchmark shapes, forward and forward+backward."""
  s = 16 if dry else 1
  bf16 = jnp.bfloat16
  sds = jax.ShapeDtypeStruct
  q = sds((4, 4096 // s, 32 // min(s, 8), 128), bf16)
  q64 = sds((32 // min(s, 8), 2048 // s, 16 // min(s, 8), 64), bf16)
  x = sds((16384 // s, 4096 // s), bf16)
  d = sds((4096 // s,), bf16)
  wide_x, wide_d = sds((4096 // s, 8192 // s), bf16), sds((8192 // s,), bf16)
  gx, gw = sds((8192 // s, 4096 // s), bf16), sds((4096 // s, 2, 14336 // s), bf16)
  lhs, rhs = sds((16384 // s, 4096 // s), bf16), sds((8, 4096 // s, 2048 // s), bf16)
  sizes = jnp.asarray(ragged_dot_spec.generate_ragged_dot_group_sizes(16384 // s, 8, seed=0))
  # Cheapest to tune first: a run cut short keeps what finished.
  fns = {
    "swiglu": (lambda x, w: tokamax.gated_linear_unit(x, w, activation=jax.nn.swish), (gx, gw)),
    "ragged_dot": (lambda a, b: tokamax.ragged_dot(a, b, sizes), (lhs, rhs)),
    "layer_norm_wide": (lambda x, d: tokamax.layer_norm(x, d, d), (wide_x, wide_d)),
    "rms_norm_wide": (
      lambda x, d: tokamax.layer_norm(x, d, None, subtract_mean=False),
      (wide_x, wide_d),
    ),
    "layer_norm": (lambda x, d: tokamax.layer_norm(x, d, d), (x, d)),
    "attention": (lambda q: tokamax.dot_product_attention(q, q, q), (q,)),
    "attention_causal": (lambda q: tokamax.dot_product_attention(q, q, q, is_causal=True), (q,)),
    "attention_h64": (lambda q: tokamax.dot_product_attention(q, q, q), (q64,)),
  }
  for name, (f, args) in fns.items():
    yield name + "_fwd", f, args
    grad = jax.grad(
      lambda *a, f=f: jnp.sum(f(*a).astype(jnp.float32)), argnums=tuple(range(len(args)))
    )
    yield name + "_fwd_bwd", grad, args


def default_cache(out_dir: str, dry: bool, deadline_s: float, only: set[str] | None = None) -> dict:
  """Tunes the benchmark functions (those named in `only`, if given: a function, or one of
  its modes as "<name>_fwd" / "<name>_fwd_bwd") into the default cache.

  The file is rewritten after every function, so that a run cut short ships what finished.
  """
  step_path = os.path.join(out_dir, "step_autotuning.json")
  merged = tokamax.AutotuningResult.load(step_path) if os.path.exists(step_path) else None
  done = []
  for name, f, args in benchmark_functions(dry):
    base = name.removesuffix("_fwd_bwd").removesuffix("_fwd")
    if only is not None and name not in only and base not in only:  # e.g. "attention_fwd".
      continue
    left = deadline_s - elapsed()
    if left < 30:
      log("default cache: out of time before", name)
      break
    with tokamax.config.override(use_default_cache=False):
      result = tokamax.autotune(f, *args, timeout_s=60, time_budget_s=left - 25, iterations=5)
    merged = result if merged is None else merged.merge(result)
    done.append({"function": name, "entries": len(result)})
    log("default cache:", name, len(result), "entries")
    _dump_cache(out_dir, merged)
  if merged is None:
    return {"done": done}
  return {"done": done, "file": cache.file_name(merged.device_kind), "entries": len(merged)}


def _dump_cache(out_dir: str, merged) -> None:
  # Entries that found no working config are not worth shipping.
  merged = tokamax.AutotuningResult(
    merged.device_kind,
    tuple(d for d in merged.data if d.config is not None),
    merged.library_version,
  )
  merged.dump(os.path.join(out_dir, cache.file_name(merged.device_kind)))


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  parser.add_argument("--dry", action="store_true")
  parser.add_argument("--budget-s", type=float, default=400.0)
  parser.add_argument("--step-budget-s", type=float, default=180.0, help="autotuning the step")
  parser.add_argument("--skip", default="", help="comma-separated sections to skip")
  parser.add_argument(
    "--functions", default="", help="comma-separated default-cache functions (default all)"
  )
  opts = parser.parse_args()
  os.makedirs(opts.out, exist_ok=True)
  skip = set(filter(None, opts.skip.split(",")))
  RESULTS["environment"] = environment()
  RESULTS["dry"] = opts.dry
  log(RESULTS["environment"])
  save(opts.out)
  if "timers" not in skip:
    section("timers", opts.out)(timers)(opts.dry)
  if "autotune" not in skip:
    section("autotune", opts.out)(autotune_step)(opts.out, opts.dry, opts.step_budget_s)
  if "export" not in skip:
    section("export", opts.out)(export_kernels)(opts.dry)
  if "default_cache" not in skip:
    only = set(filter(None, opts.functions.split(","))) or None
    section("default_cache", opts.out)(default_cache)(opts.out, opts.dry, opts.budget_s, only)
  RESULTS["total_seconds"] = elapsed()
  save(opts.out)
  log("done; errors:", RESULTS["errors"])


if __name__ == "__main__":
  main()
