"""Mosaic GPU ragged_dot on CPU: the kernels in the Pallas GPU interpreter (with
race detection) on small shapes, and CUDA lowering of every tuning config.

Not covered here (needs the H200: suites/kernels/test_gpu_compiled.py and
`python -m bench.run`): the compiled kernels' numerics, wgmma/TMA hardware
behaviour, timings. The interpreter runs
the warp-specialised pipeline's barriers and TMA copies, but not register
allocation (`setmaxnreg`) or the real shared-memory limit.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental.pallas import mosaic_gpu as plgpu

from suites import opdb
from tokamax._src import device
from tokamax._src.ops import kernel_ops, mosaic_gemm
from tokamax._src.ops.ragged_dot import api, mosaic, mosaic_drhs, mosaic_fwd, spec
from tokamax_harness import compare, references

# The summary counts these under the op and implementation they check.
pytestmark = pytest.mark.op("ragged_dot", "mosaic")

SMALL = mosaic.MosaicRaggedDotConfig(block_n=64, num_stages=2, epi_n=64)


def _rhs_shape(layout, m, k, n, g):
  return {spec.DEFAULT: (g, k, n), spec.RHS_TRANSPOSED: (g, n, k), spec.RAGGED_CONTRACTING: (m, n)}[
    layout
  ]


# `kernel_cases.RaggedDotKernelCase`s (in the op database).
CASES = opdb.get("ragged_dot").kernel_cases["mosaic"]


@pytest.mark.parametrize(
  "case", list(CASES.values()), ids=lambda case: f"{case.layout}-{case.m}-{case.group_offset}"
)
@pytest.mark.host_only
def test_interpret_matches_reference_with_gradients(case, capfd):
  layout, m, k, n, g, offset = case.layout, case.m, case.k, case.n, case.groups, case.group_offset
  rng = np.random.default_rng(m)
  # Uneven random sizes with empty groups; rows past their sum stay outside every group.
  sizes = spec.generate_ragged_dot_group_sizes(m - 9, g + 1, seed=m, alpha=0.5, empty_fraction=0.25)
  sizes = jnp.asarray(sizes)
  group_offset = jnp.array([1], jnp.int32) if offset else None
  rhs_groups = g if offset else g + 1
  dtype = jnp.dtype(case.dtype)
  lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
  rhs = jnp.asarray(rng.standard_normal(_rhs_shape(layout, m, k, n, rhs_groups)), dtype)
  impl = mosaic.MosaicRaggedDot(interpret=True, config=SMALL)
  dims = spec.dimension_numbers(layout)

  def fn(a, b):
    return api.ragged_dot_general(a, b, sizes, dims, group_offset=group_offset, implementation=impl)

  out, vjp = jax.vjp(fn, lhs, rhs)
  ct = jnp.asarray(rng.standard_normal(out.shape), dtype)
  dlhs, drhs = vjp(ct)
  num_groups = (g + 1) if layout == spec.RAGGED_CONTRACTING else rhs_groups
  ref, (ref_dlhs, ref_drhs) = references.high_precision_vjp(
    lambda a, b: references.ragged_dot_general(
      a, b, sizes, layout, group_offset=group_offset, num_groups=num_groups
    ),
    (lhs, rhs),
    ct,
  )
  assert not interpret_pallas_call.get_races().races_found
  assert "RACE DETECTED" not in capfd.readouterr().out  # Any of the three kernels.
  for name, x, r in (("out", out, ref), ("dlhs", dlhs, ref_dlhs), ("drhs", drhs, ref_drhs)):
    assert x.shape == r.shape, name
    assert compare.relative_error(x, r) < 5e-3, name


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.host_only
def test_interpret_two_cta_clusters(transpose, capfd):
  m, k, n, g = 400, 256, 128, 4
  rng = np.random.default_rng(2)
  sizes = jnp.array([170, 0, 141, 60], jnp.int32)
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((g, n, k) if transpose else (g, k, n)), jnp.bfloat16)
  layout = spec.RHS_TRANSPOSED if transpose else spec.DEFAULT
  config = mosaic.MosaicRaggedDotConfig(block_n=64, num_stages=2, epi_n=64, cluster=2)
  impl = mosaic.MosaicRaggedDot(interpret=True, config=config)
  out = api.ragged_dot_general(
    lhs,
    rhs,
    sizes,
    spec.dimension_numbers(layout),
    preferred_element_type=jnp.float32,
    implementation=impl,
  )
  ref = references.high_precision(references.ragged_dot_general)(lhs, rhs, sizes, layout)
  assert "RACE DETECTED" not in capfd.readouterr().out
  assert compare.relative_error(out, ref) < 1e-5


@pytest.mark.host_only
def test_interpret_epilogue_stores_every_column_chunk(capfd):
  """block_n=128 stored in two epi_n=64 chunks: each chunk takes its own accumulator columns."""
  m, k, n = 72, 128, 128
  rng = np.random.default_rng(6)
  sizes = jnp.array([30, 0, 35], jnp.int32)  # 7 rows after the last group.
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((3, k, n)), jnp.bfloat16)
  config = mosaic.MosaicRaggedDotConfig(block_n=128, num_stages=2, epi_n=64)
  impl = mosaic.MosaicRaggedDot(interpret=True, config=config)
  out = api.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32, implementation=impl)
  ref = references.high_precision(references.ragged_dot_general)(lhs, rhs, sizes, spec.DEFAULT)
  assert "RACE DETECTED" not in capfd.readouterr().out
  assert compare.relative_error(out, ref) < 1e-5
  assert np.all(np.asarray(out)[65:] == 0)


@pytest.mark.host_only
def test_interpret_epilogue_chunks_of_every_n_tile(capfd):
  """Two N tiles of block_n=128, each stored in two epi_n=64 chunks: the chunks of the second
  tile go to its own columns 128..255 (a tile's place counted in block_n, not epi_n)."""
  m, k, n = 72, 128, 256
  rng = np.random.default_rng(9)
  sizes = jnp.array([20, 33], jnp.int32)  # 19 rows after the last group.
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((2, k, n)), jnp.bfloat16)
  config = mosaic.MosaicRaggedDotConfig(block_n=128, num_stages=2, epi_n=64)
  impl = mosaic.MosaicRaggedDot(interpret=True, config=config)
  out = api.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32, implementation=impl)
  ref = references.high_precision(references.ragged_dot_general)(lhs, rhs, sizes, spec.DEFAULT)
  assert "RACE DETECTED" not in capfd.readouterr().out
  for cols in (slice(0, 128), slice(128, 256)):
    assert compare.relative_error(out[:, cols], ref[:, cols]) < 1e-5, cols
  assert np.all(np.asarray(out)[53:] == 0)


@pytest.mark.host_only
def test_interpret_gradients_take_their_own_configs_not_the_forwards(capfd):
  """A config given for the forward (block_n=256 over N=256) does not serve the dlhs kernel,
  whose output has K=128 columns: the gradients run with their own (heuristic) configs."""
  m, k, n = 128, 128, 256
  rng = np.random.default_rng(4)
  sizes = jnp.array([50, 61], jnp.int32)  # 17 rows after the last group.
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((2, k, n)), jnp.bfloat16)
  config = mosaic.MosaicRaggedDotConfig(block_n=256, num_stages=2, epi_n=128)
  impl = mosaic.MosaicRaggedDot(interpret=True, config=config)
  out, vjp = jax.vjp(lambda a, b: api.ragged_dot(a, b, sizes, implementation=impl), lhs, rhs)
  ct = jnp.asarray(rng.standard_normal(out.shape), jnp.bfloat16)
  dlhs, drhs = vjp(ct)
  ref, (ref_dlhs, ref_drhs) = references.high_precision_vjp(
    lambda a, b: references.ragged_dot_general(a, b, sizes, spec.DEFAULT), (lhs, rhs), ct
  )
  assert "RACE DETECTED" not in capfd.readouterr().out
  for name, x, r in (("out", out, ref), ("dlhs", dlhs, ref_dlhs), ("drhs", drhs, ref_drhs)):
    assert x.shape == r.shape, name
    assert compare.relative_error(x, r) < 5e-3, name


@pytest.mark.host_only
def test_interpret_preferred_element_type():
  m, k, n, g = 64, 128, 64, 2
  rng = np.random.default_rng(1)
  sizes = jnp.array([40, 17], jnp.int32)
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float16)
  rhs = jnp.asarray(rng.standard_normal((g, k, n)), jnp.float16)
  impl = mosaic.MosaicRaggedDot(interpret=True, config=SMALL)
  out = api.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32, implementation=impl)
  assert out.dtype == jnp.float32
  ref = references.high_precision(references.ragged_dot_general)(lhs, rhs, sizes, spec.DEFAULT)
  assert compare.relative_error(out, ref) < 1e-5  # float32 output: only accumulation-order error.
  assert np.all(np.asarray(out)[57:] == 0)


@pytest.mark.host_only
def test_interpret_gradients_of_a_float32_output(capfd):
  """bfloat16 inputs, float32 output: the float32 cotangent goes to the gradient kernels in
  bfloat16 (their input dtype), the gradients come back in bfloat16."""
  m, k, n = 128, 128, 128
  rng = np.random.default_rng(3)
  sizes = jnp.array([70, 45], jnp.int32)  # 13 rows after the last group.
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((2, k, n)), jnp.bfloat16)
  impl = mosaic.MosaicRaggedDot(interpret=True, config=SMALL)

  def fn(a, b):
    return api.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32, implementation=impl)

  out, vjp = jax.vjp(fn, lhs, rhs)
  ct = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
  dlhs, drhs = vjp(ct)
  ref, (ref_dlhs, ref_drhs) = references.high_precision_vjp(
    lambda a, b: references.ragged_dot_general(a, b, sizes, spec.DEFAULT), (lhs, rhs), ct
  )
  assert "RACE DETECTED" not in capfd.readouterr().out
  assert out.dtype == jnp.float32 and dlhs.dtype == drhs.dtype == jnp.bfloat16
  assert compare.relative_error(out, ref) < 1e-5
  # The cotangent rounded to bfloat16: errors of that order.
  assert compare.relative_error(dlhs, ref_dlhs) < 5e-3
  assert compare.relative_error(drhs, ref_drhs) < 5e-3


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cluster", [1, 2])
def test_work_items_cover_every_row_once(seed, cluster):
  rng = np.random.default_rng(seed)
  block_m = 128
  m, g = 8 * int(rng.integers(block_m // 8, 110)), int(rng.integers(1, 9))
  sizes = spec.generate_ragged_dot_group_sizes(
    int(rng.integers(0, m + 1)), g, seed=seed, empty_fraction=0.3
  )
  before = int(rng.integers(0, 50))
  items, num_items = mosaic_fwd.work_items(
    jnp.asarray(sizes), jnp.int32(before), m, block_m, cluster
  )
  items = np.asarray(items)
  total = items[0, 0]
  assert total <= num_items
  covered = np.full(m, -2)
  for item in items[1 : 1 + total]:
    rhs = item[0]
    for row0, lo, hi in item[1 : 1 + 3 * cluster].reshape(cluster, 3):
      assert 0 <= row0 <= m - block_m and row0 % 8 == 0
      if lo == hi:  # A cluster's missing last block: stores nothing.
        continue
      assert row0 <= lo < hi <= row0 + block_m
      assert np.all(covered[lo:hi] == -2), "row written twice"
      covered[lo:hi] = rhs
  # Expected owner of each row: its group, or -1 outside every group.
  expected = np.full(m, -1)
  ends = np.minimum(before + np.cumsum(sizes), m)
  starts = np.concatenate([[min(before, m)], ends[:-1]])
  for i, (s, e) in enumerate(zip(starts, ends, strict=True)):
    expected[s:e] = i
  np.testing.assert_array_equal(covered, expected)
  # Blocks start at their segment's start (rounded down to 8 rows).
  seg_rows = np.diff(np.concatenate([[0], starts[:1], ends, [m]]))
  blocks = [-(-(int(r) + 7) // block_m) for r in seg_rows]
  assert total <= sum(-(-b // cluster) for b in blocks)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cluster", [1, 2])
def test_work_items_count_exactly_the_blocks_each_segment_needs(seed, cluster):
  """The work list's length, counted by hand: a segment (the rows before the groups, each
  group, the rows after them) of r rows starting at row s takes ceil((r + s mod 8) / block_m)
  blocks, an empty one none, and an item takes `cluster` blocks of one segment. Groups of
  1-9 rows and empty ones at unaligned starts, so that a stray block would show."""
  rng = np.random.default_rng(100 + seed)
  block_m, m = 128, 8 * int(rng.integers(40, 90))
  sizes = rng.integers(1, 10, int(rng.integers(8, 20)))
  sizes[rng.random(sizes.shape[0]) < 0.3] = 0
  # A first group of whole blocks at a start 8 rows past a multiple of 16: one block per
  # 128 rows (a coarser alignment would take one more); then one over several blocks.
  sizes[0], sizes[1] = 128 * int(rng.integers(1, 3)), int(rng.integers(100, 300))
  before = 8 * int(rng.choice([1, 3, 5]))
  items, _ = mosaic_fwd.work_items(
    jnp.asarray(sizes, jnp.int32), jnp.int32(before), m, block_m, cluster
  )
  ends = np.minimum(before + np.cumsum(sizes), m)
  bounds = [0, min(before, m), *ends, m]
  want = 0
  for start, end in itertools.pairwise(bounds):
    if end > start:
      blocks = -(-(end - start + start % 8) // block_m)
      want += -(-blocks // cluster)
  assert int(np.asarray(items)[0, 0]) == want


def _lower_all(layout, m, k, n, g, configs):
  op = mosaic.MosaicRaggedDot()
  shapes = (
    jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
    jax.ShapeDtypeStruct(_rhs_shape(layout, m, k, n, g), jnp.bfloat16),
    jax.ShapeDtypeStruct((g,), jnp.int32),
  )

  def fn(lhs, rhs, sizes):
    record = spec.canonicalize(lhs, rhs, sizes, spec.dimension_numbers(layout))
    return [op._compute(record, c) for c in configs(record)]

  text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("layout", spec.LAYOUTS)
def test_every_autotuning_config_lowers_for_cuda(layout):
  op = mosaic.MosaicRaggedDot()
  seen = []

  def configs(record):
    found = sorted(op._get_autotuning_configs(record), key=dataclasses.astuple)
    seen.extend(found)
    return found

  _lower_all(layout, 1024, 512, 256, 4, configs)
  assert len(seen) >= 4


@pytest.mark.parametrize("layout", spec.LAYOUTS)
@pytest.mark.parametrize(("m", "k", "n", "g"), [(16384, 4096, 2048, 8), (32768, 7168, 2048, 64)])
def test_heuristic_config_lowers_for_target_shapes(layout, m, k, n, g):
  op = mosaic.MosaicRaggedDot()
  _lower_all(layout, m, k, n, g, lambda r: [op._get_heuristics_config(r)])


def test_unsupported_reasons_name_the_feature():
  impl = mosaic.MosaicRaggedDot(interpret=True)
  lhs = jnp.ones((64, 128), jnp.float32)
  rhs = jnp.ones((2, 128, 64), jnp.float32)
  sizes = jnp.array([32, 32], jnp.int32)
  with pytest.raises(NotImplementedError, match="dtype float32"):
    impl(lhs, rhs, sizes)
  with pytest.raises(NotImplementedError, match="N=72"):
    impl(lhs.astype(jnp.bfloat16), jnp.ones((2, 128, 72), jnp.bfloat16), sizes)
  # N=126 divides by no tile width (a multiple of 64): the reason names N, not a tile.
  with pytest.raises(NotImplementedError, match="N=126"):
    impl(lhs.astype(jnp.bfloat16), jnp.ones((2, 128, 126), jnp.bfloat16), sizes)
  # The default choice falls back to another implementation instead.
  out = api.ragged_dot(lhs, rhs, sizes, implementation=[impl, "xla"])
  assert out.shape == (64, 64)


def test_platform_reason():
  assert mosaic.MosaicRaggedDot(interpret=True)._platform_reason("cpu", None) is None
  assert "gpu" in mosaic.MosaicRaggedDot()._platform_reason("cpu", None)


def test_platform_reason_needs_hopper_exactly(monkeypatch):
  """wgmma is sm_90 only: an older or a newer GPU (sm_100) is refused, naming the one found."""
  impl = mosaic.MosaicRaggedDot()
  for cc, supported in (((9, 0), True), ((8, 0), False), ((10, 0), False), ((12, 0), False)):
    monkeypatch.setattr(kernel_ops.device_lib, "compute_capability", lambda _d, cc=cc: cc)
    reason = impl._platform_reason("gpu", None)
    if supported:
      assert reason is None
    else:
      assert reason is not None and f"sm_{cc[0]}{cc[1]}" in reason, reason


def test_interpret_runs_with_race_detection():
  """The interpreter's race detector is what the interpreted tests' race checks rely on."""
  assert mosaic.MosaicRaggedDot().interpret_params is None
  params = mosaic.MosaicRaggedDot(interpret=True).interpret_params
  assert isinstance(params, plgpu.InterpretGPUParams) and params.detect_races


def test_backward_reason_of_a_float32_output():
  """bfloat16 inputs with a float32 output: the gradients take the cotangent in bfloat16
  (as `_bwd` casts it), so they are supported."""
  impl = mosaic.MosaicRaggedDot(interpret=True)
  sizes = jnp.array([64, 64], jnp.int32)
  for layout in spec.LAYOUTS:
    rhs = jnp.ones(_rhs_shape(layout, 128, 256, 256, 2), jnp.bfloat16)
    record = spec.canonicalize(
      jnp.ones((128, 256), jnp.bfloat16),
      rhs,
      sizes,
      spec.dimension_numbers(layout),
      preferred_element_type=jnp.float32,
    )
    assert record.out_dtype == jnp.float32
    assert impl._unsupported_reason(record) is None, layout
    assert impl._bwd_unsupported_reason(record) is None, layout


@pytest.mark.parametrize("layout", spec.LAYOUTS)
def test_config_reason_counts_a_float32_outputs_epilogue(layout):
  """block_n=256 with 4 stages fits shared memory with a bfloat16 output, not with a float32
  one (twice the epilogue buffer): refused there, and the heuristics take fewer stages."""
  m, k, n, g = 1024, 512, 512, 4
  op = mosaic.MosaicRaggedDot()

  def record(out_dtype):
    return _abstract_record(layout, m, k, n, g, out_dtype)

  # Four groups of two N tiles: too few for the heuristics to balance (see `_balance`).
  wide = mosaic.MosaicRaggedDotConfig(block_n=256, num_stages=4, epi_n=128, balance=False)
  assert mosaic._config_reason(record(None), wide) is None
  reason = mosaic._config_reason(record(jnp.float32), wide)
  assert reason is not None and "shared memory" in reason
  assert op._get_heuristics_config(record(None)) == wide
  narrow = op._get_heuristics_config(record(jnp.float32))
  assert narrow.num_stages < 4 and mosaic._config_reason(record(jnp.float32), narrow) is None


def test_group_row_bounds_clip_rows_before_past_m():
  """Rows before the first group beyond M leave every group empty, at row M."""
  sizes = jnp.array([3, 0, 4], jnp.int32)
  starts, ends = spec.group_row_bounds(sizes, jnp.int32(10), 8)
  np.testing.assert_array_equal(starts, [8, 8, 8])
  np.testing.assert_array_equal(ends, [8, 8, 8])
  # Partly past M: group 0 keeps rows 5..7 of its 3 + 4, the rest are cut at M = 8.
  starts, ends = spec.group_row_bounds(jnp.array([2, 4], jnp.int32), jnp.int32(5), 8)
  np.testing.assert_array_equal(starts, [5, 7])
  np.testing.assert_array_equal(ends, [7, 8])


def test_kernel_config_reasons_at_their_limits():
  """The forward and drhs kernels' config checks, at the edge of each documented limit."""

  def fwd(**kw):  # block_m 128, block_k 64; 128 columns keep 4 stages in shared memory.
    return mosaic_fwd.MosaicRaggedDotFwdConfig(**{"block_n": 128, **kw})

  m, n = 256, 256
  # K of exactly num_stages blocks of 64 runs; one block fewer does not.
  assert mosaic_fwd.config_reason(fwd(num_stages=4), m, 256, n, 2, 4) is None
  assert "num_stages" in mosaic_fwd.config_reason(fwd(num_stages=4), m, 192, n, 2, 4)
  # K must be whole blocks of 64, even where it holds num_stages of them (288 = 4.5 blocks).
  assert "block_k" in mosaic_fwd.config_reason(fwd(num_stages=4), m, 288, n, 2, 4)
  # epi_n must divide block_n (stores of whole epilogue tiles).
  assert mosaic_fwd.config_reason(fwd(epi_n=128), m, 512, n, 2, 4) is None
  assert "epi_n" in mosaic_fwd.config_reason(fwd(epi_n=256), m, 512, n, 2, 4)
  assert "epi_n" in mosaic_fwd.config_reason(fwd(epi_n=96), m, 512, n, 2, 4)
  # Clusters of one or two CTAs only.
  assert mosaic_fwd.config_reason(fwd(cluster=2), m, 512, n, 2, 4) is None
  assert "cluster" in mosaic_fwd.config_reason(fwd(cluster=4), m, 512, n, 2, 4)
  # The epilogue buffer holds block_m x epi_n elements of the output dtype: a float32
  # output takes 2 bytes more per element than a bfloat16 one, the same input.
  c = fwd(epi_n=128)
  assert mosaic_fwd.smem_bytes(c, 2, 4) - mosaic_fwd.smem_bytes(c, 2, 2) == 128 * 128 * 2
  drhs = mosaic_drhs.MosaicRaggedDotDrhsConfig
  base = dict(block_n=64, block_m=64, num_stages=2, epi_n=64)
  # A chunk alignment must be a multiple of 8 rows that divides block_m.
  for align in (8, 32, 64):
    assert mosaic_drhs.config_reason(drhs(**base, chunk_align=align), m, 128, 64, 2, 4) is None
  for align in (4, 12, 128):  # 4 divides block_m but is not a multiple of 8 rows.
    reason = mosaic_drhs.config_reason(drhs(**base, chunk_align=align), m, 128, 64, 2, 4)
    assert reason is not None and "chunk_align" in reason
  # No chunk_align: the TMA row tiling, 8 rows, so float32's 32-row chunks are accepted too.
  assert mosaic_drhs.chunk_align(drhs(**base)) == 8
  f32_base = dict(base, block_m=32)
  assert mosaic_drhs.config_reason(drhs(**f32_base), m, 128, 64, 4, 4) is None
  # wgmma operand tiles: a contraction depth of exactly 128 bytes, block_n a multiple of 64 up
  # to 256.
  assert mosaic_fwd.config_reason(fwd(block_n=256, num_stages=2), m, 512, 512, 2, 2) is None
  for bad, what in (({"block_n": 320}, "block_n"), ({"block_k": 32}, "block_k")):
    reason = mosaic_fwd.config_reason(fwd(num_stages=2, epi_n=64, **bad), m, 512, 640, 2, 2)
    assert reason is not None and what in reason and "must" in reason, reason
  # N must be whole block_n tiles.
  assert "N=192" in mosaic_fwd.config_reason(fwd(), m, 512, 192, 2, 4)


def test_backward_reason_names_the_unsupported_gradient():
  """K=192 suits the forward kernel (3 blocks of 64) but not the drhs kernel, whose
  K tiles are 128 rows: the rhs gradient cannot run; K=256 suits all three."""
  impl = mosaic.MosaicRaggedDot(interpret=True)
  sizes = jnp.array([64, 64], jnp.int32)
  for k, supported in ((256, True), (192, False)):
    lhs = jnp.ones((128, k), jnp.bfloat16)
    record = spec.canonicalize(lhs, jnp.ones((2, k, 256), jnp.bfloat16), sizes)
    assert impl._unsupported_reason(record) is None
    reason = impl._bwd_unsupported_reason(record)
    if supported:
      assert reason is None
    else:
      assert reason is not None and reason.startswith("gradient of rhs") and "K=192" in reason


def test_backward_reason_judges_the_gradients_own_configs():
  """K=128, N=256 with a given block_n=256: the forward runs it, and `_bwd` computes the
  gradients with their own configs (the lhs gradient's N is K=128, which block_n=256 does
  not tile), so the gradient is supported; the forward's config would refuse it."""
  record = _abstract_record(spec.DEFAULT, 256, 128, 256, 2)
  wide = mosaic.MosaicRaggedDotConfig(block_n=256, num_stages=2, epi_n=128)
  impl = mosaic.MosaicRaggedDot(config=wide)
  assert impl._unsupported_reason(record) is None
  assert impl._bwd_unsupported_reason(record) is None
  dlhs = mosaic.gradient_records(record, mosaic._abstract_dout(record))["lhs"]
  assert impl._unsupported_reason(dlhs) is not None  # The forward's config would refuse it.


def _interpreted_drhs(lhs, rhs, sizes, config, before=None):
  """The drhs kernel on 2 CTAs in the Mosaic GPU interpreter with race detection, float32 out."""
  return mosaic_drhs.ragged_contracting_dot(
    lhs,
    rhs,
    sizes,
    before,
    out_dtype=jnp.float32,
    config=config,
    num_sms=2,
    interpret=plgpu.InterpretGPUParams(detect_races=True),
  )


@pytest.mark.parametrize("chunk_align", [8, 64])
@pytest.mark.host_only
def test_interpret_drhs_chunks_at_group_starts(chunk_align, capfd):
  """The drhs kernel with group starts off multiples of 64, groups of 1-7 rows, empty groups."""
  m, k, n = 336, 128, 64
  rng = np.random.default_rng(4)
  # Starts (after 5 rows before): 5, 8, 11, 11, 15, 86, 87, 93, 93, 221, 326; 5 rows after.
  sizes = jnp.array([3, 3, 0, 4, 71, 1, 6, 0, 128, 105, 5], jnp.int32)
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  config = mosaic_drhs.MosaicRaggedDotDrhsConfig(
    block_n=64, block_m=64, num_stages=2, epi_n=64, chunk_align=chunk_align
  )
  assert mosaic_drhs.config_reason(config, m, k, n, 2, 4) is None
  out = _interpreted_drhs(lhs, rhs, sizes, config, before=jnp.int32(5))
  # The 5 rows before are a group of the reference that the offset skips.
  ref = references.high_precision(references.ragged_dot_general)(
    lhs,
    rhs,
    jnp.concatenate([jnp.array([5], jnp.int32), sizes]),
    spec.RAGGED_CONTRACTING,
    group_offset=jnp.array([1], jnp.int32),
    num_groups=sizes.shape[0],
  )
  assert not interpret_pallas_call.get_races().races_found
  assert "RACE DETECTED" not in capfd.readouterr().out
  assert out.shape == (sizes.shape[0], k, n)
  assert np.all(np.asarray(out)[[2, 7]] == 0)  # Empty groups.
  assert compare.relative_error(out, ref) < 1e-5


@pytest.mark.host_only
def test_interpret_drhs_masks_chunks_just_past_a_group_only(capfd):
  """Chunks of 64 rows at multiples of 64: a group ending 1 and 6 rows before its last
  chunk's end (those rows belong to the next group and must not count), and groups whose
  chunks hold only their own rows (ends at 256 and 320: no masking needed)."""
  m, k, n = 320, 128, 64
  rng = np.random.default_rng(5)
  sizes = jnp.array([63, 137, 50, 6, 64], jnp.int32)  # Ends 63, 200, 250, 256, 320.
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  config = mosaic_drhs.MosaicRaggedDotDrhsConfig(
    block_n=64, block_m=64, num_stages=2, epi_n=64, chunk_align=64
  )
  out = _interpreted_drhs(lhs, rhs, sizes, config)
  ref = references.high_precision(references.ragged_dot_general)(
    lhs, rhs, sizes, spec.RAGGED_CONTRACTING
  )
  assert not interpret_pallas_call.get_races().races_found
  assert "RACE DETECTED" not in capfd.readouterr().out
  assert compare.relative_error(out, ref) < 1e-5


@pytest.mark.host_only
def test_interpret_drhs_counts_a_chunk_for_one_row_past_whole_chunks(capfd):
  """A group's chunk count rounds up: groups that run one row into a further 64-row chunk
  (65 rows from an aligned start; 64 rows from an unaligned one, whose first chunk starts
  one row earlier) need that chunk for their last row. The last group spans two whole
  chunks."""
  m, k, n = 256, 128, 64
  rng = np.random.default_rng(6)
  sizes = jnp.array([65, 64, 127], jnp.int32)  # Rows [0, 65), [65, 129), [129, 256).
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  config = mosaic_drhs.MosaicRaggedDotDrhsConfig(block_n=64, block_m=64, num_stages=2, epi_n=64)
  assert mosaic_drhs.chunk_align(config) == 8
  out = _interpreted_drhs(lhs, rhs, sizes, config)
  assert "RACE DETECTED" not in capfd.readouterr().out
  # float64 per group: lhs[rows of g].T @ rhs[rows of g].
  a, b = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  want = np.stack([a[s:e].T @ b[s:e] for s, e in ((0, 65), (65, 129), (129, 256))])
  assert out.shape == want.shape
  np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=1e-4)


@pytest.mark.host_only
def test_interpret_drhs_ignores_non_finite_rows_outside_the_group(capfd):
  """A NaN in an rhs row and an inf in an lhs row past the last group (rows 110 and 115;
  groups [0, 61) and [61, 101)) lie in that group's last 64-row chunk [56, 120), but are no
  rows of it: as in XLA's ragged_dot, both groups' products stay finite and equal the float64
  ones. Two 64-column rhs tiles, one masked by each compute warpgroup."""
  m, k, n = 128, 128, 128
  rng = np.random.default_rng(7)
  sizes = jnp.array([61, 40], jnp.int32)
  lhs_np = np.asarray(jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16), np.float32)
  rhs_np = np.asarray(jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16), np.float32)
  lhs_np[115] = np.inf
  rhs_np[110] = np.nan
  lhs, rhs = jnp.asarray(lhs_np, jnp.bfloat16), jnp.asarray(rhs_np, jnp.bfloat16)
  config = mosaic_drhs.MosaicRaggedDotDrhsConfig(block_n=128, block_m=64, num_stages=2, epi_n=64)
  out = _interpreted_drhs(lhs, rhs, sizes, config)
  assert "RACE DETECTED" not in capfd.readouterr().out
  a, b = lhs_np.astype(np.float64), rhs_np.astype(np.float64)
  want = np.stack([a[s:e].T @ b[s:e] for s, e in ((0, 61), (61, 101))])
  np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=1e-4)


@pytest.mark.host_only
def test_interpret_drhs_tiles_of_k_and_n_and_epilogue_chunks(capfd):
  """ragged_contracting through the op: two K tiles (K=256), two N tiles of 128 columns each
  stored in two epi_n=64 chunks, M=100 padded to whole 8-row tiles, an empty group."""
  m, k, n = 100, 256, 256
  rng = np.random.default_rng(12)
  sizes = jnp.array([37, 0, 41, 22], jnp.int32)  # The last group ends at the last row.
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  config = mosaic.MosaicRaggedDotConfig(block_n=128, num_stages=2, epi_n=64)
  impl = mosaic.MosaicRaggedDot(interpret=True, config=config)
  dims = spec.dimension_numbers(spec.RAGGED_CONTRACTING)
  out = api.ragged_dot_general(
    lhs, rhs, sizes, dims, preferred_element_type=jnp.float32, implementation=impl
  )
  assert "RACE DETECTED" not in capfd.readouterr().out
  # float64 per group: lhs[rows of g].T @ rhs[rows of g].
  a, b = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  ends = np.cumsum(np.asarray(sizes))
  want = np.stack(
    [a[e - s : e].T @ b[e - s : e] for s, e in zip(np.asarray(sizes), ends, strict=True)]
  )
  assert out.shape == want.shape
  np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=1e-4)


def _abstract_record(layout, m, k, n, g, out_dtype=None):
  shapes = (
    jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
    jax.ShapeDtypeStruct(_rhs_shape(layout, m, k, n, g), jnp.bfloat16),
  )
  dims = spec.dimension_numbers(layout)
  return jax.eval_shape(
    lambda a, b: spec.canonicalize(
      a, b, jnp.zeros(g, jnp.int32), dims, preferred_element_type=out_dtype
    ),
    *shapes,
  )


@pytest.mark.parametrize("layout", spec.LAYOUTS)
def test_autotuning_tries_clusters_of_the_row_ragged_kernel_only(layout):
  """The forward kernel's configs come with one- and two-CTA clusters; the drhs kernel has no
  clusters, so its configs all take one (none is timed twice)."""
  configs = mosaic.MosaicRaggedDot()._get_autotuning_configs(
    _abstract_record(layout, 1024, 512, 256, 4)
  )
  clusters = {c.cluster for c in configs}
  assert clusters == ({1} if layout == spec.RAGGED_CONTRACTING else {1, 2})


@pytest.mark.parametrize("layout", spec.LAYOUTS)
@pytest.mark.parametrize(("k", "n"), [(128, 64), (256, 192)])
def test_autotuning_offers_only_configs_that_serve_the_call(layout, k, n):
  """K of two or four 64-deep blocks (not five stages' worth), N that 128- and 256-column
  tiles do not divide: the candidates refused for the call are not offered, the others are."""
  record = _abstract_record(layout, 512, k, n, 4)
  op = mosaic.MosaicRaggedDot()
  configs = op._get_autotuning_configs(record)
  assert SMALL in {dataclasses.replace(c, balance=SMALL.balance, cluster=1) for c in configs}
  for config in configs:
    assert op.with_config(config)._unsupported_reason(record) is None, config


@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("transpose", [False, True])
def test_config_cluster_reaches_the_forward_kernel(monkeypatch, cluster, transpose):
  """`_compute` hands the row-ragged kernel the config's cluster and balance (and its
  blocks)."""
  seen = []

  def fake_fwd(lhs, rhs, sizes, before, *, transpose_rhs, out_dtype, config, **_):
    seen.append((config, transpose_rhs, out_dtype))
    return jnp.zeros((lhs.shape[0], rhs.shape[1 if transpose_rhs else 2]), out_dtype)

  monkeypatch.setattr(mosaic.mosaic_fwd, "ragged_dot_fwd", fake_fwd)
  layout = spec.RHS_TRANSPOSED if transpose else spec.DEFAULT
  record = spec.canonicalize(
    jnp.ones((256, 128), jnp.bfloat16),
    jnp.ones(_rhs_shape(layout, 256, 128, 192, 2), jnp.bfloat16),
    jnp.array([100, 100], jnp.int32),
    spec.dimension_numbers(layout),
    preferred_element_type=jnp.float32,
  )
  balance = cluster == 1  # Both values, over the parametrization.
  config = mosaic.MosaicRaggedDotConfig(
    block_n=64, num_stages=3, epi_n=64, cluster=cluster, balance=balance
  )
  out = mosaic.MosaicRaggedDot()._compute(record, config)
  assert out.shape == (256, 192)
  ((kernel_config, transpose_rhs, out_dtype),) = seen
  assert transpose_rhs == transpose and out_dtype == jnp.float32
  assert kernel_config == mosaic_fwd.MosaicRaggedDotFwdConfig(
    block_n=64, block_k=64, num_stages=3, epi_n=64, cluster=cluster, balance=balance
  )


@pytest.mark.parametrize("layout", spec.LAYOUTS)
def test_unsupported_reason_judges_the_given_config(layout):
  """N=128 suits the heuristic's block_n=128 but not a given block_n=256: refused."""
  record = _abstract_record(layout, 256, 256, 128, 2)
  assert mosaic.MosaicRaggedDot()._unsupported_reason(record) is None
  wide = mosaic.MosaicRaggedDotConfig(block_n=256, num_stages=2, epi_n=128)
  reason = mosaic.MosaicRaggedDot(config=wide)._unsupported_reason(record)
  assert reason is not None and "block_n=256" in reason, reason


def test_drhs_shared_memory_bytes():
  """The drhs kernel's shared memory, counted by hand: per stage a [block_m, 128] lhs tile and
  a [block_m, block_n] rhs tile; two [64, epi_n] epilogue buffers of the output dtype."""
  c = mosaic_drhs.MosaicRaggedDotDrhsConfig(block_n=256, block_m=64, num_stages=3, epi_n=128)
  assert mosaic_drhs.smem_bytes(c, 2, 4) == 3 * (64 * 128 + 64 * 256) * 2 + 2 * 64 * 128 * 4
  assert mosaic_drhs.smem_bytes(c, 2, 2) == 3 * (64 * 128 + 64 * 256) * 2 + 2 * 64 * 128 * 2
  # 227 KiB - 1 KiB = 231424 bytes: 4 stages and a float32 epilogue take 262144, 3 take 212992.
  assert mosaic_drhs.config_reason(c, 1024, 256, 256, 2, 4) is None
  c4 = dataclasses.replace(c, num_stages=4)
  reason = mosaic_drhs.config_reason(c4, 1024, 256, 256, 2, 4)
  assert reason is not None and "shared memory" in reason


def test_forward_shared_memory_bytes():
  """The forward kernel's shared memory, counted by hand: per stage a [128, block_k] lhs tile
  and a [block_k, block_n] rhs tile; two [64, epi_n] epilogue buffers of the output dtype."""
  c = mosaic_fwd.MosaicRaggedDotFwdConfig(block_n=256, block_k=64, num_stages=4, epi_n=128)
  assert mosaic_fwd.smem_bytes(c, 2, 2) == 4 * (128 * 64 + 64 * 256) * 2 + 2 * 64 * 128 * 2
  assert mosaic_fwd.smem_bytes(c, 2, 4) == 4 * (128 * 64 + 64 * 256) * 2 + 2 * 64 * 128 * 4
  # 227 KiB - 1 KiB = 231424 bytes: a bfloat16 output takes 229376, a float32 one 262144.
  assert mosaic_fwd.config_reason(c, 1024, 256, 256, 2, 2) is None
  reason = mosaic_fwd.config_reason(c, 1024, 256, 256, 2, 4)
  assert reason is not None and "shared memory" in reason


def test_drhs_config_reasons():
  """The drhs kernel refuses N off whole block_n tiles, epi_n not dividing block_n, and row
  chunks other than one 128-byte swizzle deep."""
  drhs = mosaic_drhs.MosaicRaggedDotDrhsConfig
  base = dict(block_n=128, block_m=64, num_stages=2, epi_n=64)
  assert mosaic_drhs.config_reason(drhs(**base), 512, 128, 256, 2, 4) is None
  assert "N=192" in mosaic_drhs.config_reason(drhs(**base), 512, 128, 192, 2, 4)
  assert "epi_n" in mosaic_drhs.config_reason(drhs(**{**base, "epi_n": 96}), 512, 128, 256, 2, 4)
  for block_m, itemsize in ((32, 2), (128, 2), (64, 4)):
    reason = mosaic_drhs.config_reason(
      drhs(**{**base, "block_m": block_m}), 512, 128, 256, itemsize, 4
    )
    assert reason is not None and "block_m" in reason, (block_m, itemsize, reason)


@pytest.mark.parametrize("out_dtype", [jnp.int32, np.float64])
def test_unsupported_reason_names_an_output_dtype(out_dtype):
  """bfloat16 inputs with an output dtype the epilogue cannot write: refused, naming it."""
  record = spec.canonicalize(
    jnp.ones((128, 256), jnp.bfloat16),
    jnp.ones((2, 256, 256), jnp.bfloat16),
    jnp.array([64, 64], jnp.int32),
    preferred_element_type=out_dtype,
  )
  reason = mosaic.MosaicRaggedDot(interpret=True)._unsupported_reason(record)
  assert reason is not None and f"preferred_element_type {np.dtype(out_dtype).name}" in reason


@pytest.mark.parametrize("layout", spec.LAYOUTS)
def test_rows_reach_the_kernels_in_whole_tma_tiles(monkeypatch, layout):
  """M=130 rows reach the kernels padded with zero rows to 136 (whole 8-row TMA tiles; at least
  one 128-row block for the row-ragged kernel), and the output keeps M rows."""
  seen = []

  def fake(lhs, rhs, sizes, before, *, out_dtype, transpose_rhs=None, **_):
    seen.append((lhs, rhs))
    if layout == spec.RAGGED_CONTRACTING:
      return jnp.zeros((sizes.shape[0], lhs.shape[1], rhs.shape[1]), out_dtype)
    return jnp.zeros((lhs.shape[0], rhs.shape[1 if transpose_rhs else 2]), out_dtype)

  monkeypatch.setattr(mosaic.mosaic_fwd, "ragged_dot_fwd", fake)
  monkeypatch.setattr(mosaic.mosaic_drhs, "ragged_contracting_dot", fake)
  m, k, n = 130, 128, 64
  rng = np.random.default_rng(7)
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal(_rhs_shape(layout, m, k, n, 2)), jnp.bfloat16)
  record = spec.canonicalize(
    lhs, rhs, jnp.array([60, 70], jnp.int32), spec.dimension_numbers(layout)
  )
  out = mosaic.MosaicRaggedDot()._compute(record, SMALL)
  assert out.shape == record.out_shape
  ((lhs_k, rhs_k),) = seen
  assert lhs_k.shape == (136, k)
  np.testing.assert_array_equal(np.asarray(lhs_k[:m]), np.asarray(lhs))
  assert not np.asarray(lhs_k[m:]).any()
  if layout == spec.RAGGED_CONTRACTING:
    assert rhs_k.shape == (136, n) and not np.asarray(rhs_k[m:]).any()
  else:
    assert rhs_k.shape == rhs.shape


@pytest.mark.parametrize("interpret", [False, True])
def test_interpreted_kernels_run_few_ctas(monkeypatch, interpret):
  """Interpreted, the persistent kernels run `INTERPRET_NUM_SMS` CTAs (each one a set of
  threads on the host); compiled, one per SM."""
  seen = []

  def fake(lhs, rhs, sizes, before, *, out_dtype, num_sms, **_):
    seen.append(num_sms)
    return jnp.zeros((sizes.shape[0], lhs.shape[1], rhs.shape[1]), out_dtype)

  monkeypatch.setattr(mosaic.mosaic_drhs, "ragged_contracting_dot", fake)
  record = spec.canonicalize(
    jnp.ones((64, 128), jnp.bfloat16),
    jnp.ones((64, 64), jnp.bfloat16),
    jnp.array([30, 34], jnp.int32),
    spec.dimension_numbers(spec.RAGGED_CONTRACTING),
  )
  mosaic.MosaicRaggedDot(interpret=interpret)._compute(record, SMALL)
  want = mosaic_gemm.INTERPRET_NUM_SMS if interpret else mosaic_gemm.num_sms(False)
  assert seen == [want] and mosaic_gemm.INTERPRET_NUM_SMS < device.DEFAULT_SM_COUNT


@pytest.mark.parametrize("cluster", [1, 2])
def test_schedule_rounds_are_as_wide_as_the_grids_clusters(monkeypatch, cluster):
  """The persistent grid of `num_sms` CTAs runs `num_sms / cluster` clusters, each taking
  one item at a time: a round of the schedule is that many positions."""
  seen = []
  schedule = mosaic_fwd.schedule

  def spy(items, num_items, n_tiles, lanes, cluster_, balance):
    seen.append((lanes, cluster_))
    return schedule(items, num_items, n_tiles, lanes, cluster_, balance)

  monkeypatch.setattr(mosaic_fwd, "schedule", spy)
  config = mosaic_fwd.MosaicRaggedDotFwdConfig(block_n=64, num_stages=2, epi_n=64, cluster=cluster)
  lhs = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((2, 128, 128), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((2,), jnp.int32)
  fwd = lambda a, b, g: mosaic_fwd.ragged_dot_fwd(
    a, b, g, None, transpose_rhs=False, out_dtype=jnp.bfloat16, config=config, num_sms=8
  )
  assert jax.eval_shape(fwd, lhs, rhs, sizes).shape == (256, 128)
  assert seen == [(8 // cluster, cluster)]


def _pairs_and_full(items, n_tiles, cluster):
  """Each (item, N tile) pair as a tuple, and whether a block of it has two 64-row halves of
  rows to compute (counted row by row)."""
  pairs, full = [], []
  for item in items[1 : 1 + items[0, 0]]:
    dear = False
    for row0, lo, hi in item[1 : 1 + 3 * cluster].reshape(cluster, 3):
      rows = np.arange(row0, row0 + 128)
      inside = (rows >= lo) & (rows < hi)
      dear |= bool(item[0] >= 0 and inside[:64].any() and inside[64:].any())
    for ni in range(n_tiles):
      pairs.append((*item.tolist(), ni))
      full.append(dear)
  return pairs, np.array(full)


@pytest.mark.parametrize("balance", [False, True])
@pytest.mark.parametrize(
  ("seed", "cluster", "before", "after"),
  [
    (0, 1, 0, 0),
    (1, 1, 0, 0),
    (2, 2, 0, 0),
    (1, 1, 8000, 2000),
    (2, 2, 3000, 5000),
    # Each of these left a lane two full blocks ahead when the partial last round kept the
    # list's order (a full pair of it on a lane the whole rounds had left one ahead).
    (2, 1, 0, 0),
    (3, 2, 0, 0),
    (3, 1, 20000, 0),
    (5, 2, 20000, 0),
    (6, 1, 20000, 0),
  ],
)
def test_schedule_keeps_each_round_and_deals_cheap_pairs_in_turn(
  seed, cluster, before, after, balance
):
  """Every round of `lanes` positions holds the same pairs as in the work list's order (in
  that order without `balance`); balanced, the lanes' counts of full blocks differ by at
  most one, where the list's order piles up to five more on some lanes than on others. Rows
  before and after the groups make zero blocks, which compute nothing: cheap ones."""
  lanes, n_tiles, m = 132 // cluster, 8, 32768
  sizes = spec.generate_ragged_dot_group_sizes(m - before - after, 64, seed=seed, alpha=0.5)
  offset = jnp.int32(before) if before else None
  items, num_items = mosaic_fwd.work_items(jnp.asarray(sizes), offset, m, 128, cluster)
  table = np.asarray(mosaic_fwd.schedule(items, num_items, n_tiles, lanes, cluster, balance))
  pairs, full = _pairs_and_full(np.asarray(items), n_tiles, cluster)
  total = len(pairs)
  assert table[0, 0] == total
  got = [tuple(row) for row in table[1 : 1 + total].tolist()]
  for start in range(0, total, lanes):
    assert sorted(got[start : start + lanes]) == sorted(pairs[start : start + lanes])
  # Positions past the last pair (items past the list's end) stay where they are.
  assert np.all(table[1 + total :, 0] == -1)
  full_of = dict(zip(pairs, full, strict=True))
  lane_full = np.bincount(
    np.arange(total) % lanes, weights=[full_of[p] for p in got], minlength=lanes
  )
  natural = np.bincount(np.arange(total) % lanes, weights=full, minlength=lanes)
  if balance:
    assert lane_full.max() - lane_full.min() <= 1, lane_full
  else:
    assert got == pairs
    np.testing.assert_array_equal(lane_full, natural)
  # The skewed sizes pile full blocks up on some lanes in the list's order.
  assert natural.max() - natural.min() > 2


@pytest.mark.parametrize("seed", range(3))
def test_schedule_runs_every_pair_once_on_small_grids(seed):
  """Few lanes (1-11), 1-3 N tiles, empty groups, rows before and after the groups: the
  balanced schedule runs each (item, N tile) pair exactly once, keeps each round's pairs,
  leaves the positions past the last pair alone, and its lanes' counts of full blocks differ
  by at most one."""
  rng = np.random.default_rng(seed)
  for _ in range(5):
    cluster, lanes, n_tiles = (
      int(rng.integers(1, 3)),
      int(rng.integers(1, 12)),
      int(rng.integers(1, 4)),
    )
    m, g = 1024, int(rng.integers(1, 12))
    before, after = int(rng.integers(0, m // 2)), int(rng.integers(0, m // 3))
    sizes = spec.generate_ragged_dot_group_sizes(
      m - before - after, g, seed=int(rng.integers(1000)), alpha=0.5, empty_fraction=0.2
    )
    items, num_items = mosaic_fwd.work_items(jnp.asarray(sizes), jnp.int32(before), m, 128, cluster)
    table = np.asarray(mosaic_fwd.schedule(items, num_items, n_tiles, lanes, cluster, True))
    plain = np.asarray(mosaic_fwd.schedule(items, num_items, n_tiles, lanes, cluster, False))
    pairs, full = _pairs_and_full(np.asarray(items), n_tiles, cluster)
    total = len(pairs)
    assert table[0, 0] == total
    got = [tuple(row) for row in table[1 : 1 + total].tolist()]
    assert len(set(got)) == total
    for start in range(0, total, lanes):
      assert sorted(got[start : start + lanes]) == sorted(pairs[start : start + lanes])
    np.testing.assert_array_equal(table[1 + total :], plain[1 + total :])
    full_of = dict(zip(pairs, full, strict=True))
    lane_full = np.bincount(
      np.arange(total) % lanes, weights=[full_of[p] for p in got], minlength=lanes
    )
    assert lane_full.max() - lane_full.min() <= 1, (lanes, lane_full)


@pytest.mark.parametrize(
  ("m", "k", "n", "g", "layout", "want"),
  [
    (16384, 4096, 2048, 8, spec.DEFAULT, False),  # 64 (item, N tile) columns < 132 CTAs.
    (32768, 7168, 2048, 64, spec.DEFAULT, True),
    (32768, 7168, 2048, 64, spec.RHS_TRANSPOSED, True),
    (1024, 512, 4096, 16, spec.DEFAULT, True),  # 16 groups of 16 N tiles: 256 columns.
    (1024, 512, 4096, 16, spec.RAGGED_CONTRACTING, False),  # Another kernel.
  ],
)
def test_heuristics_balance_where_group_boundaries_reach_every_cta(m, k, n, g, layout, want):
  """Dealing cheap items costs ~10 us of XLA kernels (3% of the G8 forward on the H200) and
  gained 10% of the skewed G64 kernel: on where groups times N tiles reach the 132 CTAs."""
  record = spec.canonicalize(
    jnp.ones((m, k), jnp.bfloat16),
    jnp.ones(_rhs_shape(layout, m, k, n, g), jnp.bfloat16),
    jnp.full((g,), m // g, jnp.int32),
    spec.dimension_numbers(layout),
  )
  assert mosaic.MosaicRaggedDot()._get_heuristics_config(record).balance is want
