"""GPU checks and timings of the Triton layer_norm, gated_linear_unit and ragged_dot.

Run on an NVIDIA GPU with jax-triton installed:
  python3 ci/gpu/triton_mm_norm.py --out DIR [--skip-correctness] [--skip-bench]

Correctness: each op through the public API with implementation="triton",
against the XLA implementation on float32-upcast inputs at HIGHEST precision,
outputs and gradients, on random inputs (uneven and empty groups for ragged_dot).
Timings: the done-when shapes of issue 4 in bfloat16, forward and forward+backward
(`run_record.forward_backward`: output and gradients, cotangent in the output's
dtype), with the XLA anchors measured in the same run. Times are the median over
repeats of the mean of back-to-back queued calls (wallclock after warm-up,
rotating input sets), the same method for the kernel and its anchor.
"""

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import tokamax
from ci.gpu import run_record
from harness import bench as bench_lib
from harness import compare
from tokamax._src.ops.gated_linear_unit import triton as glu_triton
from tokamax._src.ops.normalization import triton as norm_triton
from tokamax._src.ops.ragged_dot import spec as rd_spec
from tokamax._src.ops.ragged_dot import triton as rd_triton

HIGHEST = jax.lax.Precision.HIGHEST
# --dry: the whole script's plumbing on a CPU, "triton" replaced by "xla", small shapes.
DRY = "--dry" in sys.argv
OURS = "xla" if DRY else "triton"
SCALE = 64 if DRY else 1
RECORD = run_record.Record("triton_mm_norm.json", checks=[], timings=[])
# Config sweeps where the heuristic misses its target (session 3: RMSNorm 4096x8192
# forward+backward 1.20x XLA against 1.3x), and 16384x4096 to see that it does not regress.
SWEEPS = {("rms_norm", 4096, 8192), ("rms_norm", 16384, 4096)}
RESULTS, save = RECORD.results, RECORD.save
NORM_ROUNDS = 1  # --norm-rounds: interleaved rounds of the layer_norm timings.
NORM_VARIANTS = False  # --norm-variants: RMSNorm configs beside the heuristic's, in the rounds.


def tol(dtype) -> float:
  return {"float32": 2e-3, "bfloat16": 2e-2, "float16": 5e-3}[np.dtype(dtype).name]


def check(name, fn, ref_fn, args, dtype, diff_argnums):
  """Compares outputs and gradients of `fn` and `ref_fn` (f32-upcast inputs)."""
  out = jax.jit(fn)(*args)
  up = [jax.tree.map(lambda a: a.astype(jnp.float32), a) for a in args]
  ref = jax.jit(ref_fn)(*up)
  errs = {"out": compare.relative_error(out, ref)}
  grads = rgrads = ()
  if diff_argnums:
    ct = jax.random.normal(jax.random.key(7), out.shape, jnp.float32).astype(out.dtype)

    def loss(*a):
      return (fn(*a).astype(jnp.float32) * ct).sum()

    def rloss(*a):
      return (ref_fn(*a).astype(jnp.float32) * ct.astype(jnp.float32)).sum()

    grads = jax.jit(jax.grad(loss, diff_argnums))(*args)
    rgrads = jax.jit(jax.grad(rloss, diff_argnums))(*up)
  for i, g, rg in zip(diff_argnums, grads, rgrads, strict=True):
    for j, (gl, rgl) in enumerate(zip(jax.tree.leaves(g), jax.tree.leaves(rg), strict=True)):
      errs[f"d{i}.{j}"] = compare.relative_error(gl, rgl)
  ok = all(e <= tol(dtype) for e in errs.values())
  RESULTS["checks"].append({"name": name, "dtype": np.dtype(dtype).name, "ok": ok, "errors": errs})
  print(f"{'PASS' if ok else 'FAIL'} {name} {np.dtype(dtype).name} {errs}", flush=True)


def correctness(only: set[str]):
  keys = iter(jax.random.split(jax.random.key(0), 1000))

  def rnd(shape, dt):
    return jax.random.normal(next(keys), shape, jnp.float32).astype(dt)

  # layer_norm / RMSNorm.
  variants = ((True, True, True, 0.0), (False, True, False, 1.0), (True, False, True, 0.5))
  norm_cases = (
    (jnp.bfloat16, (64, 1000), -1, variants),
    (jnp.bfloat16, (8, 300, 24), 1, variants[:2]),
    (jnp.float16, (4, 4096), -1, variants[:2]),
    (jnp.float32, (33, 2000), -1, variants[:2]),
  )
  for dt, shape, axis, variants_here in norm_cases if "layer_norm" in only else ():
    if True:
      d = shape[axis]
      for subtract_mean, has_scale, has_offset, so in variants_here:
        kw = dict(axis=axis, subtract_mean=subtract_mean, scale_offset=so, epsilon=1e-5)
        x = rnd(shape, dt) * 2 + 0.5
        s = rnd((d,), dt) if has_scale else None
        b = rnd((d,), dt) if has_offset else None

        def fn(x, s, b, impl="triton", kw=kw):
          return tokamax.layer_norm(
            x, s, b, implementation=impl if impl != "triton" else OURS, **kw
          )

        argnums = tuple(i for i, a in enumerate((x, s, b)) if a is not None)
        check(
          f"layer_norm {shape} axis={axis} mean={subtract_mean} scale={has_scale} offset={has_offset} so={so}",
          fn,
          lambda x, s, b, fn=fn: fn(x, s, b, impl="xla"),
          (x, s, b),
          dt,
          argnums,
        )

  # gated_linear_unit.
  glu_cases = (
    (jnp.bfloat16, (4, 200, 256), 256, 384, jax.nn.swish, True),
    (jnp.bfloat16, (300, 512), 512, 200, jax.nn.gelu, False),
    (jnp.float32, (64, 96), 96, 128, None, True),
  )
  for dt, xs, k, n, act, fused in glu_cases if "gated_linear_unit" in only else ():
    if True:
      x = rnd(xs, dt)
      w = rnd((k, 2, n), dt) * float(1.0 / np.sqrt(k))
      weights = w if fused else (w[:, 0], w[:, 1])

      def fn(x, w, impl=OURS, act=act):
        return tokamax.gated_linear_unit(
          x, w, activation=act, precision=HIGHEST, implementation=impl
        )

      check(
        f"glu x{xs} w[{k},2,{n}] {getattr(act, '__name__', None)} fused={fused}",
        fn,
        lambda x, w, fn=fn: fn(x, w, impl="xla"),
        (x, weights),
        dt,
        (0, 1),
      )

  # ragged_dot: all layouts, uneven and empty groups, rows in no group, group_offset.
  m, k, n, g = 1000, 256, 384, 8
  ragged_cases = ((jnp.bfloat16, (None, 2)), (jnp.float32, (None,)))
  for dt, offsets in ragged_cases if "ragged_dot" in only else ():
    for layout in rd_spec.LAYOUTS:
      for offset in offsets:
        g_all = g + 4 if offset is not None else g
        sizes = jnp.asarray(
          tokamax.generate_ragged_dot_group_sizes(900, g_all, seed=3, empty_fraction=0.25)
        )
        lhs = rnd((m, k), dt)
        rhs = rnd({"default": (g, k, n), "rhs_transposed": (g, n, k)}.get(layout, (m, n)), dt)
        extra = {}
        if offset is not None:
          extra = dict(group_offset=jnp.array([offset], jnp.int32))
        dims = rd_spec.dimension_numbers(layout)

        def fn(lhs, rhs, impl=OURS, dims=dims, sizes=sizes, extra=extra):
          return tokamax.ragged_dot_general(
            lhs, rhs, sizes, dims, precision=HIGHEST, implementation=impl, **extra
          )

        check(
          f"ragged_dot {layout} M{m} K{k} N{n} G{g} offset={offset}",
          fn,
          lambda lhs, rhs, fn=fn: fn(lhs, rhs, impl="xla"),
          (lhs, rhs),
          dt,
          (0, 1) if layout != rd_spec.RAGGED_CONTRACTING else (),
        )
        if layout == rd_spec.RAGGED_CONTRACTING:
          # XLA has no gradient for this layout: check ours against the dense masked form.
          starts = np.concatenate([[0], np.cumsum(np.asarray(sizes))])
          o = offset or 0
          member = np.zeros((m, g_all), np.float32)  # As many local groups as entries.
          for j in range(g_all - o):
            member[starts[o + j] : starts[o + j + 1], j] = 1.0
          member = jnp.asarray(member)
          check(
            f"ragged_dot {layout} grads vs dense M{m} K{k} N{n} G{g} offset={offset}",
            fn,
            lambda lhs, rhs, member=member: jnp.einsum(
              "mk,mn,mg->gkn", lhs, rhs, member, precision=HIGHEST
            ),
            (lhs, rhs),
            dt,
            (0, 1),
          )


def bench(fn, argsets, iters=20, repeats=5) -> dict:
  """Device time (CUPTI, through harness.timing) where it works, else queued wallclock."""
  if not DRY:
    try:
      from harness import timing

      t = timing.device_time(fn, argsets, iterations=max(iters, 10), method="cupti")
      if t.method == timing.CUPTI:
        return {"median_ms": t.median_ms, "min_ms": 1e3 * t.min_s, "method": "cupti"}
    except Exception as e:
      RESULTS.setdefault("timer_errors", []).append(f"{type(e).__name__}: {e}"[:300])
  return {**queued_wallclock(fn, argsets, iters, repeats), "method": "queued_wallclock"}


def queued_wallclock(fn, argsets, iters, repeats) -> dict:
  out = fn(*argsets[0])
  jax.block_until_ready(out)
  for a in argsets[1:]:
    jax.block_until_ready(fn(*a))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for i in range(iters):
      out = fn(*argsets[i % len(argsets)])
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / iters)
  return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times)}


def fwd_and_fwdbwd(fn, diff_argnums):
  return jax.jit(fn), jax.jit(run_record.forward_backward(fn, diff_argnums))


def cotangent(fwd, args):
  """A random cotangent of the output's shape and dtype."""
  out = jax.eval_shape(fwd, *args)
  return jax.random.normal(jax.random.key(5), out.shape, jnp.float32).astype(out.dtype)


def timed(name, shape, impls, make_args, diff_argnums, iters=20, rounds=1):
  """Times each implementation forward and forward+backward.

  With `rounds` > 1 the implementations take turns, round after round, so that
  clock drift hits them alike; each time is then the median of the rounds' medians.
  """
  argsets = make_args()
  row = {"name": name, "shape": shape, "dtype": "bfloat16", "rounds": rounds}
  steps = {}
  for impl_name, fn in impls.items():
    try:
      fwd, grad = fwd_and_fwdbwd(fn, diff_argnums)
      ct = cotangent(fwd, argsets[0])
      steps[impl_name] = ((fwd, argsets), (grad, [(*a, ct) for a in argsets]))
    except Exception as e:
      row[f"{impl_name}_error"] = f"{type(e).__name__}: {e}"[:2000]
      traceback.print_exc()
  per_round = {}
  for _ in range(rounds):
    for impl_name, ((fwd, fwd_args), (grad, grad_args)) in steps.items():
      try:
        times = per_round.setdefault(impl_name, {"fwd": [], "fwdbwd": []})
        times["fwd"].append(bench(fwd, fwd_args, iters))
        times["fwdbwd"].append(bench(grad, grad_args, max(iters // 2, 3)))
      except Exception as e:
        row[f"{impl_name}_error"] = f"{type(e).__name__}: {e}"[:2000]
        traceback.print_exc()
  for impl_name, times in per_round.items():
    for mode, results in times.items():
      if results:
        medians = [r["median_ms"] for r in results]
        row[f"{impl_name}_{mode}"] = {
          **results[0],
          "median_ms": statistics.median(medians),
          "rounds_ms": medians,
        }
  for mode in ("fwd", "fwdbwd"):
    anchor = row.get(f"xla_{mode}", {}).get("median_ms")
    for impl_name in impls:
      ours = row.get(f"{impl_name}_{mode}", {}).get("median_ms")
      if impl_name.startswith("triton") and ours and anchor:
        suffix = impl_name.removeprefix("triton")
        row[f"speedup_{mode}{suffix}"] = anchor / ours
  RESULTS["timings"].append(row)
  save()
  print(
    f"{name} {shape}: "
    + " ".join(
      f"{k}={v['median_ms']:.3f}ms"
      for k, v in row.items()
      if isinstance(v, dict) and "median_ms" in v
    )
    + " "
    + " ".join(f"{k}={v:.2f}x" for k, v in row.items() if k.startswith("speedup")),
    flush=True,
  )
  return row


def sweep(name, make_fn, configs, argsets, diff_argnums=None, anchor=None, iters=10, check_fn=None):
  """Forward (and with `diff_argnums` forward+backward) time of each config.

  With `anchor` (a `timed` row of the same run), each row also holds the XLA
  time over the config's time (`speedup_fwd`, `speedup_fwdbwd`). With
  `check_fn` (the same function in XLA), each row holds the largest relative
  error of the output and gradients against it (`max_error`, `ok`).
  """
  rows = []
  expected = None
  if check_fn is not None and diff_argnums:
    fwd_ref, grad_ref = fwd_and_fwdbwd(check_fn, diff_argnums)
    expected = grad_ref(*argsets[0], cotangent(fwd_ref, argsets[0]))
  for cfg in configs:
    try:
      fwd, grad = fwd_and_fwdbwd(make_fn(cfg), diff_argnums or (0,))
      row = {"config": repr(cfg), "fwd": bench(fwd, argsets, iters, 3)}
      if diff_argnums:
        ct = cotangent(fwd, argsets[0])
        row["fwdbwd"] = bench(grad, [(*a, ct) for a in argsets], iters, 3)
      if expected is not None:
        actual = grad(*argsets[0], ct)
        errors = [
          compare.relative_error(a, e)
          for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
        ]
        row["max_error"] = max(errors)
        row["ok"] = row["max_error"] <= tol(argsets[0][0].dtype)
        if not row["ok"]:
          RESULTS["errors"].append(f"sweep {name} {cfg}: error {row['max_error']:.3g}")
      for mode in ("fwd", "fwdbwd"):
        xla = (anchor or {}).get(f"xla_{mode}", {}).get("median_ms")
        if xla and mode in row:
          row[f"speedup_{mode}"] = round(xla / row[mode]["median_ms"], 4)
      rows.append(row)
    except Exception as e:
      rows.append({"config": repr(cfg), "error": f"{type(e).__name__}: {e}"[:500]})
    print(f"  sweep {name} {rows[-1]}", flush=True)
    RESULTS.setdefault("sweeps", {})[name] = rows
    save()
  timed_rows = [r for r in rows if "fwdbwd" in r or "fwd" in r]
  for r in sorted(timed_rows, key=lambda r: r.get("fwdbwd", r["fwd"])["median_ms"]):
    ms = " ".join(f"{k}={r[k]['median_ms']:.4f}ms" for k in ("fwd", "fwdbwd") if k in r)
    ratios = " ".join(f"{k}={v:.3f}x" for k, v in r.items() if k.startswith("speedup"))
    print(f"  best-first {name}: {ms} {ratios} {r['config']}", flush=True)


def backward_variants(base, d: int) -> list:
  """The heuristic config, then variants of the backward, then of the forward.

  Backward: the register-prefetching loop on one program per SM, and loops
  software-pipelined through shared memory (`bwd_stages`, cp.async) at 8-32
  elements per thread. Forward: persistent programs pipelined the same way,
  on the backward that the D=8192 shared-memory variants are expected to win with.
  """
  rep = dataclasses.replace
  wide = d >= 8192
  # The session-3 default of D=8192 for reference: 264 programs.
  configs = [base, rep(base, bwd_programs=264)] if wide else [base]
  for warps in (16, 32) if wide else (8, 16):
    for stages in (2, 3, 4, 5) if wide else (3, 4):
      for programs in (
        (132, 264) if wide and stages in (3, 4) and warps == 16 else (132 if wide else 264,)
      ):
        configs.append(
          rep(
            base,
            bwd_num_warps=warps,
            bwd_block_m=1,
            bwd_programs=programs,
            bwd_prefetch=False,
            bwd_stages=stages,
          )
        )
  bwd = rep(
    base,
    bwd_num_warps=16,
    bwd_block_m=1,
    bwd_programs=132 if wide else 264,
    bwd_prefetch=False,
    bwd_stages=4,
  )
  # Programs: as many as fit an SM at once (ptxas registers and shared memory, bf16).
  fwd = ((8, 264, 3), (8, 396, 3), (4, 396, 3), (8, 264, 0))
  if not wide:
    fwd = ((8, 264, 3), (8, 528, 3), (4, 528, 3), (8, 396, 0))
  for warps, programs, stages in fwd:
    configs.append(rep(bwd, num_warps=warps, block_m=1, fwd_programs=programs, fwd_stages=stages))
  return list(dict.fromkeys(configs))


def norm_variants(base, d: int) -> dict:
  """Configs timed beside the heuristic's in the interleaved rounds (--norm-variants)."""
  rep = dataclasses.replace
  variants = {"stream_dx": rep(base, bwd_stream_dx=True)}
  if d >= 8192:
    variants["fwd264"] = rep(base, fwd_programs=264)
    variants["fwd264_stream_dx"] = rep(base, fwd_programs=264, bwd_stream_dx=True)
  return variants


def spec_of_norm(args, rms):
  from tokamax._src.ops.normalization import spec

  x, scale, offset = args
  return spec.canonicalize(x, scale, offset, subtract_mean=not rms)


def benchmarks(skip_sweeps: bool, only: set[str]):
  keys = iter(jax.random.split(jax.random.key(1), 1000))

  def rnd(shape, dt=jnp.bfloat16):
    return jax.random.normal(next(keys), shape, jnp.float32).astype(dt)

  # layer_norm and RMSNorm.
  for m, d in ((16384 // SCALE, 4096), (4096 // SCALE, 8192)) if "layer_norm" in only else ():
    for rms in (False, True):

      def make(m=m, d=d, rms=rms):
        return [(rnd((m, d)), rnd((d,)), None if rms else rnd((d,))) for _ in range(4)]

      def impl(name, rms=rms):
        return lambda x, s, b: tokamax.layer_norm(
          x, s, b, subtract_mean=not rms, implementation=name
        )

      impls = {"triton": impl(OURS), "xla": impl("xla")}
      if NORM_VARIANTS and rms and not DRY:
        base = norm_triton.TritonLayerNorm()._get_heuristics_config(spec_of_norm(make()[0], rms))
        for label, variant in norm_variants(base, d).items():
          impls[f"triton_{label}"] = impl(norm_triton.TritonLayerNorm(config=variant))
      row = timed(
        "rms_norm" if rms else "layer_norm",
        [m, d],
        impls,
        make,
        (0, 1) if rms else (0, 1, 2),
        iters=50,
        rounds=NORM_ROUNDS,
      )
      if not skip_sweeps and not DRY and ("rms_norm" if rms else "layer_norm", m, d) in SWEEPS:
        base = norm_triton.TritonLayerNorm()._get_heuristics_config(spec_of_norm(make()[0], rms))
        configs = backward_variants(base, d)
        sweep(
          f"{'rms_norm' if rms else 'layer_norm'} {m}x{d}",
          lambda cfg, rms=rms: (
            lambda x, s, b: tokamax.layer_norm(
              x,
              s,
              b,
              subtract_mean=not rms,
              implementation=norm_triton.TritonLayerNorm(config=cfg),
            )
          ),
          configs,
          make(),
          (0, 1) if rms else (0, 1, 2),
          anchor=row,
          iters=20,
          check_fn=impl("xla"),
        )

  # ragged_dot.
  for m, k, n, g in (
    (
      (16384, 4096 // SCALE, 2048 // SCALE, 8),
      (32768 // SCALE, 7168 // SCALE, 2048, 64),
    )
    if "ragged_dot" in only
    else ()
  ):
    sizes = jnp.asarray(tokamax.generate_ragged_dot_group_sizes(m, g, seed=0))
    nsets = 2 if m > 20000 else 3

    def make(m=m, k=k, n=n, g=g, nsets=nsets):
      return [(rnd((m, k)), rnd((g, k, n))) for _ in range(nsets)]

    def impl(name, sizes=sizes):
      if name == "lax":
        return lambda lhs, rhs: jax.lax.ragged_dot(lhs, rhs, sizes)
      return lambda lhs, rhs: tokamax.ragged_dot(lhs, rhs, sizes, implementation=name)

    timed(
      "ragged_dot",
      [m, k, n, g],
      {"triton": impl(OURS), "xla": impl("lax")},
      make,
      (0, 1),
      iters=10,
    )
    if not skip_sweeps and g == 8 and not DRY:
      argsets = make()
      sweep(
        f"ragged_dot M{m} K{k} N{n} G{g}",
        lambda cfg, sizes=sizes: (
          lambda lhs, rhs: tokamax.ragged_dot(
            lhs, rhs, sizes, implementation=rd_triton.TritonRaggedDot(config=cfg)
          )
        ),
        [
          rd_triton.TritonRaggedDotConfig(128, 128, 64, 8, 4),
          rd_triton.TritonRaggedDotConfig(128, 256, 64, 8, 4),
        ],
        argsets,
      )

  # gated_linear_unit (swish).
  for m, k, n in (
    ((8192 // SCALE, 4096 // SCALE, 14336 // SCALE), (2048 // SCALE, 2048, 8192 // SCALE))
    if "gated_linear_unit" in only
    else ()
  ):

    def make(m=m, k=k, n=n):
      return [(rnd((m, k)), rnd((k, 2, n)) * (1 / 64)) for _ in range(2)]

    def impl(name):
      return lambda x, w: tokamax.gated_linear_unit(
        x, w, activation=jax.nn.swish, implementation=name
      )

    timed(
      "gated_linear_unit",
      [m, k, n],
      {"triton": impl(OURS), "xla": impl("xla")},
      make,
      (0, 1),
      iters=10,
    )
    if not skip_sweeps and m == 8192 and not DRY:
      sweep(
        f"glu {m}x{k}x{n}",
        lambda cfg: (
          lambda x, w: tokamax.gated_linear_unit(
            x,
            w,
            activation=jax.nn.swish,
            implementation=glu_triton.TritonGatedLinearUnit(config=cfg),
          )
        ),
        [
          glu_triton.TritonGluConfig(128, 128, 64, 8, 8, 4),
          glu_triton.TritonGluConfig(128, 64, 64, 8, 8, 4),
          glu_triton.TritonGluConfig(128, 128, 64, 4, 8, 3),
        ],
        make(),
      )


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  parser.add_argument("--skip-correctness", action="store_true")
  parser.add_argument("--skip-bench", action="store_true")
  parser.add_argument("--skip-sweeps", action="store_true")
  parser.add_argument("--dry", action="store_true")
  parser.add_argument(
    "--only", default="layer_norm,gated_linear_unit,ragged_dot", help="ops to check and time"
  )
  parser.add_argument("--norm-rounds", type=int, default=1, help="interleaved norm rounds")
  parser.add_argument("--norm-variants", action="store_true", help="RMSNorm config variants")
  a = parser.parse_args()
  global NORM_ROUNDS, NORM_VARIANTS
  NORM_ROUNDS, NORM_VARIANTS = a.norm_rounds, a.norm_variants
  RECORD.path = os.path.join(a.out, "triton_mm_norm.json")
  dev = jax.devices()[0]
  RESULTS["device"] = getattr(dev, "device_kind", str(dev))
  RESULTS["jax"] = jax.__version__
  RESULTS["python"] = platform.python_version()
  RESULTS["commit"] = bench_lib.current_commit()
  RESULTS["timing_method"] = "CUPTI device time where it works, else queued wallclock (per row)"
  t0 = time.time()
  try:
    only = set(a.only.split(","))
    if not a.skip_correctness:
      correctness(only)
    if not a.skip_bench:
      benchmarks(a.skip_sweeps, only)
  except Exception as e:
    RESULTS["errors"].append(f"{type(e).__name__}: {e}")
    traceback.print_exc()
  finally:
    RESULTS["wall_s"] = time.time() - t0
    save()
  fails = [c["name"] for c in RESULTS["checks"] if not c["ok"]]
  print(f"checks: {len(RESULTS['checks']) - len(fails)} passed, {len(fails)} failed")
  for row in RESULTS["timings"]:
    print(
      row["name"], row["shape"], {k: round(v, 2) for k, v in row.items() if k.startswith("speedup")}
    )
  sys.exit(1 if fails or RESULTS["errors"] else 0)


if __name__ == "__main__":
  main()
