"""Half items of the Mosaic GPU ragged_dot forward/dlhs kernel (issue #6), on CPU.

A segment's last item is a 64-row "half" item when its rows fit: both compute
warpgroups use the same 64 lhs rows and split the N tile. Checked here: the
work list (every row written once, half items only where they fit), the kernel
in the Pallas GPU interpreter with race detection (remainders up to and over 64
rows, tiny and empty groups, a group offset, 1- and 2-CTA clusters, both rhs
layouts), the op's gradients with half items on, and CUDA lowering of every
tuning config. Timings: ci/gpu/mosaic_mm.py --part half.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

from harness import compare, references
from tokamax._src.ops.ragged_dot import api, mosaic, mosaic_fwd, spec

BLOCK_M = mosaic_fwd.WG_ROWS * mosaic_fwd.NUM_COMPUTE_WGS


def _blocks(item, cluster):
  return item[1 : 1 + 3 * cluster].reshape(cluster, 3)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("order", mosaic_fwd.ORDERS)
def test_work_items_with_half_items_cover_every_row_once(seed, cluster, order):
  rng = np.random.default_rng(100 + seed)
  m, g = 8 * int(rng.integers(BLOCK_M // 8, 110)), int(rng.integers(1, 12))
  sizes = spec.generate_ragged_dot_group_sizes(
    int(rng.integers(0, m + 1)), g, seed=seed, empty_fraction=0.3
  )
  before = int(rng.integers(0, 50))
  args = (jnp.asarray(sizes), jnp.int32(before), m, BLOCK_M, cluster, order)
  items, num_items = mosaic_fwd.work_items(*args, half=True)
  plain, _ = mosaic_fwd.work_items(*args)
  items, plain = np.asarray(items), np.asarray(plain)
  total = items[0, 0]
  assert total == plain[0, 0] <= num_items  # Half items replace full ones one for one.
  assert not plain[1 : 1 + total, -1].any()
  covered = np.full(m, -2)
  halves = 0
  for item in items[1 : 1 + total]:
    rhs, half = item[0], item[-1]
    rows = BLOCK_M // 2 if half else BLOCK_M
    halves += half
    for row0, lo, hi in _blocks(item, cluster):
      assert 0 <= row0 <= m - rows and row0 % 8 == 0
      if lo == hi:  # A cluster's missing last block: stores nothing.
        continue
      assert row0 <= lo < hi <= row0 + rows
      assert np.all(covered[lo:hi] == -2), "row written twice"
      covered[lo:hi] = rhs
  expected = np.full(m, -1)
  ends = np.minimum(before + np.cumsum(sizes), m)
  starts = np.concatenate([[min(before, m)], ends[:-1]])
  for i, (s, e) in enumerate(zip(starts, ends, strict=True)):
    expected[s:e] = i
  np.testing.assert_array_equal(covered, expected)
  # One half item per segment whose last item's rows (from its 8-aligned
  # start) fit cluster * 64 rows.
  seg_start = np.concatenate([[0], starts, ends[-1:]])
  seg_end = np.maximum(np.concatenate([starts[:1], ends, [m]]), seg_start)
  rows = np.where(seg_end > seg_start, seg_end - seg_start // 8 * 8, 0)
  item_rows = cluster * BLOCK_M
  tail = rows - (np.maximum(-(-rows // item_rows), 1) - 1) * item_rows
  assert halves == np.sum((rows > 0) & (2 * tail <= item_rows))


def test_half_items_need_a_splittable_tile():
  assert mosaic_fwd.half_items_fit(256, 128) and mosaic_fwd.half_items_fit(128, 64)
  assert not mosaic_fwd.half_items_fit(128, 128) and not mosaic_fwd.half_items_fit(64, 64)
  config = mosaic_fwd.Config(block_n=64, epi_n=64, half_items=True)
  assert "half items" in mosaic_fwd.config_reason(config, 1024, 512, 256, 2, 2)


# Groups (after `before` rows) with remainders of at most and over 64 rows (of
# 128 for 2-CTA clusters), groups of 1-9 rows, empty groups, rows after.
SIZES = (3, 0, 190, 9, 168, 1, 70, 0, 100, 40)


@pytest.mark.parametrize(
  ("transpose", "cluster", "before"), [(False, 1, 5), (True, 1, 0), (False, 2, 0), (True, 2, 13)]
)
def test_interpret_half_items(transpose, cluster, before, capfd):
  m, k, n = 632, 128, 256
  rng = np.random.default_rng(7)
  sizes = jnp.array(SIZES, jnp.int32)
  g = sizes.shape[0]
  end = before + sum(SIZES)
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((g, n, k) if transpose else (g, k, n)), jnp.bfloat16)
  config = mosaic_fwd.Config(block_n=128, num_stages=2, epi_n=64, cluster=cluster, half_items=True)
  assert mosaic_fwd.config_reason(config, m, k, n, 2, 4) is None
  items, _ = mosaic_fwd.work_items(sizes, jnp.int32(before), m, BLOCK_M, cluster, half=True)
  assert int(np.asarray(items)[1:, -1].sum()) >= 4  # The case has half items.
  out = mosaic_fwd.ragged_dot_fwd(
    lhs,
    rhs,
    sizes,
    jnp.int32(before),
    transpose_rhs=transpose,
    out_dtype=jnp.float32,
    config=config,
    num_sms=2 * cluster,
    interpret=mosaic.plgpu.InterpretGPUParams(detect_races=True),
  )
  layout = spec.RHS_TRANSPOSED if transpose else spec.DEFAULT
  ref = references.high_precision(references.ragged_dot_general)(
    lhs[before:end], rhs, sizes, layout
  )
  assert not interpret_pallas_call.get_races().races_found
  assert "RACE DETECTED" not in capfd.readouterr().out
  out = np.asarray(out)
  assert compare.relative_error(out[before:end], ref) < 1e-5
  assert np.all(out[:before] == 0) and np.all(out[end:] == 0)


def test_interpret_op_gradients_with_half_items(monkeypatch, capfd):
  """Forward, dlhs (the transposed layout of the same kernel) and drhs through the op."""
  monkeypatch.setattr(mosaic, "HALF_ITEMS", True)
  m, k, n = 400, 128, 128
  rng = np.random.default_rng(8)
  sizes = jnp.array([2, 150, 0, 61, 7, 140], jnp.int32)  # Group 0 skipped by the offset.
  group_offset = jnp.array([1], jnp.int32)
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((5, k, n)), jnp.bfloat16)
  config = mosaic.Config(block_n=128, num_stages=2, epi_n=64)
  impl = mosaic.MosaicRaggedDot(interpret=True, config=config)
  dims = spec.dimension_numbers(spec.DEFAULT)

  def fn(a, b):
    return api.ragged_dot_general(a, b, sizes, dims, group_offset=group_offset, implementation=impl)

  out, vjp = jax.vjp(fn, lhs, rhs)
  ct = jnp.asarray(rng.standard_normal(out.shape), jnp.bfloat16)
  dlhs, drhs = vjp(ct)
  ref, (ref_dlhs, ref_drhs) = references.high_precision_vjp(
    lambda a, b: references.ragged_dot_general(
      a, b, sizes, spec.DEFAULT, group_offset=group_offset, num_groups=5
    ),
    (lhs, rhs),
    ct,
  )
  assert not interpret_pallas_call.get_races().races_found
  assert "RACE DETECTED" not in capfd.readouterr().out
  for name, x, r in (("out", out, ref), ("dlhs", dlhs, ref_dlhs), ("drhs", drhs, ref_drhs)):
    assert x.shape == r.shape, name
    assert compare.relative_error(x, r) < 5e-3, name


def _lower(layout, m, k, n, g, configs):
  op = mosaic.MosaicRaggedDot()
  rhs_shape = (g, n, k) if layout == spec.RHS_TRANSPOSED else (g, k, n)
  shapes = (
    jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
    jax.ShapeDtypeStruct(rhs_shape, jnp.bfloat16),
    jax.ShapeDtypeStruct((g,), jnp.int32),
  )

  def fn(lhs, rhs, sizes):
    record = spec.canonicalize(lhs, rhs, sizes, spec.dimension_numbers(layout))
    return [op._compute(record, c) for c in configs(record)]

  text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("layout", [spec.DEFAULT, spec.RHS_TRANSPOSED])
def test_every_autotuning_config_lowers_for_cuda_with_half_items(layout, monkeypatch):
  monkeypatch.setattr(mosaic, "HALF_ITEMS", True)
  op = mosaic.MosaicRaggedDot()
  halves = []

  def configs(record):
    found = sorted(op._get_autotuning_configs(record), key=dataclasses.astuple)
    halves.extend(mosaic._kernel_config(record, c).half_items for c in found)
    return found

  _lower(layout, 1024, 512, 256, 4, configs)
  assert sum(halves) >= 4


@pytest.mark.parametrize("layout", [spec.DEFAULT, spec.RHS_TRANSPOSED])
@pytest.mark.parametrize("cluster", [1, 2])
def test_heuristic_config_lowers_with_half_items_at_target_shape(layout, cluster, monkeypatch):
  monkeypatch.setattr(mosaic, "HALF_ITEMS", True)
  monkeypatch.setattr(mosaic, "HEURISTIC_CLUSTER", cluster)
  op = mosaic.MosaicRaggedDot()

  def configs(record):
    config = op._get_heuristics_config(record)
    assert mosaic._kernel_config(record, config).half_items
    return [config]

  _lower(layout, 32768, 7168, 2048, 64, configs)
