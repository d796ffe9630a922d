"""Triton layer_norm/RMSNorm: compile for sm_80/sm_90, wrapper logic and
interpreted numerics on CPU, compiled numerics on an NVIDIA GPU.

Not covered on CPU: timings and the compiled kernels' numerics (the GPU test
below and ci/gpu/triton_mm_norm.py cover them on the H200).
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from suites import opdb
from suites.kernels import interpreted
from suites.kernels.gpu_limits import SMEM_LIMIT
from tokamax._src import device, export, triton_call
from tokamax._src.ops.normalization import api, spec
from tokamax._src.ops.normalization import triton as norm_triton
from tokamax_harness import compare, references

# The summary counts these under the op and implementation they check.
pytestmark = pytest.mark.op("layer_norm", "triton")

OP = norm_triton.TritonLayerNorm()

# `kernel_cases.LayerNormKernelCase`s (in the op database).
CASES = list(opdb.get("layer_norm").kernel_cases["triton"].values())
GPU_CASES = [*CASES, *opdb.get("layer_norm").kernel_cases["triton:gpu"].values()]


def _inputs(shape, axis, dtype, has_scale, has_offset, seed=0):
  rng = np.random.default_rng(seed)
  d = shape[axis]
  x = jnp.asarray(rng.standard_normal(shape) * 2 + 0.3, dtype)
  scale = jnp.asarray(rng.standard_normal(d), dtype) if has_scale else None
  offset = jnp.asarray(rng.standard_normal(d), dtype) if has_offset else None
  dy = jnp.asarray(rng.standard_normal(shape), dtype)
  return x, scale, offset, dy


def _record(shape, axis, dtype, subtract_mean, has_scale, has_offset, scale_offset):
  x, scale, offset, _ = _inputs(shape, axis, dtype, has_scale, has_offset)
  return spec.canonicalize(
    x, scale, offset, axis=axis, scale_offset=scale_offset, subtract_mean=subtract_mean
  )


def _case_record(case):
  return _record(
    case.shape,
    case.axis,
    case.dtype,
    case.subtract_mean,
    case.has_scale,
    case.has_offset,
    case.scale_offset,
  )


def _launches(args, config):
  """The launches of forward and backward, traced abstractly (no arrays computed)."""

  def run(args):
    out, residuals = OP._fwd(args, config)
    return out, OP._bwd(args, config, out, residuals, jnp.ones_like(args.x))

  with triton_call.capture() as launches:
    out, grads = jax.eval_shape(run, args)
  return launches, out, grads


@pytest.mark.parametrize("sm", [80, 89, 90])
@pytest.mark.parametrize("d", [40, 1000, 4096, 8192])
def test_heuristic_configs_compile(sm, d):
  args = _record((16, d), -1, "bfloat16", True, True, True, 0.0)
  launches, _, _ = _launches(args, OP._get_heuristics_config(args))
  assert [launch.kernel.__name__ for launch in launches] == [
    "layer_norm_fwd",
    "layer_norm_bwd",
    "sum_partials",
  ]
  for launch in launches:
    compiled = triton_call.compile_launch(launch, sm)
    assert "cubin" in compiled.asm
    assert compiled.metadata.shared <= SMEM_LIMIT[sm]


def test_persistent_programs_follow_the_sm_count(monkeypatch):
  """On an A100's 108 SMs: 4 forward programs and 1 backward program an SM at rows of 8192,
  2 backward programs an SM at rows of 4096, and backward candidates of 1-8 an SM (an
  H200's 132-based counts would leave a second, mostly idle wave of programs)."""
  monkeypatch.setattr(device, "sm_count", lambda *_: 108)
  wide = OP._get_heuristics_config(_record((4096, 8192), -1, "bfloat16", True, True, True, 0.0))
  assert (wide.fwd_programs, wide.bwd_programs) == (432, 108)
  args = _record((4096, 4096), -1, "bfloat16", True, True, True, 0.0)
  assert OP._get_heuristics_config(args).bwd_programs == 216
  programs = {c.bwd_programs for c in OP._get_autotuning_configs(args)}
  assert programs == {108, 216, 432, 864}
  assert {c.fwd_programs for c in OP._get_autotuning_configs(args)} == {0, 432}


def test_sm_count_of_the_device():
  class Gpu:
    platform, core_count = "gpu", 108

  assert device.sm_count(Gpu()) == 108
  Gpu.core_count = None
  assert device.sm_count(Gpu()) == device.DEFAULT_SM_COUNT == 132
  if jax.default_backend() == "cpu":
    assert device.sm_count() == 132
    with export.abstract_gpu(num_cores=114):  # Lowering for an H100 PCIe on this host.
      assert device.sm_count() == 114


def test_heuristic_of_wide_layer_norm_rows_is_the_h200_tuning_winner():
  """LayerNorm 4096x8192 bfloat16: the config that won the H200 tuning at 28b7769 (528
  persistent forward programs; 0.0939 against 0.0986 ms), whose shipped entry it replaces.
  RMSNorm (where that gained 0.6%) and rows of 4096 keep one program per row block."""
  winner = norm_triton.TritonNormConfig(
    block_m=1,
    num_warps=8,
    bwd_block_m=1,
    bwd_num_warps=16,
    bwd_programs=132,
    fwd_programs=528,
    bwd_prefetch=False,
    bwd_stages=4,
  )
  layer = _record((4096, 8192), -1, "bfloat16", True, True, True, 0.0)
  assert OP._get_heuristics_config(layer) == winner
  rms = _record((4096, 8192), -1, "bfloat16", False, True, False, 0.0)
  assert OP._get_heuristics_config(rms).fwd_programs == 0
  narrow = _record((16384, 4096), -1, "bfloat16", True, True, True, 0.0)
  assert OP._get_heuristics_config(narrow).fwd_programs == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_heuristic_backward_of_wide_rows_fits_shared_memory_on_sm80(dtype):
  """D=8192: bfloat16 rows are pipelined through shared memory; float32 ones would take
  3 stages x 2 x 32 KiB there, over sm_80's limit, so they are not."""
  args = _record((64, 8192), -1, dtype, True, True, True, 0.0)
  config = OP._get_heuristics_config(args)
  assert (config.bwd_stages > 1) == (dtype == "bfloat16")
  launches, _, _ = _launches(args, config)
  (bwd,) = [launch for launch in launches if launch.kernel.__name__ == "layer_norm_bwd"]
  assert triton_call.compile_launch(bwd, 80).metadata.shared <= SMEM_LIMIT[80]


@pytest.mark.parametrize(
  "sm, fwd_stages, bwd_stages",
  [(80, 3, 4), (90, 3, 4), (90, 2, 2)],
  ids=["sm80", "sm90", "sm90_two_stages"],
)
def test_pipelined_configs_compile_to_async_copies(sm, fwd_stages, bwd_stages):
  """Loops with stages (2 included) copy rows into shared memory (cp.async), STAGES - 1 deep:
  one row block of x per stage in flight in the persistent forward, one of x and one of dy in
  the backward."""
  args = _record((4096, 8192), -1, "bfloat16", False, True, False, 0.0)
  config = dataclasses.replace(
    OP._get_heuristics_config(args),
    bwd_num_warps=16,
    bwd_prefetch=True,  # Stages override the register prefetch.
    bwd_stages=bwd_stages,
    fwd_programs=264,
    fwd_stages=fwd_stages,
  )
  assert config.num_warps != config.bwd_num_warps
  launches, _, _ = _launches(args, config)
  assert [launch.kernel.__name__ for launch in launches] == [
    "layer_norm_fwd_persistent",
    "layer_norm_bwd",
    "sum_partials",
  ]
  row_bytes = 8192 * 2
  buffers = ((fwd_stages - 1) * 1, (bwd_stages - 1) * 2)
  warps = (config.num_warps, config.bwd_num_warps)
  for launch, n, w in zip(launches[:2], buffers, warps, strict=True):
    compiled = triton_call.compile_launch(launch, sm)
    assert "cp.async" in compiled.asm["ptx"], launch.kernel.__name__
    assert n * row_bytes <= compiled.metadata.shared <= SMEM_LIMIT[sm]
    assert compiled.metadata.num_warps == w


@pytest.mark.parametrize("subtract_mean", [False, True], ids=["rms", "layer"])
def test_autotuning_configs_compile_for_sm90(subtract_mean):
  args = _record((2048, 4096), -1, "bfloat16", subtract_mean, True, False, 1.0)
  seen = set()
  for config in OP._get_autotuning_configs(args):
    launches, _, _ = _launches(args, config)
    for launch in launches:
      key = (launch.kernel.__name__, tuple(sorted(launch.meta.items())))
      if key not in seen:
        seen.add(key)
        assert triton_call.compile_launch(launch, 90).metadata.shared <= SMEM_LIMIT[90]
  names = {key[0] for key in seen}
  expected = {"layer_norm_fwd", "layer_norm_fwd_persistent", "layer_norm_bwd", "sum_partials"}
  assert names == expected, names


@pytest.mark.parametrize("case", CASES)
def test_wrapper_shapes_and_dtypes(case):
  args = _case_record(case)
  launches, out, grads = _launches(args, OP._get_heuristics_config(args))
  assert out.shape == args.x.shape and out.dtype == args.x.dtype
  assert grads["x"].shape == args.x.shape and grads["x"].dtype == args.x.dtype
  for name in ("scale", "offset"):
    value = getattr(args, name)
    assert (grads[name] is None) == (value is None)
    if value is not None:
      assert grads[name].shape == value.shape and grads[name].dtype == value.dtype
  rows = args.x.size // args.x.shape[args.axis]
  fwd = launches[0]
  assert fwd.out_shape[0].shape == (rows, args.x.shape[args.axis])
  assert fwd.grid[0] * fwd.meta["BLOCK_M"] >= rows


def test_unsupported_reasons():
  x = jnp.ones((4, 8), jnp.float32)
  f64 = dataclasses.replace(spec.canonicalize(x, None, None), x=np.ones((4, 8), np.float64))
  assert "float64" in OP._unsupported_reason(f64)
  assert "empty" in OP._unsupported_reason(spec.canonicalize(jnp.ones((0, 8)), None, None))
  assert "empty" in OP._unsupported_reason(spec.canonicalize(jnp.ones((4, 0)), None, None))
  assert "size 40000" in OP._unsupported_reason(spec.canonicalize(jnp.ones((2, 40000)), None, None))
  assert OP._unsupported_reason(spec.canonicalize(x, None, None)) is None


@pytest.mark.requires("cpu")
def test_cpu_names_triton_unavailable_and_falls_back():
  x, scale, offset, _ = _inputs((4, 32), -1, "float32", True, True)
  with pytest.raises(NotImplementedError, match="Triton"):
    api.layer_norm(x, scale, offset, implementation="triton")
  expected = references.high_precision(references.layer_norm)(x, scale, offset)
  np.testing.assert_allclose(api.layer_norm(x, scale, offset), expected, rtol=1e-5, atol=1e-5)


def _interpreted_errors(case) -> dict:
  """Runs the kernels in Triton's interpreter."""
  dtype = case.dtype
  x, scale, offset, dy = _inputs(case.shape, case.axis, dtype, case.has_scale, case.has_offset)
  kw = dict(axis=case.axis, scale_offset=case.scale_offset, subtract_mean=case.subtract_mean)
  args = spec.canonicalize(x, scale, offset, **kw)
  # One program per block, persistent programs that prefetch the next rows into
  # registers, and loops pipelined through shared memory.
  config = norm_triton.TritonNormConfig(
    block_m=2, num_warps=4, bwd_block_m=2, bwd_num_warps=4, bwd_programs=3
  )
  prefetch = dataclasses.replace(config, block_m=1, fwd_programs=3, bwd_prefetch=True)
  # One-pass statistics in the persistent pipelined forward and in the plain one.
  staged = dataclasses.replace(
    config, fwd_programs=2, fwd_stages=3, bwd_stages=3, fwd_one_pass=True
  )
  one_pass = dataclasses.replace(config, fwd_one_pass=True)
  with triton_call.interpret():
    out_1, _ = OP._fwd(args, one_pass)
    out, residuals = OP._fwd(args, config)
    grads = OP._bwd(args, config, out, residuals, dy)
    out_p, residuals_p = OP._fwd(args, prefetch)
    grads_p = OP._bwd(args, prefetch, out_p, residuals_p, dy)
    out_s, residuals_s = OP._fwd(args, staged)
    grads_s = OP._bwd(args, staged, out_s, residuals_s, dy)
  present = [(n, v) for n, v in (("x", x), ("scale", scale), ("offset", offset)) if v is not None]

  def ref(*vals, present=present, kw=kw):
    named = {
      "scale": None,
      "offset": None,
      **{n: v for (n, _), v in zip(present, vals, strict=True)},
    }
    return references.layer_norm(named["x"], named["scale"], named["offset"], epsilon=1e-6, **kw)

  ref_out, ref_grads = references.high_precision_vjp(ref, [v for _, v in present], dy)
  errs = {
    "out": compare.relative_error(out, ref_out),
    "out_prefetch": compare.relative_error(out_p, ref_out),
    "out_staged": compare.relative_error(out_s, ref_out),
    "out_one_pass": compare.relative_error(out_1, ref_out),
  }
  for (name, _), rg in zip(present, ref_grads, strict=True):
    errs[name] = compare.relative_error(grads[name], rg)
    errs[f"{name}_prefetch"] = compare.relative_error(grads_p[name], rg)
    errs[f"{name}_staged"] = compare.relative_error(grads_s[name], rg)
  return {"case": repr(case), "dtype": dtype, "errors": errs}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.host_only
def test_interpreted_kernels_match_float64_reference(case):
  interpreted.assert_errors_within_bound(_interpreted_errors(case))


@pytest.mark.host_only
@pytest.mark.parametrize("persistent", [False, True], ids=["plain", "persistent"])
def test_interpreted_one_pass_statistics_do_not_cancel_far_from_zero(persistent):
  """Rows at mean 1000 with unit spread: E[x^2] - E[x]^2 unshifted loses the variance in float32."""
  rng = np.random.default_rng(7)
  x = jnp.asarray(1000.0 + rng.standard_normal((4, 256)), jnp.float32)
  _check_one_pass_statistics(x, 1 if persistent else None, atol=1e-3)


def _check_one_pass_statistics(x, fwd_programs: int | None, atol: float):
  """The one-pass forward interpreted (persistent with `fwd_programs`) against float64."""
  args = spec.canonicalize(x, None, None)
  config = norm_triton.TritonNormConfig(block_m=2, num_warps=4, fwd_one_pass=True)
  if fwd_programs is not None:
    config = dataclasses.replace(config, fwd_programs=fwd_programs)
  with triton_call.interpret():
    out, (mean, rstd) = OP._fwd(args, config)
  x64 = np.asarray(x, np.float64)
  ref_mean = x64.mean(axis=1)
  ref_rstd = 1 / np.sqrt(x64.var(axis=1) + 1e-6)
  np.testing.assert_allclose(np.asarray(mean), ref_mean, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(rstd), ref_rstd, rtol=1e-4)
  np.testing.assert_allclose(out, (x64 - ref_mean[:, None]) * ref_rstd[:, None], atol=atol)


@pytest.mark.parametrize("fwd_programs", [0, 528], ids=["plain", "persistent"])
def test_streaming_hints_only_in_the_forward_that_saves_nothing(fwd_programs):
  """`fwd_streaming` compiles the forward without a gradient to evict_first loads and .cs
  stores; the forward under differentiation keeps x in L2 for the backward's reread."""
  args = _record((4096, 8192), -1, "bfloat16", True, True, True, 0.0)
  config = norm_triton.TritonNormConfig(fwd_programs=fwd_programs, fwd_streaming=True)

  def ptx(fn):
    with triton_call.capture() as launches:
      jax.eval_shape(lambda a: fn(a, config), args)
    return triton_call.compile_launch(launches[0], 90).asm["ptx"]

  primal, differentiated = ptx(OP._fwd_primal), ptx(lambda a, c: OP._fwd(a, c)[0])
  assert "evict_first" in primal and "st.global.cs" in primal
  assert "evict_first" not in differentiated and "st.global.cs" not in differentiated


@pytest.mark.host_only
@pytest.mark.parametrize("fwd_programs", [0, 3], ids=["plain", "persistent"])
@pytest.mark.parametrize("subtract_mean", [False, True], ids=["rms", "layer"])
def test_interpreted_streaming_forward_matches_float64(subtract_mean, fwd_programs):
  """The forward without a gradient under `fwd_streaming`, interpreted, against float64."""
  x, scale, offset, _ = _inputs((10, 96), -1, "float32", True, True, seed=3)
  args = spec.canonicalize(x, scale, offset, subtract_mean=subtract_mean)
  config = norm_triton.TritonNormConfig(
    block_m=2, num_warps=2, fwd_programs=fwd_programs, fwd_streaming=True
  )
  with triton_call.interpret():
    out = OP._fwd_primal(args, config)
  x64, w64, b64 = (np.asarray(a, np.float64) for a in (x, scale, offset))
  mean = x64.mean(axis=1, keepdims=True) if subtract_mean else 0.0
  centred = x64 - mean
  want = centred / np.sqrt((centred**2).mean(axis=1, keepdims=True) + 1e-6) * w64 + b64
  np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=1e-5)


@pytest.mark.host_only
@pytest.mark.parametrize("subtract_mean", [False, True], ids=["rms", "layer"])
def test_interpreted_kernels_use_the_callers_epsilon(subtract_mean):
  """epsilon=0.5 on rows of variance ~0.1: the default 1e-6 would be far off, forward and
  backward (whose rstd comes from the forward)."""
  x, scale, offset, dy = _inputs((6, 40), -1, "float32", True, True, seed=3)
  x = x * 0.15
  kw = dict(epsilon=0.5, subtract_mean=subtract_mean)
  args = spec.canonicalize(x, scale, offset, **kw)
  config = norm_triton.TritonNormConfig(block_m=2, num_warps=4, bwd_block_m=2, bwd_num_warps=4)
  ref_out, ref_grads = references.high_precision_vjp(
    lambda a, b, c: references.layer_norm(a, b, c, **kw), (x, scale, offset), dy
  )
  # One program per block, and the persistent forward (register prefetch, then pipelined).
  for fwd in ({}, dict(fwd_programs=2), dict(fwd_programs=2, fwd_stages=3)):
    with triton_call.interpret():
      out, residuals = OP._fwd(args, dataclasses.replace(config, **fwd))
      grads = OP._bwd(args, config, out, residuals, dy)
    assert compare.relative_error(out, ref_out) <= 1e-5, fwd
    for name, rg in zip(("x", "scale", "offset"), ref_grads, strict=True):
      assert compare.relative_error(grads[name], rg) <= 1e-5, (fwd, name)


def _normalized64(x) -> np.ndarray:
  """Rows of `x` in float64, standardised over the last axis (epsilon 1e-6)."""
  x64 = np.asarray(x, np.float64)
  return (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-6)


@pytest.mark.host_only
@pytest.mark.parametrize("programs", [264, 257])
def test_interpreted_partial_sums_of_many_programs(programs):
  """More backward programs (one row each) than one block of sum_partials' loop over them
  (256), down to a last block of one row: dscale and doffset add every block of partial sums."""
  x, scale, offset, dy = _inputs((programs, 20), -1, "float32", True, True, seed=4)
  args = spec.canonicalize(x, scale, offset)
  config = norm_triton.TritonNormConfig(
    block_m=4, num_warps=4, bwd_num_warps=4, bwd_programs=programs
  )
  with triton_call.interpret():
    out, residuals = OP._fwd(args, config)
    grads = OP._bwd(args, config, out, residuals, dy)
  dy64, xhat = np.asarray(dy, np.float64), _normalized64(x)
  np.testing.assert_allclose(grads["scale"], (dy64 * xhat).sum(0), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(grads["offset"], dy64.sum(0), rtol=1e-5, atol=1e-4)


def test_unsupported_reasons_of_scale_and_offset_dtypes_and_the_longest_row():
  """float64 scale or offset is named like float64 x; a row of exactly _MAX_D is supported."""
  x = jnp.ones((4, 8), jnp.float32)
  base = spec.canonicalize(x, jnp.ones(8, jnp.float32), jnp.ones(8, jnp.float32))
  assert OP._unsupported_reason(base) is None
  for name in ("scale", "offset"):
    f64 = dataclasses.replace(base, **{name: np.ones(8, np.float64)})
    reason = OP._unsupported_reason(f64)
    assert reason is not None and f"`{name}` dtype float64" in reason, reason
  longest = norm_triton._MAX_D
  assert OP._unsupported_reason(spec.canonicalize(jnp.ones((2, longest)), None, None)) is None
  too_long = spec.canonicalize(jnp.ones((2, longest + 1)), None, None)
  assert f"size {longest + 1}" in OP._unsupported_reason(too_long)


@pytest.mark.requires("triton")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_matches_reference_with_gradients(case, dtype):
  if (reason := triton_call.unavailable_reason()) is not None:
    pytest.skip(reason)  # E.g. jax-triton is not installed.
  x, scale, offset, dy = _inputs(
    case.shape, case.axis, dtype, case.has_scale, case.has_offset, seed=1
  )
  kw = dict(axis=case.axis, scale_offset=case.scale_offset, subtract_mean=case.subtract_mean)
  present = [v for v in (x, scale, offset) if v is not None]
  names = [n for n, v in (("x", x), ("scale", scale), ("offset", offset)) if v is not None]

  def call(*vals, impl):
    named = {"scale": None, "offset": None, **dict(zip(names, vals, strict=True))}
    return api.layer_norm(named["x"], named["scale"], named["offset"], implementation=impl, **kw)

  out, vjp = jax.vjp(jax.jit(lambda *v: call(*v, impl="triton")), *present)
  grads = vjp(dy)

  def ref(*vals):
    named = {"scale": None, "offset": None, **dict(zip(names, vals, strict=True))}
    return references.layer_norm(named["x"], named["scale"], named["offset"], epsilon=1e-6, **kw)

  ref_out, ref_grads = references.high_precision_vjp(ref, present, dy)
  limit = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 5e-3}[dtype]
  assert compare.relative_error(out, ref_out) <= limit
  for name, g, rg in zip(names, grads, ref_grads, strict=True):
    assert compare.relative_error(g, rg) <= limit, name


@pytest.mark.requires("triton")
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c.subtract_mean])
def test_gpu_one_pass_forward_matches_reference(case):
  """The one-pass statistics (an autotuning candidate) on the device, at mean 50."""
  if (reason := triton_call.unavailable_reason()) is not None:
    pytest.skip(reason)
  x, scale, offset, _ = _inputs(
    case.shape, case.axis, "bfloat16", case.has_scale, case.has_offset, seed=2
  )
  x = x + jnp.asarray(50, x.dtype)
  kw = dict(axis=case.axis, scale_offset=case.scale_offset, subtract_mean=True)
  record = spec.canonicalize(x, scale, offset, **kw)
  config = dataclasses.replace(OP._get_heuristics_config(record), fwd_one_pass=True)
  out = jax.jit(
    lambda x, s, o: api.layer_norm(x, s, o, implementation=OP.with_config(config), **kw)
  )(x, scale, offset)
  ref = references.high_precision(references.layer_norm)(x, scale, offset, epsilon=1e-6, **kw)
  assert compare.relative_error(out, ref) <= 5e-3


def test_compiles_after_jax_triton_empties_the_triton_cache_dir(monkeypatch):
  """Importing jax-triton sets TRITON_CACHE_DIR to ""; compiling must still work."""
  monkeypatch.setenv("TRITON_CACHE_DIR", "")
  args = _record((16, 256), -1, "bfloat16", True, True, True, 0.0)
  launches, _, _ = _launches(args, OP._get_heuristics_config(args))
  assert "cubin" in triton_call.compile_launch(launches[0], 90).asm
  assert os.environ["TRITON_CACHE_DIR"] == ""


@pytest.mark.host_only
@pytest.mark.parametrize("persistent", [False, True], ids=["plain", "persistent"])
def test_interpreted_one_pass_shifts_each_row_by_its_own_element(persistent):
  """Rows at means 1000, -2000, 3000, ...: a shift taken from another row (or none) leaves
  E[d^2] - E[d]^2 cancelling in float32; each row's own first element keeps it exact."""
  rng = np.random.default_rng(8)
  means = 1000.0 * np.array([1, -2, 3, -4, 5, -6])[:, None]
  x = jnp.asarray(means + rng.standard_normal((6, 96)), jnp.float32)
  _check_one_pass_statistics(x, 2 if persistent else None, atol=2e-3)


def _per_thread(rows: int, d: int, warps: int) -> float:
  """Elements of a block of `rows` rows of width D that each thread holds."""
  return rows * norm_triton._block_d(d) / (32 * warps)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("subtract_mean", [False, True], ids=["rms", "layer"])
def test_heuristic_and_autotuning_configs_hold_4_to_64_elements_per_thread(dtype, subtract_mean):
  """Rows live in registers: every candidate holds 4-64 elements per thread (more spills),
  forward and backward, at every row width up to the longest supported; the rows that
  pipelined loops keep in flight fit 128 KiB of shared memory (sm_80 has 163 KiB)."""
  itemsize = np.dtype(dtype).itemsize
  for d in (1, 16, 40, 100, 256, 512, 1000, 2048, 4096, 8192, 16384, norm_triton._MAX_D):
    args = _record((4, d), -1, dtype, subtract_mean, True, True, 0.0)
    heuristic = OP._get_heuristics_config(args)
    row_bytes = norm_triton._block_d(d) * itemsize
    for c in {heuristic, *OP._get_autotuning_configs(args)}:
      where = (d, c)
      assert 4 <= _per_thread(c.block_m, d, c.num_warps) <= 64, where
      assert 4 <= _per_thread(c.bwd_block_m, d, c.bwd_num_warps) <= 64, where
      if c.fwd_stages > 1:
        assert (c.fwd_stages - 1) * c.block_m * row_bytes <= 128 * 1024, where
      if c.bwd_stages > 1:
        assert (c.bwd_stages - 1) * 2 * c.bwd_block_m * row_bytes <= 128 * 1024, where


def test_autotuning_backward_of_wide_rows_compiles_within_sm90_shared_memory():
  """D=8192 bfloat16, whose heuristic pipelines the backward: the candidate with the most
  rows in flight (stages times rows per step) still fits sm_90's shared memory."""
  args = _record((64, 8192), -1, "bfloat16", True, True, True, 0.0)
  assert OP._get_heuristics_config(args).bwd_stages > 1
  staged = [c for c in OP._get_autotuning_configs(args) if c.bwd_stages > 1]
  widest = max(staged, key=lambda c: ((c.bwd_stages - 1) * c.bwd_block_m, c.bwd_num_warps))
  launches, _, _ = _launches(args, widest)
  (bwd,) = [launch for launch in launches if launch.kernel.__name__ == "layer_norm_bwd"]
  assert triton_call.compile_launch(bwd, 90).metadata.shared <= SMEM_LIMIT[90], widest


def test_backward_fields_are_exactly_the_fields_the_forward_launch_ignores():
  """Changing a field in `BACKWARD_FIELDS` changes the backward launches and leaves the
  forward launches (with and without a gradient) as they were; changing any other field
  does the opposite (forward-only tuning keeps one candidate per forward)."""
  args = _record((64, 256), -1, "bfloat16", True, True, True, 0.0)
  base = norm_triton.TritonNormConfig(
    block_m=2, num_warps=4, bwd_block_m=2, fwd_programs=4, fwd_stages=3, fwd_one_pass=True
  )
  other = dict(
    block_m=1,
    num_warps=8,
    bwd_block_m=4,
    bwd_num_warps=4,
    bwd_programs=7,
    fwd_programs=3,
    bwd_prefetch=True,
    fwd_stages=4,
    bwd_stages=3,
    fwd_one_pass=False,
    fwd_streaming=True,
  )
  assert set(other) == {f.name for f in dataclasses.fields(base)}
  key = lambda x: (x.kernel.__name__, x.grid, sorted(x.meta.items()))

  def launches(config):
    found, _, _ = _launches(args, config)
    with triton_call.capture() as primal:
      jax.eval_shape(lambda a: OP._fwd_primal(a, config), args)
    keys = [key(x) for x in found]
    # The forwards' (without and with a gradient), the backward's.
    return (key(primal[0]), keys[0]), keys[1:]

  fwd, bwd = launches(base)
  for name, value in other.items():
    new_fwd, new_bwd = launches(dataclasses.replace(base, **{name: value}))
    backward = name in norm_triton.TritonNormConfig.BACKWARD_FIELDS
    assert (new_fwd != fwd, new_bwd != bwd) == (not backward, backward), name


@pytest.mark.parametrize(
  ("d", "dtype", "pipelined"),
  [
    (1000, "bfloat16", False),
    (4096, "bfloat16", False),
    (8192, "bfloat16", True),
    (8192, "float32", False),  # 3 x 2 rows of 32 KiB: over the 128 KiB budget.
    (16384, "bfloat16", False),
  ],
)
def test_heuristic_backward_prefetches_rows_it_does_not_pipeline(d, dtype, pipelined):
  """The backward either pipelines wide rows through shared memory (where three rows of x
  and dy fit) or prefetches the next rows into registers: never neither."""
  config = OP._get_heuristics_config(_record((64, d), -1, dtype, True, True, True, 0.0))
  assert (config.bwd_stages > 1, config.bwd_prefetch) == (pipelined, not pipelined), config


@pytest.mark.host_only
@pytest.mark.parametrize("d", [17, 33, 129])
def test_interpreted_rows_one_past_a_power_of_two(d):
  """Rows of 2**k + 1 elements (the kernel cases' widths all sit well inside their power of
  two): a block narrower than the row would drop its last column, forward and backward, in
  the plain, persistent (register prefetch) and pipelined kernels."""
  x, scale, offset, dy = _inputs((5, d), -1, "float32", True, True, seed=9)
  args = spec.canonicalize(x, scale, offset)
  config = norm_triton.TritonNormConfig(
    block_m=2, num_warps=4, bwd_block_m=2, bwd_num_warps=4, bwd_programs=2
  )
  ref_out, ref_grads = references.high_precision_vjp(
    lambda a, b, c: references.layer_norm(a, b, c, epsilon=1e-6), (x, scale, offset), dy
  )
  variants = (
    {},
    dict(block_m=1, fwd_programs=2, bwd_prefetch=True),
    dict(fwd_programs=2, fwd_stages=3, bwd_stages=3, fwd_one_pass=True),
  )
  for variant in variants:
    run_config = dataclasses.replace(config, **variant)
    with triton_call.interpret():
      out, residuals = OP._fwd(args, run_config)
      grads = OP._bwd(args, run_config, out, residuals, dy)
    assert compare.relative_error(out, ref_out) <= 1e-5, variant
    for name, rg in zip(("x", "scale", "offset"), ref_grads, strict=True):
      assert compare.relative_error(grads[name], rg) <= 1e-5, (variant, name)


@pytest.mark.host_only
def test_interpreted_backward_reads_float32_statistics_of_bfloat16_rows_of_a_large_mean():
  """bfloat16 rows near 100 with unit spread, against the float64 reference of the same
  values: the backward reads the forward's saved mean and 1/std, which must stay float32
  (bfloat16 spaces 0.5 apart at 100: a saved mean off by up to 0.25 shifts every normalized
  value by a quarter of the spread)."""
  rng = np.random.default_rng(12)
  bf16 = jnp.bfloat16
  x = jnp.asarray(100.0 + rng.standard_normal((6, 64)), bf16)
  scale, offset = (jnp.asarray(rng.standard_normal(64), bf16) for _ in range(2))
  dy = jnp.asarray(rng.standard_normal((6, 64)), bf16)
  args = spec.canonicalize(x, scale, offset)
  config = norm_triton.TritonNormConfig(
    block_m=2, num_warps=4, bwd_block_m=2, bwd_num_warps=4, bwd_programs=2
  )
  with triton_call.interpret():
    out, residuals = OP._fwd(args, config)
    grads = OP._bwd(args, config, out, residuals, dy)
  assert [r.dtype for r in residuals] == [jnp.float32, jnp.float32]
  ref_out, ref_grads = references.high_precision_vjp(
    lambda a, b, c: references.layer_norm(a, b, c, epsilon=1e-6), (x, scale, offset), dy
  )
  got = (("output", out), *((n, grads[n]) for n in ("x", "scale", "offset")))
  for (name, value), want in zip(got, (ref_out, *ref_grads), strict=True):
    error = np.abs(np.asarray(value, np.float64) - want).max()
    # A bfloat16 rounding: about 0.4% of the largest value.
    assert error <= 1.5e-2 * np.abs(want).max(), (name, error, np.abs(want).max())


@pytest.mark.host_only
@pytest.mark.parametrize("scale_offset", [-0.5, -2.0])
def test_interpreted_negative_scale_offset_without_a_scale(scale_offset):
  """No scale: the normalized rows are multiplied by 1 + scale_offset, a negative offset too
  (0.5 or -1: halved or sign-flipped), in the plain and persistent forwards and the backward
  (the kernel cases' offsets are all positive)."""
  x, _, offset, dy = _inputs((6, 40), -1, "float32", False, True, seed=10)
  kw = dict(scale_offset=scale_offset)
  args = spec.canonicalize(x, None, offset, **kw)
  config = norm_triton.TritonNormConfig(block_m=2, num_warps=4, bwd_block_m=2, bwd_num_warps=4)
  ref_out, ref_grads = references.high_precision_vjp(
    lambda a, c: references.layer_norm(a, None, c, epsilon=1e-6, **kw), (x, offset), dy
  )
  for fwd in ({}, dict(fwd_programs=2)):
    with triton_call.interpret():
      out, residuals = OP._fwd(args, dataclasses.replace(config, **fwd))
      grads = OP._bwd(args, config, out, residuals, dy)
    assert compare.relative_error(out, ref_out) <= 1e-5, fwd
    for name, rg in zip(("x", "offset"), ref_grads, strict=True):
      assert compare.relative_error(grads[name], rg) <= 1e-5, (fwd, name)


@pytest.mark.parametrize("d", [256, 4096])
def test_rms_norm_candidates_leave_one_pass_statistics_off(d):
  """fwd_one_pass changes only how LayerNorm reduces a row's mean and variance; RMSNorm has
  no mean, so each one-pass RMSNorm candidate would time its twin's forward again. LayerNorm's
  candidates offer both."""
  rms = _record((64, d), -1, "bfloat16", False, True, False, 0.0)
  assert not any(c.fwd_one_pass for c in OP._get_autotuning_configs(rms))
  layer = _record((64, d), -1, "bfloat16", True, True, True, 0.0)
  assert {c.fwd_one_pass for c in OP._get_autotuning_configs(layer)} == {False, True}


@pytest.mark.parametrize(("rows", "bwd_block_m", "programs"), [(6, 2, 3), (7, 2, 4), (1, 1, 1)])
def test_backward_launches_no_more_programs_than_row_blocks(rows, bwd_block_m, programs):
  """A few rows under 264 backward programs (the H200 heuristic's 2 per SM): one program per
  block of bwd_block_m rows and a partial-sums array of that many rows, not hundreds of idle
  programs whose zero partial sums `sum_partials` would read back (264 x D float32)."""
  args = _record((rows, 1000), -1, "bfloat16", True, True, True, 0.0)
  config = norm_triton.TritonNormConfig(
    block_m=2, num_warps=4, bwd_block_m=bwd_block_m, bwd_num_warps=4, bwd_programs=264
  )
  launches, _, _ = _launches(args, config)
  bwd, sums = launches[1:]
  assert bwd.kernel.__name__ == "layer_norm_bwd" and bwd.grid == (programs,)
  assert [s.shape for s in bwd.out_shape[1:]] == [(programs, 1000)] * 2
  assert sums.kernel.__name__ == "sum_partials"


_TABLES = opdb.get("layer_norm").kernel_cases
_DTYPE_PREFIXES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


@pytest.mark.parametrize(
  ("table", "name"), [(table, name) for table, cases in _TABLES.items() for name in cases]
)
def test_kernel_case_names_match_what_the_case_normalizes(table, name):
  """A case's name is the coverage it claims: "axisN" normalizes axis N, "dN" or "wide_N"
  normalizes N columns, "rms" skips the mean, "no_scale" and "bare" drop the scale,
  "offset_1" and "offset_half" set scale_offset, and a dtype prefix is the case's dtype."""
  case = _TABLES[table][name]
  axis = case.axis % len(case.shape)
  for word in name.split("_"):
    if word in _DTYPE_PREFIXES:
      assert case.dtype == _DTYPE_PREFIXES[word], word
    if word.startswith("axis"):
      assert axis == int(word[4:]), word
    if word.startswith("d") and word[1:].isdigit():
      assert case.shape[axis] == int(word[1:]), word
  if name.startswith("wide_"):
    assert case.shape[axis] == int(name.split("_")[1])
  assert ("rms" in name) == (not case.subtract_mean)
  if "no_scale" in name or name.endswith("bare"):
    assert not case.has_scale
  if name.endswith("bare"):
    assert not case.has_offset
  for suffix, value in (("offset_1", 1.0), ("offset_half", 0.5)):
    if suffix in name:
      assert case.scale_offset == value, suffix


@pytest.mark.host_only
@pytest.mark.parametrize(
  ("rows", "bwd_block_m", "runs"),
  [(7, 1, [(0, 3), (3, 5), (5, 7)]), (9, 2, [(0, 4), (4, 8), (8, 9)])],
)
@pytest.mark.parametrize(
  "loop",
  [dict(), dict(bwd_prefetch=True), dict(bwd_stages=3)],
  ids=["plain", "prefetch", "staged"],
)
def test_interpreted_backward_programs_take_contiguous_runs_of_rows(
  monkeypatch, rows, bwd_block_m, runs, loop
):
  """3 backward programs share the row blocks out in contiguous runs that differ by at most
  one block, the first programs taking the extra ones (the module's documented split): each
  program's partial dscale and doffset are the sums over its own run, not one program summing
  every row while the others idle."""
  partials = {}
  sum_partials = norm_triton._sum_partials

  def capture(args, dscale, doffset, programs):
    partials.update(scale=dscale, offset=doffset)
    return sum_partials(args, dscale, doffset, programs)

  monkeypatch.setattr(norm_triton, "_sum_partials", capture)
  x, scale, offset, dy = _inputs((rows, 24), -1, "float32", True, True, seed=13)
  args = spec.canonicalize(x, scale, offset)
  config = norm_triton.TritonNormConfig(
    block_m=2, num_warps=4, bwd_block_m=bwd_block_m, bwd_num_warps=4, bwd_programs=3, **loop
  )
  with triton_call.interpret():
    out, residuals = OP._fwd(args, config)
    OP._bwd(args, config, out, residuals, dy)
  dy64, xhat = np.asarray(dy, np.float64), _normalized64(x)
  want_scale = np.stack([(dy64 * xhat)[a:b].sum(0) for a, b in runs])
  want_offset = np.stack([dy64[a:b].sum(0) for a, b in runs])
  np.testing.assert_allclose(partials["scale"], want_scale, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(partials["offset"], want_offset, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("subtract_mean", [False, True], ids=["rms", "layer"])
def test_heuristic_and_autotuning_configs_have_power_of_two_rows_and_warps(dtype, subtract_mean):
  """Triton only builds `tl.arange(0, BLOCK_M)` over a power of two and only launches a power
  of two of warps (at most 32): every candidate, forward and backward, at every row width up to
  the longest supported, has power-of-two rows per block and warps, or it fails to compile."""
  for d in (1, 16, 40, 100, 256, 500, 512, 1000, 2048, 4096, 8192, 16384, norm_triton._MAX_D):
    args = _record((4, d), -1, dtype, subtract_mean, True, True, 0.0)
    for c in {OP._get_heuristics_config(args), *OP._get_autotuning_configs(args)}:
      for field in ("block_m", "bwd_block_m", "num_warps", "bwd_num_warps"):
        value = getattr(c, field)
        assert value > 0 and value & (value - 1) == 0, (d, field, c)
      assert max(c.num_warps, c.bwd_num_warps) <= 32, (d, c)
