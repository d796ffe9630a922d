"""Mosaic TPU ragged_dot on CPU: the kernels in Pallas's TPU interpreter against
float64 references (forward and both gradients), their work lists, the block
cost model, and `jax.export` for a TPU v5e from a CPU host.

Not covered here (needs a TPU): Mosaic's own compilation of the lowered kernels
(layouts, VMEM allocation) and their speed.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import tpu_info
from jax.experimental.pallas import tpu as pltpu

import tokamax
from suites import opdb
from tokamax._src import export, tpu
from tokamax._src.ops.ragged_dot import api, mosaic_tpu, mosaic_tpu_kernel, spec
from tokamax_harness import compare, references

# The summary counts these under the op and implementation they check.
# On any host the TPU kernels run in the TPU interpreter, on the host CPU.
pytestmark = [
  pytest.mark.op("ragged_dot", "mosaic_tpu"),
  pytest.mark.usefixtures("on_cpu"),
  pytest.mark.host_only,
]

# `kernel_cases.RaggedDotKernelCase`s (in the op database).
CASES = opdb.get("ragged_dot").kernel_cases["mosaic_tpu"]
_BOUND = {"float32": 1e-5, "bfloat16": 5e-3}


def _rhs_shape(layout, m, k, n, g):
  return {spec.DEFAULT: (g, k, n), spec.RHS_TRANSPOSED: (g, n, k), spec.RAGGED_CONTRACTING: (m, n)}[
    layout
  ]


@pytest.mark.parametrize("name", list(CASES))
def test_interpret_matches_reference_with_gradients(name):
  case = CASES[name]
  layout, m, k, n, g, offset = case.layout, case.m, case.k, case.n, case.groups, case.group_offset
  rng = np.random.default_rng(m)
  # Uneven sizes with empty groups; the last 9 rows are in no group.
  sizes = spec.generate_ragged_dot_group_sizes(m - 9, g + 1, seed=m, alpha=0.5, empty_fraction=0.3)
  sizes = jnp.asarray(sizes)
  assert int(jnp.sum(sizes == 0)) >= 1
  group_offset = jnp.array([1], jnp.int32) if offset else None
  rhs_groups = g if offset else g + 1  # The groups computed.
  dtype = jnp.dtype(case.dtype)
  lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
  rhs = jnp.asarray(rng.standard_normal(_rhs_shape(layout, m, k, n, rhs_groups)), dtype)
  config = mosaic_tpu.MosaicTpuRaggedDotConfig(**case.config)
  impl = mosaic_tpu.MosaicTpuRaggedDot(interpret=True, config=config)
  dims = spec.dimension_numbers(layout)
  kwargs = dict(group_offset=group_offset)
  if layout == spec.RAGGED_CONTRACTING and offset:
    kwargs["num_local_groups"] = g

  def fn(a, b):
    return spec.SPEC(a, b, sizes, dims, implementation=impl, **kwargs)

  out, vjp = jax.vjp(fn, lhs, rhs)
  ct = jnp.asarray(rng.standard_normal(out.shape), dtype)
  dlhs, drhs = vjp(ct)
  ref, (ref_dlhs, ref_drhs) = references.high_precision_vjp(
    lambda a, b: references.ragged_dot_general(
      a, b, sizes, layout, group_offset=group_offset, num_groups=rhs_groups
    ),
    (lhs, rhs),
    ct,
  )
  for label, x, r in (("out", out, ref), ("dlhs", dlhs, ref_dlhs), ("drhs", drhs, ref_drhs)):
    assert x.shape == r.shape, label
    assert x.dtype == dtype, label
    assert np.all(np.isfinite(np.asarray(x, np.float32))), label
    assert compare.relative_error(x, r) < _BOUND[case.dtype], label


@pytest.mark.parametrize("seed", range(6))
def test_interpret_random_sizes_with_gradients(seed):
  """Random M, group sizes (empty groups, totals below M), offsets and small row tiles."""
  rng = np.random.default_rng(100 + seed)
  layout = spec.LAYOUTS[seed % 3]
  m, k, n = int(rng.integers(1, 200)), int(rng.choice([40, 128])), int(rng.choice([24, 128]))
  g = int(rng.integers(1, 6))
  offset = jnp.array([1], jnp.int32) if seed % 2 else None
  local = g if offset is not None else g + 1
  sizes = spec.generate_ragged_dot_group_sizes(
    int(rng.integers(0, m + 1)), g + 1, seed=seed, empty_fraction=0.3
  )
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal(_rhs_shape(layout, m, k, n, local)), jnp.float32)
  block_m = 128 if layout == spec.RAGGED_CONTRACTING else 8 * int(rng.integers(1, 5))
  config = mosaic_tpu.MosaicTpuRaggedDotConfig(block_m=block_m, block_k=k, block_n=n)
  impl = mosaic_tpu.MosaicTpuRaggedDot(interpret=True, config=config)
  kwargs = dict(group_offset=offset)
  if layout == spec.RAGGED_CONTRACTING and offset is not None:
    kwargs["num_local_groups"] = local
  dims = spec.dimension_numbers(layout)
  out, vjp = jax.vjp(
    lambda a, b: spec.SPEC(a, b, sizes, dims, implementation=impl, **kwargs), lhs, rhs
  )
  ct = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
  ref, ref_grads = references.high_precision_vjp(
    lambda a, b: references.ragged_dot_general(
      a, b, jnp.asarray(sizes), layout, group_offset=offset, num_groups=local
    ),
    (lhs, rhs),
    ct,
  )
  for label, x, r in zip(("out", "dlhs", "drhs"), (out, *vjp(ct)), (ref, *ref_grads), strict=True):
    assert x.shape == r.shape, label
    np.testing.assert_allclose(np.asarray(x), r, rtol=1e-4, atol=1e-4, err_msg=label)


def test_interpret_on_two_cores_matches_reference():
  """A v5p megacore in the interpreter: two cores split the grid's "parallel" axes, in a random
  order. Only the column tiles (and the rhs gradient's output tiles) may be parallel: work
  items in order share a row tile's output block and an accumulator, and a split of them
  between the cores would lose the items of the other core."""
  # Row tiles that groups share and a group over two of them; two K steps, two column tiles.
  m, k, n = 300, 256, 256
  rng = np.random.default_rng(17)
  sizes = jnp.array([100, 0, 180], jnp.int32)  # The last 20 rows are in no group.
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((3, k, n)), jnp.float32)
  config = mosaic_tpu.MosaicTpuRaggedDotConfig(block_m=128, block_k=128, block_n=128)
  params = pltpu.InterpretParams(num_cores_or_threads=2, random_seed=5)
  impl = mosaic_tpu.MosaicTpuRaggedDot(interpret=params, config=config)
  out, vjp = jax.vjp(lambda a, b: api.ragged_dot(a, b, sizes, implementation=impl), lhs, rhs)
  ct = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
  ref, ref_grads = references.high_precision_vjp(
    lambda a, b: references.ragged_dot_general(a, b, sizes, spec.DEFAULT), (lhs, rhs), ct
  )
  for label, x, r in zip(("out", "dlhs", "drhs"), (out, *vjp(ct)), (ref, *ref_grads), strict=True):
    assert compare.relative_error(x, r) < _BOUND["float32"], label


def test_rows_outside_groups_are_zero_and_empty_groups_give_zeros():
  m, k, n = 150, 128, 128
  rng = np.random.default_rng(3)
  sizes = jnp.array([0, 40, 0, 0, 67, 0], jnp.int32)  # 107 of 150 rows; before: 0 rows.
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  impl = mosaic_tpu.MosaicTpuRaggedDot(
    interpret=True, config=mosaic_tpu.MosaicTpuRaggedDotConfig(block_m=128)
  )
  out = api.ragged_dot(lhs, jnp.ones((6, k, n)), sizes, implementation=impl)
  assert np.all(np.asarray(out)[107:] == 0)
  grouped = api.ragged_dot_general(
    lhs,
    jnp.asarray(rng.standard_normal((m, n)), jnp.float32),
    sizes,
    spec.dimension_numbers(spec.RAGGED_CONTRACTING),
    implementation=impl,
  )
  assert np.all(np.asarray(grouped)[[0, 2, 3, 5]] == 0)
  assert np.all(np.asarray(grouped)[[1, 4]] != 0)


def test_interpret_preferred_element_type_and_offset_past_every_row():
  m, k, n = 40, 128, 128
  rng = np.random.default_rng(5)
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((2, k, n)), jnp.bfloat16)
  impl = mosaic_tpu.MosaicTpuRaggedDot(interpret=True)
  sizes = jnp.array([30, 10, 5, 5], jnp.int32)
  out = api.ragged_dot(
    lhs,
    rhs,
    sizes,
    preferred_element_type=jnp.float32,
    group_offset=jnp.array([1], jnp.int32),
    implementation=impl,
  )
  assert out.dtype == jnp.float32
  ref = references.high_precision(references.ragged_dot_general)(
    lhs, rhs, sizes, spec.DEFAULT, group_offset=jnp.array([1], jnp.int32), num_groups=2
  )
  assert compare.relative_error(out, ref) < 1e-5
  # Every local group starts past the rows: all zeros.
  late = api.ragged_dot(
    lhs, rhs, sizes, group_offset=jnp.array([2], jnp.int32), implementation=impl
  )
  assert np.all(np.asarray(late) == 0)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("keep_empty", [False, True])
def test_work_items_cover_every_segment_tile_once(seed, keep_empty):
  rng = np.random.default_rng(seed)
  block_m = 16
  m, g = int(rng.integers(1, 200)), int(rng.integers(1, 9))
  sizes = spec.generate_ragged_dot_group_sizes(
    int(rng.integers(0, m + 1)), g, seed=seed, empty_fraction=0.3
  )
  before = int(rng.integers(0, 30))
  starts, ends = spec.group_row_bounds(jnp.asarray(sizes), jnp.int32(before), m)
  items = mosaic_tpu_kernel._work_items(starts, ends, m, block_m, keep_empty)
  seg, tile, live = (np.asarray(items[x]) for x in ("segment", "tile", "live"))
  starts, ends = np.asarray(starts), np.asarray(ends)
  tiles = -(-m // block_m)
  assert len(seg) == tiles + g - 1
  total = int(live.sum())
  assert np.all(live[:total] == 1) and np.all(live[total:] == 0)
  # Dead items repeat the last live one.
  assert np.all(seg[total:] == seg[total - 1]) and np.all(tile[total:] == tile[total - 1])
  expected = []
  for s, (a, b) in enumerate(zip(starts, ends, strict=True)):
    if b > a:
      expected += [(s, t) for t in range(a // block_m, (b - 1) // block_m + 1)]
    elif keep_empty:
      expected.append((s, min(a // block_m, tiles - 1)))
  assert list(zip(seg[:total].tolist(), tile[:total].tolist(), strict=True)) == expected


def test_empty_groups_at_the_last_row_stay_in_the_last_tile():
  """Groups that fill M = 4 tiles exactly, then empty groups at row M: their one item (the
  transposed kernel stores their zeros) names the last tile, not a tile past M."""
  starts = jnp.array([0, 16, 16, 40, 64, 64], jnp.int32)
  ends = jnp.array([16, 16, 40, 64, 64, 64], jnp.int32)
  items = mosaic_tpu_kernel._work_items(starts, ends, 64, 16, keep_empty=True)
  seg, tile, live = (np.asarray(items[x]).tolist() for x in ("segment", "tile", "live"))
  assert sum(live) == 8
  expected = [(0, 0), (1, 1), (2, 1), (2, 2), (3, 2), (3, 3), (4, 3), (5, 3)]
  assert list(zip(seg, tile, strict=True))[:8] == expected
  assert max(tile) == 3


def test_a_fixed_config_that_misfits_a_gradient_leaves_it_to_its_own_blocks():
  """block_k=256 fits the forward's K=256 but not the lhs gradient's contraction over N=128:
  that gradient takes its own blocks, still in the kernel (no fallback to XLA); the forward
  and the rhs gradient keep the fixed config."""
  lhs = jnp.ones((256, 256), jnp.float32)
  rhs = jnp.ones((2, 256, 128), jnp.float32)
  args = spec.canonicalize(lhs, rhs, jnp.array([100, 156], jnp.int32))
  config = mosaic_tpu.MosaicTpuRaggedDotConfig(block_m=128, block_k=256, block_n=128)
  impl = mosaic_tpu.MosaicTpuRaggedDot(interpret=True, config=config)
  assert impl._unsupported_reason(args) is None
  assert impl._bwd_unsupported_reason(args) is None
  dlhs = dataclasses.replace(args, lhs=jnp.ones((256, 128)), layout=spec.RHS_TRANSPOSED)
  assert "block_k=256 must divide K=128" in mosaic_tpu.config_reason(dlhs, config)
  assert impl._gradient_config(dlhs) != config
  drhs = dataclasses.replace(
    args, rhs=jnp.ones((256, 128)), layout=spec.RAGGED_CONTRACTING, out_dtype=jnp.float32
  )
  assert impl._gradient_config(drhs) == config


def _export(fn, *shapes, device_kind="TPU v5 lite"):
  with export.abstract_tpu(device_kind):
    assert jax.sharding.get_abstract_mesh().abstract_device.device_kind == device_kind
    return jax.export.export(jax.jit(fn), platforms=("tpu",))(*shapes)


@pytest.mark.parametrize("implementation", ["mosaic", None])
@pytest.mark.parametrize("layout", spec.LAYOUTS)
def test_export_for_tpu_v5_has_the_mosaic_tpu_call(implementation, layout):
  bf16 = jnp.bfloat16
  m, k, n, g = 512, 256, 384, 4
  lhs = jax.ShapeDtypeStruct((m, k), bf16)
  rhs = jax.ShapeDtypeStruct(_rhs_shape(layout, m, k, n, g), bf16)
  sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
  dims = spec.dimension_numbers(layout)

  def forward(a, b, s):
    return tokamax.ragged_dot_general(a, b, s, dims, implementation=implementation)

  def forward_backward(a, b, s):
    loss = lambda a, b: jnp.sum(forward(a, b, s).astype(jnp.float32) ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1))(a, b)

  for fn, calls in ((forward, 1), (forward_backward, 3)):
    exported = _export(fn, lhs, rhs, sizes)
    text = exported.mlir_module()
    assert exported.platforms == ("tpu",)
    assert text.count("tpu_custom_call") == calls, fn.__name__
    assert "ragged_dot" not in " ".join(export.custom_call_targets(text))
    assert "chlo.ragged_dot" not in text and "stablehlo.ragged_dot" not in text  # No XLA path.


def test_export_for_tpu_v5p():
  lhs = jax.ShapeDtypeStruct((256, 128), jnp.float32)
  rhs = jax.ShapeDtypeStruct((2, 128, 128), jnp.float32)
  sizes = jax.ShapeDtypeStruct((2,), jnp.int32)
  exported = _export(
    lambda a, b, s: tokamax.ragged_dot(a, b, s), lhs, rhs, sizes, device_kind="TPU v5"
  )
  text = exported.mlir_module()
  assert "tpu_custom_call" in text
  # The kernel asks Mosaic for v5p's scoped VMEM limit (32 MiB of its 64 MiB), the limit its
  # blocks were checked against.
  sizes = re.findall(r"\\22size\\22: (\d+)", text)
  assert sizes and set(sizes) == {str(32 << 20)}, sizes


def test_mosaic_names_the_platforms_kernel():
  assert spec.SPEC.platform_name("mosaic", "tpu") == "mosaic_tpu"
  assert spec.SPEC.platform_name("mosaic", "gpu") == "mosaic"
  assert spec.SPEC.default_order("tpu") == ("mosaic_tpu", "xla")
  with export.abstract_tpu():
    assert spec.SPEC.resolve("mosaic") == ["mosaic_tpu"]
    assert spec.SPEC.resolve(None) == ["mosaic_tpu", "xla"]
  # On this CPU host: "mosaic" is the Mosaic GPU kernel, which refuses; None runs XLA.
  lhs, rhs, sizes = jnp.ones((16, 128)), jnp.ones((2, 128, 128)), jnp.array([8, 8], jnp.int32)
  with pytest.raises(NotImplementedError, match="mosaic"):
    tokamax.ragged_dot(lhs, rhs, sizes, implementation="mosaic")
  assert tokamax.ragged_dot(lhs, rhs, sizes).shape == (16, 128)


def test_unsupported_reasons_name_the_feature():
  impl = mosaic_tpu.MosaicTpuRaggedDot(interpret=True)
  lhs, rhs = jnp.ones((64, 128), jnp.float16), jnp.ones((2, 128, 128), jnp.float16)
  sizes = jnp.array([32, 32], jnp.int32)
  with pytest.raises(NotImplementedError, match="dtype float16"):
    impl(lhs, rhs, sizes)
  lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
  with pytest.raises(NotImplementedError, match="preferred_element_type float16"):
    api.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float16, implementation=impl)
  with pytest.raises(NotImplementedError, match="block_n=100 must be a multiple of 128"):
    impl.with_config(mosaic_tpu.MosaicTpuRaggedDotConfig(block_n=100))(lhs, rhs, sizes)
  with pytest.raises(NotImplementedError, match="block_k=256 must divide K=128"):
    impl.with_config(mosaic_tpu.MosaicTpuRaggedDotConfig(block_k=256))(lhs, rhs, sizes)
  with pytest.raises(NotImplementedError, match="block_m=12 must be a multiple of 8"):
    impl.with_config(mosaic_tpu.MosaicTpuRaggedDotConfig(block_m=12))(lhs, rhs, sizes)
  huge = mosaic_tpu.MosaicTpuRaggedDotConfig(block_m=8192, block_k=128, block_n=8192)
  with pytest.raises(NotImplementedError, match="VMEM"):
    impl.with_config(huge)(lhs, rhs, sizes)
  assert "runs on tpu, not on " in mosaic_tpu.MosaicTpuRaggedDot().unsupported_reason(
    spec.canonicalize(lhs, rhs, sizes)
  )
  # The default choice falls back to another implementation instead.
  out = api.ragged_dot(
    lhs.astype(jnp.float16), rhs.astype(jnp.float16), sizes, implementation=[impl, "xla"]
  )
  assert out.shape == (64, 128)


# (layout, m, k, n, g, blocks (m, k, n)) -> (flops, HBM bytes, grid steps), by hand from the
# model's rules: row segments are the tiles plus one per group (plus the two zero segments of
# the row-ragged layouts); an operand block is fetched again whenever its index changes,
# except that with one contraction step it stays while its index holds.
_COST_CASES = {
  # 8 row tiles + 3 groups + 1 = 12 items (each group boundary and the two zero segments can
  # split a tile); 2 K steps, 3 N tiles.
  "default_two_k_steps": (
    (spec.DEFAULT, 1000, 512, 384, 3, (128, 256, 128)),
    (2 * 12 * 128 * 512 * 384, 3 * (24 * 128 * 256 + 24 * 256 * 128) * 2 + 1000 * 384 * 4, 72),
  ),
  # One K step: lhs fetched once per row tile (8), rhs once per group (3).
  "default_one_k_step": (
    (spec.DEFAULT, 1000, 256, 384, 3, (128, 256, 384)),
    (2 * 12 * 128 * 256 * 384, (8 * 128 * 256 + 3 * 256 * 384) * 2 + 1000 * 384 * 4, 12),
  ),
  # Contracting rows: 4 row tiles + 3 groups = 7 items, 2 K tiles, 1 N tile.
  "ragged_contracting": (
    (spec.RAGGED_CONTRACTING, 1000, 256, 384, 3, (256, 128, 384)),
    (2 * 7 * 256 * 256 * 384, 14 * 256 * (128 + 384) * 2 + 3 * 256 * 384 * 4, 14),
  ),
}


@pytest.mark.parametrize("name", list(_COST_CASES))
def test_cost_model_counts_by_hand(name, roofline_calls):
  """The flops, HBM bytes and grid steps the cost model hands the chip's roofline."""
  (layout, m, k, n, g, (bm, bk, bn)), expected = _COST_CASES[name]
  lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct(_rhs_shape(layout, m, k, n, g), jnp.bfloat16)
  record = jax.eval_shape(
    lambda a, b: spec.canonicalize(
      a,
      b,
      jnp.zeros(g, jnp.int32),
      spec.dimension_numbers(layout),
      preferred_element_type=jnp.float32,
    ),
    lhs,
    rhs,
  )
  config = mosaic_tpu.MosaicTpuRaggedDotConfig(block_m=bm, block_k=bk, block_n=bn)
  mosaic_tpu.estimated_seconds(record, config)
  assert roofline_calls == [(*expected, 2)]


@pytest.mark.parametrize("device_kind", ["TPU v5 lite", "TPU v5"])
@pytest.mark.parametrize("layout", spec.LAYOUTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(("m", "k", "n", "g"), [(16384, 4096, 2048, 8), (32768, 7168, 2048, 64)])
def test_heuristic_blocks_fit_vmem(device_kind, layout, dtype, m, k, n, g):
  op = mosaic_tpu.MosaicTpuRaggedDot()
  lhs = jax.ShapeDtypeStruct((m, k), dtype)
  rhs = jax.ShapeDtypeStruct(_rhs_shape(layout, m, k, n, g), dtype)
  record = jax.eval_shape(
    lambda a, b: spec.canonicalize(a, b, jnp.zeros(g, jnp.int32), spec.dimension_numbers(layout)),
    lhs,
    rhs,
  )
  with export.abstract_tpu(device_kind):
    chip = tpu.chip()
    config = op._get_heuristics_config(record)
    assert mosaic_tpu.config_reason(record, config) is None
    assert op._bwd_unsupported_reason(record) is None
    assert mosaic_tpu.vmem_bytes(record, config) <= chip.vmem_limit_bytes
    # The chosen blocks are the cost model's best among those that fit.
    best = min(
      mosaic_tpu.estimated_seconds(record, c)
      for c in mosaic_tpu._candidates(record)
      if mosaic_tpu.config_reason(record, c) is None
    )
    assert mosaic_tpu.estimated_seconds(record, config) == best
    # Large shapes get blocks of at least 256 x 256 (few grid steps).
    assert config.block_k * config.block_n >= 256 * 256
  assert chip.name == ("v5e" if device_kind == "TPU v5 lite" else "v5p")


@pytest.mark.parametrize(("dtype", "m", "block_m"), [("float32", 12, 16), ("bfloat16", 40, 48)])
def test_heuristic_blocks_of_fewer_rows_than_a_block(dtype, m, block_m):
  """M under 128 rows with K = 64: the one candidate is the rows padded to whole sublanes
  (8 for float32, 16 for bfloat16), all of K (no multiple of 128 divides it) and all of N;
  the call runs in the kernel with it and matches the reference."""
  k, n = 64, 128
  rng = np.random.default_rng(m)
  sizes = jnp.array([m // 3, 0, m - m // 3 - 2], jnp.int32)  # The last 2 rows in no group.
  lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
  rhs = jnp.asarray(rng.standard_normal((3, k, n)), dtype)
  impl = mosaic_tpu.MosaicTpuRaggedDot(interpret=True)
  record = spec.canonicalize(lhs, rhs, sizes)
  config = impl._get_heuristics_config(record)
  assert config == mosaic_tpu.MosaicTpuRaggedDotConfig(block_m=block_m, block_k=k, block_n=n)
  assert impl._unsupported_reason(record) is None
  out = api.ragged_dot(lhs, rhs, sizes, implementation=impl)
  ref = references.high_precision(references.ragged_dot_general)(lhs, rhs, sizes, spec.DEFAULT)
  assert compare.relative_error(out, ref) < _BOUND[dtype]


def test_autotuning_configs_are_the_eight_best_that_fit():
  """Autotuning times the cost model's eight best blocks (of many that fit), each one that
  `config_reason` accepts, the heuristic's among them."""
  args = jax.eval_shape(
    spec.canonicalize,
    jax.ShapeDtypeStruct((8192, 2048), jnp.bfloat16),
    jax.ShapeDtypeStruct((8, 2048, 4096), jnp.bfloat16),
    jax.ShapeDtypeStruct((8,), jnp.int32),
  )
  op = mosaic_tpu.MosaicTpuRaggedDot()
  with export.abstract_tpu():
    configs = op._get_autotuning_configs(args)
    fitting = [c for c in mosaic_tpu._candidates(args) if mosaic_tpu.config_reason(args, c) is None]
    assert len(fitting) > 8
    assert len(configs) == 8
    assert all(mosaic_tpu.config_reason(args, c) is None for c in configs)
    assert op._get_heuristics_config(args) in configs


def test_kernel_refuses_a_contraction_block_that_does_not_divide_k():
  lhs, rhs = jnp.ones((16, 256), jnp.float32), jnp.ones((2, 256, 128), jnp.float32)
  starts, ends = jnp.array([0, 8], jnp.int32), jnp.array([8, 16], jnp.int32)
  with pytest.raises(ValueError, match="block_k=96 must divide K=256"):
    mosaic_tpu_kernel.grouped_matmul(
      lhs,
      rhs,
      starts,
      ends,
      transpose_rhs=False,
      out_dtype=jnp.float32,
      precision=None,
      block_m=8,
      block_k=96,
      block_n=128,
      vmem_limit_bytes=tpu.V5E.vmem_limit_bytes,
      interpret=pltpu.InterpretParams(),
    )


def test_heuristic_blocks_of_fewer_contracted_rows_than_a_block():
  """ "ragged_contracting" with M=40 rows: the one row candidate is M padded to whole 128 lanes
  (the rows are lanes of the transposed lhs), with all of K=64 and N=128; the call runs with
  these blocks and matches the reference."""
  m, k, n = 40, 64, 128
  rng = np.random.default_rng(21)
  sizes = jnp.array([11, 0, 25], jnp.int32)  # The last 4 rows are in no group.
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  dims = spec.dimension_numbers(spec.RAGGED_CONTRACTING)
  impl = mosaic_tpu.MosaicTpuRaggedDot(interpret=True)
  config = impl._get_heuristics_config(spec.canonicalize(lhs, rhs, sizes, dims))
  assert config == mosaic_tpu.MosaicTpuRaggedDotConfig(block_m=128, block_k=k, block_n=n)
  out = api.ragged_dot_general(lhs, rhs, sizes, dims, implementation=impl)
  ref = references.high_precision(references.ragged_dot_general)(
    lhs, rhs, sizes, spec.RAGGED_CONTRACTING
  )
  assert compare.relative_error(out, ref) < _BOUND["float32"]


def test_interpret_params_are_the_callers():
  """`interpret=True` takes the default interpreter params; params passed are kept."""
  assert mosaic_tpu.MosaicTpuRaggedDot().interpret_params is None
  default = mosaic_tpu.MosaicTpuRaggedDot(interpret=True).interpret_params
  assert isinstance(default, pltpu.InterpretParams)
  custom = pltpu.InterpretParams(dma_execution_mode="eager", detect_races=True)
  assert custom != pltpu.InterpretParams()
  assert mosaic_tpu.MosaicTpuRaggedDot(interpret=custom).interpret_params is custom


def test_chip_roofline_seconds():
  """The slower of MXU and HBM plus a fixed cost per grid step; float32 takes three MXU
  passes. The chips by device kind: "TPU v5" and "v5p" are v5p, the rest v5e."""
  chip = tpu.V5E
  flops, hbm = chip.bf16_flops_per_s, chip.hbm_bytes_per_s  # One second of each.
  assert chip.seconds(flops, 0.5 * hbm, 0, 2) == pytest.approx(1.0)
  assert chip.seconds(0.5 * flops, hbm, 0, 2) == pytest.approx(1.0)
  assert chip.seconds(flops, 0.5 * hbm, 0, 4) == pytest.approx(3.0)
  assert chip.seconds(flops, 0.5 * hbm, 0, 1) == pytest.approx(1.0)
  assert chip.seconds(0, 0, 1000, 2) == pytest.approx(1000 * tpu.STEP_OVERHEAD_S)
  assert chip.seconds(flops, 0, 10, 2) == pytest.approx(1.0 + 10 * tpu.STEP_OVERHEAD_S)
  for kind, want in (("TPU v5", tpu.V5P), ("TPU v5p", tpu.V5P), ("TPU v5 lite", tpu.V5E)):
    assert tpu.chip(kind) is want, kind


def test_chips_vmem_is_jaxs_figure_and_the_limit_half_of_it():
  """Each chip's physical VMEM is the figure of Pallas's TPU info for that generation, and the
  scoped limit kernels fit in is half of it (`tpu.Chip`)."""
  for chip, version in (
    (tpu.V5E, tpu_info.ChipVersion.TPU_V5E),
    (tpu.V5P, tpu_info.ChipVersion.TPU_V5P),
  ):
    assert chip.vmem_bytes == pltpu.get_tpu_info_for_chip(version, 1).vmem_capacity_bytes, chip
    assert chip.vmem_limit_bytes == chip.vmem_bytes // 2, chip


def test_vmem_limit_is_the_target_chips():
  lhs = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((4, 4096, 4096), jnp.bfloat16)
  record = jax.eval_shape(lambda a, b: spec.canonicalize(a, b, jnp.zeros(4, jnp.int32)), lhs, rhs)
  config = mosaic_tpu.MosaicTpuRaggedDotConfig(block_m=1024, block_k=2048, block_n=2048)
  assert mosaic_tpu.vmem_bytes(record, config) == 48 << 20
  with export.abstract_tpu("TPU v5 lite"):  # 64 MiB of v5e's 128 MiB.
    assert mosaic_tpu.config_reason(record, config) is None
  with export.abstract_tpu("TPU v5"):  # 32 MiB of v5p's 64 MiB.
    assert "over the 33554432 used on v5p" in mosaic_tpu.config_reason(record, config)


def test_cost_model_prefers_large_blocks_and_counts_vmem():
  lhs = jax.ShapeDtypeStruct((8192, 1024), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((8, 1024, 1024), jnp.bfloat16)
  record = jax.eval_shape(lambda a, b: spec.canonicalize(a, b, jnp.zeros(8, jnp.int32)), lhs, rhs)
  small = mosaic_tpu.MosaicTpuRaggedDotConfig()
  large = dataclasses.replace(small, block_m=512, block_k=1024, block_n=512)
  with export.abstract_tpu():
    assert mosaic_tpu.estimated_seconds(record, large) < mosaic_tpu.estimated_seconds(record, small)
  # Double-buffered bf16 blocks, double-buffered output, float32 accumulator and values.
  expected = 2 * (128 * 128 * 2) * 2 + 2 * 128 * 128 * 2 + 4 * 128 * 128 * 2
  assert mosaic_tpu.vmem_bytes(record, small) == expected


def test_unsupported_reasons_at_the_edges():
  """Mosaic's tiling: row blocks of 8 sublanes for float32 and 16 for bfloat16, 128 rows for
  "ragged_contracting" (they are the lanes of the transposed lhs); block_k dividing K."""

  def reason(layout, dtype, m=256, k=384, n=256, **config):
    lhs = jax.ShapeDtypeStruct((m, k), dtype)
    rhs = jax.ShapeDtypeStruct(_rhs_shape(layout, m, k, n, 2), dtype)
    record = jax.eval_shape(
      lambda a, b: spec.canonicalize(
        a, b, jnp.array([100, 156], jnp.int32), spec.dimension_numbers(layout)
      ),
      lhs,
      rhs,
    )
    config = mosaic_tpu.MosaicTpuRaggedDotConfig(**{"block_k": 128, **config})
    with export.abstract_tpu():
      return mosaic_tpu.config_reason(record, config)

  assert reason(spec.DEFAULT, "float32", block_m=8) is None
  assert "block_m=8 must be a multiple of 16" in reason(spec.DEFAULT, "bfloat16", block_m=8)
  assert reason(spec.DEFAULT, "bfloat16", block_m=16) is None
  assert "block_m=64 must be a multiple of 128" in reason(
    spec.RAGGED_CONTRACTING, "float32", block_m=64
  )
  assert reason(spec.RAGGED_CONTRACTING, "float32", block_m=256) is None
  # K=384: 128 divides it, 256 (a multiple of 128, at most K) does not.
  assert reason(spec.DEFAULT, "float32", block_k=384) is None
  assert "block_k=256 must divide K=384" in reason(spec.DEFAULT, "float32", block_k=256)
  assert "block_k=256 must divide K=384" in reason(spec.RHS_TRANSPOSED, "float32", block_k=256)
  # 192 divides K=384 but is no multiple of 128 (lanes).
  assert "block_k=192 must be a multiple of 128" in reason(spec.DEFAULT, "float32", block_k=192)


def test_target_device_kind_is_a_tpus_only():
  """The target is the abstract mesh's TPU, else a TPU at hand: none on a CPU or GPU host
  (whose chip is then v5e)."""
  if jax.devices()[0].platform == "tpu":
    pytest.skip("a TPU at hand is the target")
  assert tpu.target_device_kind() is None
  assert tpu.chip() is tpu.V5E
  with export.abstract_tpu("TPU v5"):
    assert tpu.target_device_kind() == "TPU v5"
    assert tpu.chip() is tpu.V5P


@pytest.mark.parametrize("layout", [spec.DEFAULT, spec.RHS_TRANSPOSED])
def test_groups_that_fill_every_row(layout):
  """Groups that cover all M rows (no zero segment after them): the work list's dead items
  repeat the last group's item and must leave its rows as that item stored them."""
  m, k, n = 40, 128, 128
  rng = np.random.default_rng(7)
  sizes = jnp.array([10, 0, 30], jnp.int32)
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal(_rhs_shape(layout, m, k, n, 3)), jnp.float32)
  config = mosaic_tpu.MosaicTpuRaggedDotConfig(block_m=16, block_k=128, block_n=128)
  impl = mosaic_tpu.MosaicTpuRaggedDot(interpret=True, config=config)
  out = spec.SPEC(lhs, rhs, sizes, spec.dimension_numbers(layout), implementation=impl)
  ref = references.high_precision(references.ragged_dot_general)(lhs, rhs, sizes, layout)
  assert compare.relative_error(out, ref) < _BOUND["float32"]
  assert np.all(np.asarray(out)[30:] != 0)


def test_contracting_vmem_counts_the_masked_and_transposed_operands():
  """ragged_contracting: double-buffered lhs [bm, bk] and rhs [bm, bn] blocks and output
  [bk, bn] block, the float32 accumulator, and float32 temporaries: both masked operands and
  the transposed lhs."""
  lhs = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)
  dims = spec.dimension_numbers(spec.RAGGED_CONTRACTING)
  record = jax.eval_shape(
    lambda a, b: spec.canonicalize(a, b, jnp.zeros(4, jnp.int32), dims), lhs, rhs
  )
  assert record.out_dtype == jnp.bfloat16
  config = mosaic_tpu.MosaicTpuRaggedDotConfig(block_m=512, block_k=256, block_n=1024)
  blocks = 2 * 512 * (256 + 1024) * 2 + 2 * 256 * 1024 * 2
  temps = 4 * 256 * 1024 + 4 * 512 * (256 + 1024) + 4 * 512 * 256
  assert mosaic_tpu.vmem_bytes(record, config) == blocks + temps == 7.5 * (1 << 20)


def test_contracting_output_tiles_past_k_and_n():
  """ "ragged_contracting" with K=200 and N=136 in 128-wide output tiles: the last row tile
  and column tile of every group's [K, N] output are partial (72 and 8 wide) and must still be
  computed and stored. The reference is numpy in float64, group by group."""
  m, k, n = 300, 200, 136
  rng = np.random.default_rng(31)
  sizes = np.array([70, 0, 150, 60], np.int32)  # The last 20 rows are in no group.
  lhs = rng.standard_normal((m, k)).astype(np.float32)
  rhs = rng.standard_normal((m, n)).astype(np.float32)
  config = mosaic_tpu.MosaicTpuRaggedDotConfig(block_m=128, block_k=128, block_n=128)
  impl = mosaic_tpu.MosaicTpuRaggedDot(interpret=True, config=config)
  dims = spec.dimension_numbers(spec.RAGGED_CONTRACTING)
  out = api.ragged_dot_general(
    jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes), dims, implementation=impl
  )
  ends = np.cumsum(sizes)
  starts = ends - sizes
  want = np.stack(
    [lhs[a:b].astype(np.float64).T @ rhs[a:b] for a, b in zip(starts, ends, strict=True)]
  )
  assert out.shape == (4, k, n)
  assert np.all(np.asarray(out)[1] == 0)  # The empty group.
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", [spec.DEFAULT, spec.RHS_TRANSPOSED])
def test_vmem_counts_blocks_of_three_sizes(layout):
  """Row-ragged layouts with block_m, block_k and block_n all different (64, 256, 512), bfloat16
  in and float32 out: double-buffered lhs [block_m, block_k] and rhs [block_k, block_n] blocks,
  double-buffered output [block_m, block_n], its float32 accumulator and the float32 masked
  output values."""
  m, k, n, g = 1024, 512, 1024, 4
  record = jax.eval_shape(
    lambda a, b: spec.canonicalize(
      a,
      b,
      jnp.zeros(g, jnp.int32),
      spec.dimension_numbers(layout),
      preferred_element_type=jnp.float32,
    ),
    jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
    jax.ShapeDtypeStruct(_rhs_shape(layout, m, k, n, g), jnp.bfloat16),
  )
  assert record.out_dtype == jnp.float32
  bm, bk, bn = 64, 256, 512
  config = mosaic_tpu.MosaicTpuRaggedDotConfig(block_m=bm, block_k=bk, block_n=bn)
  blocks = 2 * (bm * bk + bk * bn) * 2 + 2 * bm * bn * 4
  accumulator, values = 4 * bm * bn, 4 * bm * bn
  assert mosaic_tpu.vmem_bytes(record, config) == blocks + accumulator + values


def test_a_fixed_config_that_fits_every_gradient_is_theirs():
  """A fixed config (as autotuning picks one) that fits the forward and both gradients' calls
  is the config of all three, not only of the forward: the gradients do not fall back to the
  cost model's blocks, which differ here."""
  lhs = jax.ShapeDtypeStruct((512, 256), jnp.float32)
  rhs = jax.ShapeDtypeStruct((2, 256, 256), jnp.float32)
  args = jax.eval_shape(
    lambda a, b: spec.canonicalize(a, b, jnp.array([200, 312], jnp.int32)), lhs, rhs
  )
  config = mosaic_tpu.MosaicTpuRaggedDotConfig(block_m=256, block_k=128, block_n=128)
  impl = mosaic_tpu.MosaicTpuRaggedDot(interpret=True, config=config)
  records = []

  def capture(record):
    records.append(record)
    return jnp.zeros(record.out_shape, record.out_dtype)

  jax.eval_shape(
    lambda dout: spec.gradients(args, dout, capture),
    jax.ShapeDtypeStruct(args.out_shape, jnp.float32),
  )
  assert sorted(r.layout for r in records) == [spec.RAGGED_CONTRACTING, spec.RHS_TRANSPOSED]
  heuristic = mosaic_tpu.MosaicTpuRaggedDot(interpret=True)
  for record in records:
    assert mosaic_tpu.config_reason(record, config) is None, record.layout
    assert heuristic._get_heuristics_config(record) != config, record.layout
    assert impl._gradient_config(record) == config, record.layout


def _check_transposed(lhs, rhs, starts, ends, block_m):
  """The interpreted transposed grouped matmul against float64 per-group products."""
  out = mosaic_tpu_kernel.transposed_grouped_matmul(
    jnp.asarray(lhs),
    jnp.asarray(rhs),
    jnp.asarray(starts),
    jnp.asarray(ends),
    out_dtype=jnp.float32,
    precision=jax.lax.Precision.HIGHEST,
    block_m=block_m,
    block_k=128,
    block_n=128,
    vmem_limit_bytes=tpu.V5E.vmem_limit_bytes,
    interpret=pltpu.InterpretParams(),
  )
  want = np.stack(
    [lhs[a:b].astype(np.float64).T @ rhs[a:b] for a, b in zip(starts, ends, strict=True)]
  )
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4)


def test_transposed_dead_items_do_nothing(monkeypatch):
  """The module docstring: work items past the real ones are dead and do nothing. With 300
  rows in three 128-row tiles and two groups inside the first tile (rows 0-80), the list has
  two real items and two dead ones; the dead ones must neither run a matmul (the kernel runs
  one where the row range is nonempty, or where it holds the whole tile) nor store, and keep
  the last real item's tile and group (no new DMA). The output is checked against numpy too."""
  calls = []
  pallas_call = mosaic_tpu_kernel.pl.pallas_call

  def recording(kernel, **kwargs):
    run = pallas_call(kernel, **kwargs)

    def call(*operands):
      calls.append([np.asarray(x) for x in operands[:6]])
      return run(*operands)

    return call

  monkeypatch.setattr(mosaic_tpu_kernel.pl, "pallas_call", recording)
  m, k, n, block_m = 300, 128, 128, 128
  rng = np.random.default_rng(41)
  lhs = rng.standard_normal((m, k)).astype(np.float32)
  rhs = rng.standard_normal((m, n)).astype(np.float32)
  starts, ends = np.array([0, 30], np.int32), np.array([30, 80], np.int32)
  _check_transposed(lhs, rhs, starts, ends, block_m)
  ((tile, group, start, end, first, last),) = calls
  assert len(tile) == 3 + 2 - 1  # Row tiles + groups - 1.
  assert tile[:2].tolist() == [0, 0] and group[:2].tolist() == [0, 1]
  dead = slice(2, None)
  row0 = tile[dead] * block_m
  whole = (start[dead] <= row0) & (row0 + block_m <= end[dead])
  assert not np.any(whole | (start[dead] < end[dead])), (start, end)  # No matmul.
  assert np.all(last[dead] == 0) and np.all(first[dead] == 0)  # No store, no zeroing.
  assert np.all(tile[dead] == tile[1]) and np.all(group[dead] == group[1])


def _check_transposed_spying(monkeypatch, lax_name, on_run, starts, ends, seed):
  """`_check_transposed` on 300 random rows of 128-row tiles, with the kernel's
  `lax.<lax_name>` calling `on_run()` (which adds a host callback) where it runs."""

  class SpyingLax:
    def __getattr__(self, name):
      return getattr(jax.lax, name)

  def spied(*args, **kwargs):
    on_run()
    return getattr(jax.lax, lax_name)(*args, **kwargs)

  spying = SpyingLax()
  setattr(spying, lax_name, spied)
  monkeypatch.setattr(mosaic_tpu_kernel, "lax", spying)
  m, k, n = 300, 128, 128
  rng = np.random.default_rng(seed)
  lhs = rng.standard_normal((m, k)).astype(np.float32)
  rhs = rng.standard_normal((m, n)).astype(np.float32)
  _check_transposed(lhs, rhs, np.array(starts, np.int32), np.array(ends, np.int32), 128)
  jax.effects_barrier()


def test_transposed_matmuls_only_where_a_group_has_rows(monkeypatch):
  """The module docstring: dead items do nothing, and an empty group's item only stores zeros.
  Groups [0, 30), [30, 80) and an empty one at 80 in 300 rows of 128-row tiles: five items
  (three real, two dead), of which only the two nonempty groups' items may run the kernel's
  matmul. Each matmul the interpreter runs is counted."""
  runs = []
  on_run = lambda: jax.debug.callback(lambda: runs.append(1))
  _check_transposed_spying(monkeypatch, "dot_general", on_run, [0, 30, 80], [30, 80, 80], 43)
  assert len(runs) == 2


def test_transposed_masks_only_tiles_a_group_covers_in_part(monkeypatch):
  """The module docstring: a tile inside the group is used as it is. Groups [0, 128),
  [128, 256) and [256, 300) in 300 rows of 128-row tiles: the first two items hold whole
  tiles (a group ending on a tile's last row included); only the third masks its rows. The
  item of each masking run (its row iota) is recorded."""
  masked = set()
  item = mosaic_tpu_kernel.pl.program_id
  on_run = lambda: jax.debug.callback(lambda i: masked.add(int(i)), item(2))
  starts, ends = [0, 128, 256], [128, 256, 300]
  _check_transposed_spying(monkeypatch, "broadcasted_iota", on_run, starts, ends, 47)
  assert masked == {2}
