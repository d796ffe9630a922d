"""Triton ragged_dot: compile for sm_80/sm_90, the row-tile schedule and wrapper
logic, interpreted numerics on CPU, compiled numerics on an NVIDIA GPU.

Not covered on CPU: timings and the compiled kernels' numerics (the GPU test
below and ci/gpu/triton_mm_norm.py cover them on the H200).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from suites import opdb
from suites.kernels import interpreted
from suites.kernels.gpu_limits import SMEM_LIMIT
from suites.opdb import kernel_cases
from tokamax._src import device, triton_call
from tokamax._src.ops.ragged_dot import api, spec
from tokamax._src.ops.ragged_dot import triton as rd_triton
from tokamax_harness import compare, references

# The summary counts these under the op and implementation they check.
pytestmark = pytest.mark.op("ragged_dot", "triton")

OP = rd_triton.TritonRaggedDot()
SMALL = rd_triton.TritonRaggedDotConfig(
  block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2
)

# `kernel_cases.RaggedDotKernelCase`s (in the op database).
CASES = list(opdb.get("ragged_dot").kernel_cases["triton"].values())
GPU_CASES = [*CASES, *opdb.get("ragged_dot").kernel_cases["triton:gpu"].values()]


def _rhs_shape(layout, m, k, n, g):
  return {spec.DEFAULT: (g, k, n), spec.RHS_TRANSPOSED: (g, n, k)}.get(layout, (m, n))


def _inputs(layout, m, k, n, g, dtype, offset, seed=0):
  rng = np.random.default_rng(seed)
  g_all = g + (offset or 0) + (1 if offset else 0)
  # Uneven sizes with empty groups; the last rows belong to no group.
  sizes = spec.generate_ragged_dot_group_sizes(
    m - 7, g_all, seed=seed, alpha=0.7, empty_fraction=0.3
  )
  lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
  rhs_groups = g_all if layout == spec.RAGGED_CONTRACTING else g
  rhs = jnp.asarray(rng.standard_normal(_rhs_shape(layout, m, k, n, rhs_groups)), dtype)
  group_offset = None if offset is None else jnp.array([offset], jnp.int32)
  return lhs, rhs, jnp.asarray(sizes), group_offset


def _case_inputs(case, seed=0):
  return _inputs(
    case.layout, case.m, case.k, case.n, case.groups, case.dtype, case.group_offset, seed
  )


def _record(case, **kw):
  lhs, rhs, sizes, group_offset = _case_inputs(case)
  layout = case.layout
  return spec.canonicalize(
    lhs, rhs, sizes, spec.dimension_numbers(layout), group_offset=group_offset, **kw
  )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_m", [16, 64])
def test_row_schedule_covers_each_row_once_within_its_group(seed, block_m):
  rng = np.random.default_rng(seed)
  m, g_all = int(rng.integers(1, 300)), int(rng.integers(1, 9))
  sizes = spec.generate_ragged_dot_group_sizes(
    int(rng.integers(0, m + 1)), g_all, seed=seed, empty_fraction=0.3
  )
  offset = int(rng.integers(0, g_all)) if seed % 2 else None
  _check_row_schedule(m, sizes, offset, block_m)


@pytest.mark.parametrize("block_m", [16, 64])
def test_row_schedule_with_every_segment_ending_in_a_partial_tile(block_m):
  """Rows before the local groups, each local group and the rows after them all end in a
  partial tile whose rows add up to less than one tile: the most tiles there can be
  (M // block_m + G + 2)."""
  # Group 0 (before the offset): 17 rows; local groups of 18 and 1 rows; 2 rows after.
  sizes = np.array([17, 18, 1], np.int32)
  m = 38
  assert rd_triton.max_tiles(m, 2, block_m) == -(-17 // block_m) + -(-18 // block_m) + 2
  _check_row_schedule(m, sizes, 1, block_m)


def _check_row_schedule(m, sizes, offset, block_m):
  g = len(sizes) - (offset or 0)
  lhs, rhs = jnp.ones((m, 8)), jnp.ones((g, 8, 8))
  args = spec.canonicalize(
    lhs, rhs, jnp.asarray(sizes), None, group_offset=None if offset is None else jnp.array([offset])
  )
  group, row0, row1 = np.asarray(rd_triton.row_schedule(args, block_m))
  # Expected group of each row, from the sizes directly.
  expected = np.full(m, -1)
  ends = np.cumsum(sizes)
  for j in range(g):
    lo, hi = (ends[(offset or 0) + j] - sizes[(offset or 0) + j]), ends[(offset or 0) + j]
    expected[lo:hi] = j
  seen = np.zeros(m, int)
  for t in range(group.size):
    if group[t] == -2:
      continue
    assert row0[t] < row1[t] <= m
    rows = np.arange(row0[t], min(row0[t] + block_m, row1[t]))
    seen[rows] += 1
    assert (expected[rows] == group[t]).all()
  assert (seen == 1).all()


@pytest.mark.parametrize("sm", [80, 89, 90])
@pytest.mark.parametrize("layout", spec.LAYOUTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_heuristic_configs_compile_forward_and_backward(sm, layout, dtype):
  args = _record(kernel_cases.RaggedDotKernelCase(layout, 512, 256, 512, 4, dtype, None))
  config = OP._get_heuristics_config(args)
  with triton_call.capture() as launches:
    OP._fwd(args, config)
    OP._bwd(args, config, None, None, jnp.ones(args.out_shape, args.out_dtype))
  assert len(launches) == 3
  names = {launch.kernel.__name__ for launch in launches}
  assert names == {"ragged_rows", "ragged_contracting"}
  for launch in launches:
    compiled = triton_call.compile_launch(launch, sm)
    assert compiled.metadata.shared <= SMEM_LIMIT[sm], (launch.meta, compiled.metadata.shared)


@pytest.mark.parametrize(
  "layout, m, g, dtype, expected",
  [
    # 256 rows a group: 128-row tiles; 16-bit operands take the 128x256 tiles (3 stages).
    (spec.DEFAULT, 1024, 4, "bfloat16", (128, 256, 64, 8, 3)),
    # float32 steps 32 of K and keeps 128-wide tiles.
    (spec.DEFAULT, 1024, 4, "float32", (128, 128, 32, 8, 3)),
    # 64 rows a group: 64-row tiles, then 128 wide, 4 warps, 4 stages.
    (spec.RHS_TRANSPOSED, 1024, 16, "bfloat16", (64, 128, 64, 4, 4)),
    # The contracting layout steps over a group's rows by the K step of the dtype (32 for
    # float32), with 128x128 output tiles (K and N both at least 128).
    (spec.RAGGED_CONTRACTING, 1024, 4, "float32", (32, 128, 128, 8, 3)),
    (spec.RAGGED_CONTRACTING, 1024, 4, "bfloat16", (64, 128, 128, 8, 3)),
  ],
)
def test_heuristic_tiles_by_hand(layout, m, g, dtype, expected):
  args = _record(kernel_cases.RaggedDotKernelCase(layout, m, 256, 512, g, dtype, None))
  config = OP._get_heuristics_config(args)
  fields = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
  assert tuple(getattr(config, f) for f in fields) == expected


def test_autotuning_configs_compile_for_sm90():
  args = _record(kernel_cases.RaggedDotKernelCase(spec.DEFAULT, 512, 256, 512, 4, "bfloat16", None))
  configs = OP._get_autotuning_configs(args)
  assert OP._get_heuristics_config(args) in configs and len(configs) > 4
  for config in configs:
    with triton_call.capture() as launches:
      OP._fwd(args, config)
    assert triton_call.compile_launch(launches[0], 90).metadata.shared <= SMEM_LIMIT[90]


def test_backward_launches_take_their_own_layouts_heuristic_tiles():
  """Whatever tiles the forward pass ran with, each gradient kernel takes its own layout's
  heuristic tiles: for bfloat16 M=512, K=256, N=512, G=4 (default layout), dlhs is an
  rhs_transposed product [512, 256] contracting 512 (128x256 tiles, 64 deep) and drhs a
  ragged_contracting one (128x128 output tiles over 64-row steps)."""
  args = _record(kernel_cases.RaggedDotKernelCase(spec.DEFAULT, 512, 256, 512, 4, "bfloat16", None))
  with triton_call.capture() as launches:
    OP._bwd(args, SMALL, None, None, jnp.ones(args.out_shape, jnp.bfloat16))
  tiles = [tuple(launch.meta[f] for f in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) for launch in launches]
  assert tiles == [(128, 256, 64), (64, 128, 128)]


def test_heuristic_tiles_follow_the_input_dtype_not_the_output():
  """bfloat16 inputs with a float32 preferred_element_type take bfloat16's tiles (the dot's
  operands are what fill shared memory): 128x256, 64 deep, 3 stages."""
  case = kernel_cases.RaggedDotKernelCase(spec.DEFAULT, 512, 256, 256, 4, "bfloat16", None)
  config = OP._get_heuristics_config(_record(case, preferred_element_type=jnp.float32))
  fields = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
  assert tuple(getattr(config, f) for f in fields) == (128, 256, 64, 8, 3)


def test_float32_autotuning_candidates_step_32_of_k():
  """float32 candidates step 32 of K, as the heuristic's float32 tiles do; 16-bit ones 32
  or 64."""
  shape = (spec.DEFAULT, 512, 256, 512, 4)
  f32 = OP._get_autotuning_configs(
    _record(kernel_cases.RaggedDotKernelCase(*shape, "float32", None))
  )
  assert {c.block_k for c in f32} == {32}
  bf16 = _record(kernel_cases.RaggedDotKernelCase(*shape, "bfloat16", None))
  bf16_configs = OP._get_autotuning_configs(bf16)
  assert {c.block_k for c in bf16_configs} == {32, 64}
  # Both pipeline depths are candidates, also for tiles that fit four stages.
  for stages in (3, 4):
    assert rd_triton.TritonRaggedDotConfig(64, 64, 32, 4, stages) in bf16_configs, stages


def test_float32_candidates_include_the_largest_tile_that_fits_sm90(monkeypatch):
  """Built for sm_90 (227 KiB a block), float32's largest tile, 128x256 stepping 32 of K,
  holds four stages of (128 + 256) x 32 x 4 bytes = 48 KiB: it is a candidate at four stages,
  and the compiler agrees that it fits (stage bytes counted with float32's 4-byte elements)."""
  monkeypatch.setattr(device, "target_compute_capability", lambda: (9, 0))
  case = kernel_cases.RaggedDotKernelCase(spec.DEFAULT, 512, 256, 512, 4, "float32", None)
  args = _record(case)
  largest = rd_triton.TritonRaggedDotConfig(128, 256, 32, num_warps=8, num_stages=4)
  assert largest in OP._get_autotuning_configs(args)
  with triton_call.capture() as launches:
    OP._fwd(args, largest)
  assert triton_call.compile_launch(launches[0], 90).metadata.shared <= SMEM_LIMIT[90]


def test_autotuning_candidates_warps_by_tile_size():
  """Tiles of 128x128 and larger take 8 warps, smaller ones 4; 64x256 is never a candidate."""
  args = _record(kernel_cases.RaggedDotKernelCase(spec.DEFAULT, 512, 256, 512, 4, "bfloat16", None))
  warps = {(64, 64): 4, (64, 128): 4, (128, 64): 4, (128, 128): 8, (128, 256): 8}
  configs = OP._get_autotuning_configs(args) - {OP._get_heuristics_config(args)}
  assert {(c.block_m, c.block_n) for c in configs} == set(warps)
  for c in configs:
    assert c.num_warps == warps[c.block_m, c.block_n], c


@pytest.mark.parametrize("case", CASES)
def test_wrapper_shapes_dtypes_and_gradient_layouts(case):
  args = _record(case, preferred_element_type=jnp.float32)
  with triton_call.capture() as launches:
    out, _ = OP._fwd(args, OP._get_heuristics_config(args))
    grads = OP._bwd(args, None, out, None, jnp.ones(args.out_shape, jnp.float32))
  assert out.shape == args.out_shape and out.dtype == jnp.float32
  for name in ("lhs", "rhs"):
    value = getattr(args, name)
    assert grads[name].shape == value.shape and grads[name].dtype == value.dtype
  dlhs, drhs = rd_triton.gradient_records(args, out)
  assert {dlhs.layout, drhs.layout, args.layout} == set(spec.LAYOUTS)
  assert len(launches) == 3
  # The gradient kernels take the float32 cotangent in the inputs' dtype (tl.dot of one dtype).
  for launch in launches:
    floats = [a for a in launch.args if jnp.issubdtype(getattr(a, "dtype", int), jnp.floating)]
    assert len(floats) == 2 and all(a.dtype == args.lhs.dtype for a in floats), launch


@pytest.mark.parametrize(
  ("precision", "expected"),
  [(jax.lax.Precision.HIGHEST, "ieee"), (jax.lax.Precision.DEFAULT, "tf32")],
  ids=["highest", "default"],
)
def test_precision_sets_the_input_precision_of_every_launch(precision, expected):
  """float32 inputs: the caller's precision picks tl.dot's input precision, forward and
  both gradients."""
  lhs, rhs, sizes, _ = _inputs(spec.DEFAULT, 64, 32, 16, 3, "float32", None)
  args = spec.canonicalize(lhs, rhs, sizes, None, precision)
  with triton_call.capture() as launches:
    out, _ = OP._fwd(args, OP._get_heuristics_config(args))
    OP._bwd(args, None, out, None, jnp.ones(args.out_shape, jnp.float32))
  assert len(launches) == 3
  assert [launch.meta["INPUT_PRECISION"] for launch in launches] == [expected] * 3


def test_unsupported_reasons():
  args = _record(CASES[0])
  assert OP._unsupported_reason(args) is None
  f64 = dataclasses.replace(args, lhs=np.ones(args.lhs.shape), rhs=np.ones(args.rhs.shape))
  assert "float64" in OP._unsupported_reason(f64)
  empty = spec.canonicalize(jnp.ones((0, 8)), jnp.ones((2, 8, 4)), jnp.zeros(2, jnp.int32))
  assert "empty" in OP._unsupported_reason(empty)
  int8 = dataclasses.replace(args, out_dtype=np.dtype(np.int8))
  assert "preferred_element_type" in OP._unsupported_reason(int8)
  # Each of the three float dtypes, as inputs (with the same output) and as the output of
  # float32 inputs.
  for dtype in map(jnp.dtype, ("float32", "bfloat16", "float16")):
    same = dataclasses.replace(
      args, lhs=args.lhs.astype(dtype), rhs=args.rhs.astype(dtype), out_dtype=dtype
    )
    assert OP._unsupported_reason(same) is None, dtype
    assert OP._unsupported_reason(dataclasses.replace(args, out_dtype=dtype)) is None, dtype


def test_unsupported_reasons_no_groups_and_32_bit_offsets():
  no_groups = spec.canonicalize(jnp.ones((8, 8)), jnp.ones((0, 8, 4)), jnp.zeros(0, jnp.int32))
  reason = OP._unsupported_reason(no_groups)
  assert reason is not None and "G=0" in reason

  def record(k, n):
    shapes = [
      jax.ShapeDtypeStruct(s, d)
      for s, d in (((64, k), jnp.bfloat16), ((2, k, n), jnp.bfloat16), ((2,), jnp.int32))
    ]
    return jax.eval_shape(spec.canonicalize, *shapes)

  # A group's rhs of K * N = 2**16 * 2**15 = 2**31 elements passes 32-bit offsets.
  reason = OP._unsupported_reason(record(1 << 16, 1 << 15))
  assert reason is not None and "2**31" in reason
  assert OP._unsupported_reason(record(1 << 16, (1 << 15) - 64)) is None


@pytest.mark.requires("cpu")
def test_cpu_names_triton_unavailable():
  lhs, rhs, sizes, _ = _inputs(spec.DEFAULT, 16, 8, 8, 2, "float32", None)
  with pytest.raises(NotImplementedError, match="Triton"):
    api.ragged_dot(lhs, rhs, sizes, implementation="triton")


def _reference(layout, lhs, rhs, sizes, group_offset, g):
  return references.ragged_dot_general(lhs, rhs, sizes, layout, group_offset, num_groups=g)


def _interpreted_errors(case) -> dict:
  """Runs the kernels in Triton's interpreter."""
  layout, dtype = case.layout, case.dtype
  lhs, rhs, sizes, group_offset = _case_inputs(case)
  args = spec.canonicalize(
    lhs,
    rhs,
    sizes,
    spec.dimension_numbers(layout),
    jax.lax.Precision.HIGHEST,
    group_offset=group_offset,
  )
  dout = jnp.asarray(np.random.default_rng(5).standard_normal(args.out_shape), dtype)
  with triton_call.interpret():
    out = rd_triton.ragged_dot(args, SMALL)
    grads = [rd_triton.ragged_dot(r, SMALL) for r in rd_triton.gradient_records(args, dout)]
  ref_out, ref_grads = references.high_precision_vjp(
    lambda a, b, layout=layout, sizes=sizes, go=group_offset, g=args.num_groups: _reference(
      layout, a, b, sizes, go, g
    ),
    (lhs, rhs),
    dout,
  )
  errs = {
    "out": compare.relative_error(out, ref_out),
    "lhs": compare.relative_error(grads[0], ref_grads[0]),
  }
  errs["rhs"] = compare.relative_error(grads[1], ref_grads[1])
  return {"case": repr(case), "dtype": dtype, "errors": errs}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.host_only
def test_interpreted_kernels_match_float64_reference(case):
  interpreted.assert_errors_within_bound(_interpreted_errors(case))


def _assert_interpreted_vjp_matches(layout, m, k, n, sizes, seed):
  """The interpreted kernels' output and both gradients (random operands and cotangent)
  against the float64 reference."""
  g = sizes.shape[0]
  rng = np.random.default_rng(seed)
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal(_rhs_shape(layout, m, k, n, g)), jnp.float32)
  args = spec.canonicalize(
    lhs, rhs, sizes, spec.dimension_numbers(layout), jax.lax.Precision.HIGHEST
  )
  dout = jnp.asarray(rng.standard_normal(args.out_shape), jnp.float32)
  with triton_call.interpret():
    out = rd_triton.ragged_dot(args, SMALL)
    grads = [rd_triton.ragged_dot(r, SMALL) for r in rd_triton.gradient_records(args, dout)]
  ref_out, ref_grads = references.high_precision_vjp(
    lambda a, b: _reference(layout, a, b, sizes, None, g), (lhs, rhs), dout
  )
  for name, x, r in zip(("out", "lhs", "rhs"), (out, *grads), (ref_out, *ref_grads), strict=True):
    assert compare.relative_error(x, r) < 1e-5, name


@pytest.mark.parametrize("layout", spec.LAYOUTS)
@pytest.mark.host_only
def test_interpreted_groups_of_one_row_past_a_block(layout):
  """Groups of 1, 17 and 33 rows (one row past a multiple of block_m = 16), an empty one and
  one of exactly 16 rows: each group's last row block holds one row, which the grouped rows
  and the contraction over a group's rows (ragged_contracting, and the default layout's rhs
  gradient) must still take."""
  sizes = jnp.array([1, 17, 0, 16, 33], jnp.int32)  # 67 rows; the last 3 are in no group.
  _assert_interpreted_vjp_matches(layout, 70, 24, 40, sizes, seed=11)


@pytest.mark.parametrize("layout", spec.LAYOUTS)
@pytest.mark.host_only
def test_interpreted_tile_counts_one_past_and_at_a_multiple_of_the_block(layout):
  """K = 33 (one past two 16-wide tiles) and N = 32 (exactly two), with eight groups of 1
  and 17 rows that take 12 of the launch's 14 row tiles: each kernel's own count of K and N
  tiles (which maps a program to its tile) must be the wrapper's grid's ceil(dim / 16), or
  programs land on the wrong tiles and the last ones are never computed."""
  sizes = jnp.array([1, 17] * 4, jnp.int32)
  assert rd_triton.max_tiles(72, sizes.shape[0], SMALL.block_m) == 14
  _assert_interpreted_vjp_matches(layout, 72, 33, 32, sizes, seed=13)


@pytest.mark.host_only
def test_interpreted_contracting_ignores_rows_outside_every_group():
  """ragged_contracting sums each group's own rows: nan rows after the last group (which the
  last group's final 16-row block overlaps) reach neither operand of its dot."""
  m, k, n = 40, 24, 20
  sizes = np.array([5, 0, 18, 9], np.int32)  # 32 rows; rows 32..39 are in no group.
  rng = np.random.default_rng(12)
  lhs, rhs = rng.standard_normal((m, k)), rng.standard_normal((m, n))
  lhs[32:], rhs[32:] = np.nan, np.nan
  args = spec.canonicalize(
    jnp.asarray(lhs, jnp.float32),
    jnp.asarray(rhs, jnp.float32),
    jnp.asarray(sizes),
    spec.dimension_numbers(spec.RAGGED_CONTRACTING),
    jax.lax.Precision.HIGHEST,
  )
  with triton_call.interpret():
    out = np.asarray(rd_triton.ragged_dot(args, SMALL), np.float64)
  lhs, rhs = lhs.astype(np.float32).astype(np.float64), rhs.astype(np.float32).astype(np.float64)
  ends = np.cumsum(sizes)
  expected = np.stack([lhs[e - s : e].T @ rhs[e - s : e] for s, e in zip(sizes, ends, strict=True)])
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.requires("triton")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_matches_reference_with_gradients(case, dtype):
  if (reason := triton_call.unavailable_reason()) is not None:
    pytest.skip(reason)  # E.g. jax-triton is not installed.
  layout = case.layout
  lhs, rhs, sizes, group_offset = _inputs(
    layout, case.m, case.k, case.n, case.groups, dtype, case.group_offset, seed=1
  )
  dims = spec.dimension_numbers(layout)

  def fn(a, b):
    return api.ragged_dot_general(
      a,
      b,
      sizes,
      dims,
      jax.lax.Precision.HIGHEST,
      group_offset=group_offset,
      implementation="triton",
    )

  out, vjp = jax.vjp(jax.jit(fn), lhs, rhs)
  dout = jnp.asarray(np.random.default_rng(2).standard_normal(out.shape), out.dtype)
  grads = vjp(dout)
  num_groups = sizes.shape[0] if layout == spec.RAGGED_CONTRACTING else rhs.shape[0]
  ref_out, ref_grads = references.high_precision_vjp(
    lambda a, b: _reference(layout, a, b, sizes, group_offset, num_groups), (lhs, rhs), dout
  )
  limit = {"float32": 1e-5, "bfloat16": 5e-3}[dtype]
  assert compare.relative_error(out, ref_out) <= limit
  for name, gr, rg in zip(("lhs", "rhs"), grads, ref_grads, strict=True):
    assert compare.relative_error(gr, rg) <= limit, name


@pytest.mark.parametrize(
  "layout, m, k, n, g, expected",
  [
    # Exactly 128 rows a group take 128-row tiles, and N = 256 the 128x256 tile.
    (spec.DEFAULT, 512, 256, 256, 4, (128, 256, 64, 8, 3)),
    # One row short: 64-row tiles, so 128 wide (256-wide tiles need 128 rows), 4 stages.
    (spec.DEFAULT, 511, 256, 256, 4, (64, 128, 64, 4, 4)),
    # N one short of 256: 128 wide; N = 128 stays 128 wide, one short of it 64.
    (spec.RHS_TRANSPOSED, 512, 256, 255, 4, (128, 128, 64, 8, 4)),
    (spec.DEFAULT, 512, 256, 128, 4, (128, 128, 64, 8, 4)),
    (spec.RHS_TRANSPOSED, 512, 256, 127, 4, (128, 64, 64, 8, 4)),
    # The contracting layout: K = N = 128 take 128x128 output tiles, one short 64.
    (spec.RAGGED_CONTRACTING, 512, 128, 128, 4, (64, 128, 128, 8, 3)),
    (spec.RAGGED_CONTRACTING, 512, 127, 127, 4, (64, 64, 64, 8, 3)),
  ],
)
def test_heuristic_tiles_at_their_boundaries(layout, m, k, n, g, expected):
  """bfloat16 shapes at the edges of the heuristic's choices (the by-hand cases above sit
  well inside them)."""
  args = _record(kernel_cases.RaggedDotKernelCase(layout, m, k, n, g, "bfloat16", None))
  config = OP._get_heuristics_config(args)
  fields = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
  assert tuple(getattr(config, f) for f in fields) == expected
