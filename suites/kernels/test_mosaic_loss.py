"""Mosaic GPU linear_softmax_cross_entropy_loss on CPU: the fused log-sum-exp kernel in the
Pallas GPU interpreter (with race detection) on small odd shapes, the support checks, and
CUDA lowering of the heuristic and tuning configs at the benchmark shapes. Compiled numerics
and timings: the h100 matrix and `python -m bench.run --ops linear_softmax_cross_entropy_loss`.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental.pallas import mosaic_gpu as plgpu

from suites import opdb
from tokamax._src.ops import partitioning
from tokamax._src.ops.linear_softmax_cross_entropy_loss import api, mosaic, mosaic_kernel, spec
from tokamax_harness import compare, references

pytestmark = pytest.mark.op("linear_softmax_cross_entropy_loss", "mosaic")

SMALL = mosaic.MosaicLossConfig(block_n=128, num_stages=2, grid_tile_m=2)


def _inputs(b, h, v, seed=0, scale=1.0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((b, h)) * scale, jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((h, v)) / np.sqrt(h), jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, v, b), jnp.int32)
  return x, labels, w


def _check_none_reduction_vjp(impl, x, labels, w, ct_seed):
  """The per-row losses and both gradients of a random cotangent against the reference."""

  def fn(x, w):
    return api.linear_softmax_cross_entropy_loss(
      x, labels, w, reduction="none", implementation=impl
    )

  out, vjp = jax.vjp(fn, x, w)
  ct = jnp.asarray(np.random.default_rng(ct_seed).standard_normal(x.shape[0]), jnp.float32)
  dx, dw = vjp(ct)
  ref, (ref_dx, ref_dw) = references.high_precision_vjp(
    lambda a, c: references.linear_softmax_cross_entropy_loss(a, labels, c, reduction="none"),
    (x, w),
    ct,
  )
  assert out.shape == (x.shape[0],) and out.dtype == jnp.float32
  assert compare.relative_error(out, ref) < 1e-4
  assert compare.relative_error(dx, ref_dx) < 1e-2
  assert compare.relative_error(dw, ref_dw) < 1e-2


@pytest.mark.parametrize(
  ("b", "h", "v", "scale"),
  [
    (200, 128, 300, 1.0),  # Two row tiles, the second partial; two vocabulary tiles + 44.
    (7, 128, 256, 1.0),  # One partial row tile; exactly two tiles, no tail.
    (130, 256, 385, 30.0),  # Logits in the hundreds: the tile maxima must be kept.
  ],
)
@pytest.mark.host_only
def test_interpret_matches_reference_with_gradients(b, h, v, scale, capfd):
  x, labels, w = _inputs(b, h, v, seed=b + v, scale=scale)
  _check_none_reduction_vjp(mosaic.MosaicLoss(interpret=True, config=SMALL), x, labels, w, 1)
  assert not interpret_pallas_call.get_races().races_found
  assert "RACE DETECTED" not in capfd.readouterr().out


@pytest.mark.host_only
def test_the_kernel_alone_gives_each_tiles_logsumexp_and_label_logit():
  x, labels, w = _inputs(130, 128, 512)
  # Labels in each of the three kernel tiles, in the tail the kernel leaves to XLA (>= 384),
  # outside the weights (another vocabulary shard's), and -1 on the padding rows.
  labels = labels.at[:4].set(jnp.array([0, 383, 400, -5])).at[4].set(600)
  config = mosaic.mosaic_kernel.MosaicLossKernelConfig(block_n=128, num_stages=2, grid_tile_m=2)
  padded = jnp.pad(x, ((0, 126), (0, 0)))
  padded_labels = jnp.pad(labels, (0, 126), constant_values=-1)
  lse, picked = mosaic.mosaic_kernel.tile_stats(
    padded,
    w,
    padded_labels,
    n_tiles=3,
    config=config,
    num_sms=2,
    # Three items per CTA: each item's statistics wait out the previous item's stores.
    interpret=plgpu.InterpretGPUParams(detect_races=True),
  )
  assert not interpret_pallas_call.get_races().races_found
  logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  tiles = logits[:, :384].reshape(130, 3, 128)
  top = tiles.max(-1, keepdims=True)
  want = (top[..., 0] + np.log(np.exp(tiles - top).sum(-1))).T
  np.testing.assert_allclose(np.asarray(lse)[:, :130], want, rtol=1e-5, atol=1e-5)
  want_picked = np.zeros((3, 130))
  for row, label in enumerate(np.asarray(labels)):
    if 0 <= label < 384:
      want_picked[label // 128, row] = logits[row, label]
  np.testing.assert_allclose(np.asarray(picked)[:, :130], want_picked, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(picked)[:, 130:] == 0)


@pytest.mark.host_only
def test_the_kernel_searches_labels_where_each_warpgroups_own_rows_have_them():
  """Each 64-row warpgroup's labels in one tile of its own (tiles 0, 1, 2, 1 for the four
  groups), so the flags that skip the label search differ from group to group (random labels
  flag every tile of every group): each warpgroup reads its own rows' flags, and every row's
  label logit comes out, against float64."""
  x, _, w = _inputs(256, 128, 384, seed=11)
  rng = np.random.default_rng(11)
  tile_of_group = np.array([0, 1, 2, 1])
  labels = np.repeat(tile_of_group, 64) * 128 + rng.integers(0, 128, 256)
  config = mosaic.mosaic_kernel.MosaicLossKernelConfig(block_n=128, num_stages=2, grid_tile_m=2)
  lse, picked = mosaic.mosaic_kernel.tile_stats(
    x,
    w,
    jnp.asarray(labels, jnp.int32),
    n_tiles=3,
    config=config,
    num_sms=2,
    interpret=plgpu.InterpretGPUParams(),
  )
  logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  tiles = logits.reshape(256, 3, 128)
  top = tiles.max(-1, keepdims=True)
  want_lse = (top[..., 0] + np.log(np.exp(tiles - top).sum(-1))).T
  np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)
  want_picked = np.zeros((3, 256))
  want_picked[labels // 128, np.arange(256)] = logits[np.arange(256), labels]
  np.testing.assert_allclose(np.asarray(picked), want_picked, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  ("b", "h", "v"), [(8192, 4096, 131072), (4096, 4096, 256000), (512, 256, 50257)]
)
def test_heuristic_and_tuning_configs_run_and_lower_for_cuda_at_benchmark_shapes(b, h, v):
  shapes = (
    jax.ShapeDtypeStruct((b, h), jnp.bfloat16),
    jax.ShapeDtypeStruct((b,), jnp.int32),
    jax.ShapeDtypeStruct((h, v), jnp.bfloat16),
  )
  op = mosaic.MosaicLoss()
  record = jax.eval_shape(lambda *a: spec.canonicalize(*a), *shapes)
  assert op._unsupported_reason(record) is None  # The shape; the platform is not a GPU here.
  configs = op._get_autotuning_configs(record)
  assert op._get_heuristics_config(record) in configs and len(configs) > 1

  def fn(x, labels, w):
    args = spec.canonicalize(x, labels, w, reduction="mean")
    return [op._fwd(args, c)[0] for c in configs]

  text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= len(configs)


@pytest.mark.parametrize(("h", "v"), [(128, 192), (128, 512), (192, 300), (256, 192)])
def test_heuristic_and_tuning_configs_serve_every_shape_a_small_config_serves(h, v):
  """H of two to four 64-column blocks, V under two 256-column tiles: shapes that 2 stages
  of 128-column tiles serve. The heuristic config serves them too, and every autotuning
  candidate that is offered serves them."""
  x, labels, w = _inputs(16, h, v)
  record = spec.canonicalize(x, labels, w)
  small = mosaic.MosaicLossConfig(block_n=128, num_stages=2)
  assert mosaic.MosaicLoss(config=small)._unsupported_reason(record) is None
  op = mosaic.MosaicLoss()
  assert op._unsupported_reason(record) is None, op._get_heuristics_config(record)
  configs = op._get_autotuning_configs(record)
  assert configs
  for config in configs:
    assert op.with_config(config)._unsupported_reason(record) is None, config


def test_label_tiles_flag_each_warpgroups_rows_and_tile():
  labels = jnp.full((256,), -1, jnp.int32).at[3].set(130).at[70].set(5).at[200].set(999)
  flags = np.asarray(mosaic_kernel.label_tiles(labels, n_tiles=3, block_n=128))
  want = np.zeros((4, 3), np.int32)
  want[0, 1] = want[1, 0] = 1  # Row 3 -> tile 1; row 70 (second group) -> tile 0; 999: none.
  np.testing.assert_array_equal(flags, want)


@pytest.mark.parametrize("seed", range(3))
def test_label_tiles_against_a_brute_force_table(seed):
  """Sparse random labels (the others -1), with the edge columns 0 and n_tiles * block_n - 1
  and the first columns past the tiles and before them (-1) in each warpgroup's rows: a
  warpgroup's flag is set exactly where one of its rows has a label in the tile."""
  rng = np.random.default_rng(seed)
  b, n_tiles, block_n = 320, 3, 128
  labels = np.where(rng.random(b) < 0.02, rng.integers(0, n_tiles * block_n, b), -1)
  edges = [0, n_tiles * block_n - 1, n_tiles * block_n, -1]
  for group in range(b // 64):
    labels[group * 64 + rng.integers(0, 64)] = edges[(group + seed) % len(edges)]
  flags = np.asarray(mosaic_kernel.label_tiles(jnp.asarray(labels, jnp.int32), n_tiles, block_n))
  want = np.zeros((b // 64, n_tiles), np.int32)
  for row, label in enumerate(labels):
    if 0 <= label < n_tiles * block_n:
      want[row // 64, label // block_n] = 1
  np.testing.assert_array_equal(flags, want)


def test_shared_memory_bytes():
  """The kernel's shared memory counted by hand: per stage an x tile [block_m, block_k] and a
  weight tile [block_k, block_n]; per compute warpgroup the float32 statistics rows (the
  log-sum-exp and the label logit, and the maximum with the exponentials) and, with the
  exponentials, their [64, 128] store slot and 2 KiB of alignment."""
  config = mosaic_kernel.MosaicLossKernelConfig(block_n=256, block_k=64, num_stages=4)
  stats, with_probs = 2 * 64 * 4, 3 * 64 * 4 + 64 * 128 * 2 + 2048
  assert mosaic_kernel.epilogue_bytes(2, False) == stats
  assert mosaic_kernel.epilogue_bytes(2, True) == with_probs
  stages = 4 * (128 * 64 + 64 * 256) * 2
  assert mosaic_kernel.smem_bytes(config, 2, stats) == stages + 2 * stats
  assert mosaic_kernel.smem_bytes(config, 2, with_probs) == stages + 2 * with_probs


def test_unsupported_reasons_name_the_limit():
  op = mosaic.MosaicLoss(interpret=True)
  x, labels, w = _inputs(16, 128, 256)
  with pytest.raises(NotImplementedError, match="dtype float32"):
    op(x.astype(jnp.float32), labels, w.astype(jnp.float32))
  with pytest.raises(NotImplementedError, match="H=96"):
    op(x[:, :96], labels, w[:96])
  with pytest.raises(NotImplementedError, match="V=100"):
    op(x, jnp.zeros_like(labels), w[:, :100])
  # Listed after an implementation that cannot serve the call, XLA does.
  out = api.linear_softmax_cross_entropy_loss(
    x, jnp.zeros_like(labels), w[:, :100], implementation=[op, "xla"]
  )
  assert out.shape == ()


def test_kernel_config_reason_takes_exactly_num_stages_blocks():
  """H of exactly num_stages blocks of block_k fills the pipeline; one block fewer does not."""
  config = mosaic_kernel.MosaicLossKernelConfig(block_n=128, block_k=64, num_stages=4)
  assert mosaic_kernel.config_reason(config, 256, 2) is None
  assert mosaic_kernel.config_reason(config, 512, 2) is None
  reason = mosaic_kernel.config_reason(config, 192, 2)
  assert reason is not None and "num_stages" in reason
  # One stage cannot serve: each warpgroup holds a stage while its wgmma is in flight.
  single = mosaic_kernel.MosaicLossKernelConfig(block_n=128, block_k=64, num_stages=1)
  assert "num_stages=1" in mosaic_kernel.config_reason(single, 256, 2)
  # H in whole blocks of block_k, even where it holds num_stages of them (160 = 2.5 blocks).
  two = dataclasses.replace(config, num_stages=2)
  assert mosaic_kernel.config_reason(two, 192, 2) is None
  reason = mosaic_kernel.config_reason(two, 160, 2)
  assert reason is not None and "multiple of block_k" in reason, reason
  # Through the op: H=128 (two blocks of 64) runs with two stages, not three.
  x, labels, w = _inputs(16, 128, 256)
  record = spec.canonicalize(x, labels, w)
  assert (
    mosaic.MosaicLoss(config=mosaic.MosaicLossConfig(num_stages=2))._unsupported_reason(record)
    is None
  )
  reason = mosaic.MosaicLoss(config=mosaic.MosaicLossConfig(num_stages=3))._unsupported_reason(
    record
  )
  assert reason is not None and "num_stages" in reason


def test_kernel_config_reason_names_wgmma_tiles():
  """wgmma takes a contraction depth of exactly 128 bytes (64 bfloat16, 32 float32) and
  block_n a multiple of 64 up to 256: other tiles are refused, naming the field."""
  config = mosaic_kernel.MosaicLossKernelConfig
  assert mosaic_kernel.config_reason(config(block_n=128, block_k=64, num_stages=2), 256, 2) is None
  assert mosaic_kernel.config_reason(config(block_n=192, block_k=32, num_stages=2), 256, 4) is None
  for bad, what in (
    (dict(block_n=128, block_k=32), "block_k=32"),
    (dict(block_n=128, block_k=128), "block_k=128"),
    (dict(block_n=320, block_k=64), "block_n=320"),
    (dict(block_n=96, block_k=64), "block_n=96"),
  ):
    reason = mosaic_kernel.config_reason(config(num_stages=2, **bad), 256, 2)
    assert reason is not None and what in reason, (bad, reason)


@pytest.mark.host_only
def test_the_kernel_gives_each_tiles_maxima_and_exponentials_for_the_gradient():
  # Tiles of 256 columns: two 128-column stores of the exponentials per tile; a 64-column tail.
  x, labels, w = _inputs(128, 128, 576, seed=3, scale=3.0)
  config = mosaic.mosaic_kernel.MosaicLossKernelConfig(block_n=256, num_stages=2, grid_tile_m=2)
  lse, picked, top, probs = mosaic.mosaic_kernel.tile_stats(
    x,
    w,
    labels,
    n_tiles=2,
    config=config,
    num_sms=2,
    probabilities=True,
    interpret=plgpu.InterpretGPUParams(detect_races=True),
  )
  assert not interpret_pallas_call.get_races().races_found
  assert probs.shape == (128, 576) and probs.dtype == jnp.bfloat16
  logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  tiles = logits[:, :512].reshape(128, 2, 256)
  want_top = tiles.max(-1)
  np.testing.assert_allclose(np.asarray(top), want_top.T, rtol=1e-5, atol=1e-5)
  want_probs = np.exp(tiles - want_top[..., None]).reshape(128, 512)
  np.testing.assert_allclose(np.asarray(probs[:, :512], np.float64), want_probs, atol=4e-3)
  want_lse = want_top + np.log(np.exp(tiles - want_top[..., None]).sum(-1))
  np.testing.assert_allclose(np.asarray(lse), want_lse.T, rtol=1e-5, atol=1e-5)
  assert np.asarray(picked).shape == (2, 128)


def _check_cotangent_kernel(rows: int, v: int, block_n: int, num_sms: int, seed: int, edges=()):
  """`cotangent_in_place` on random exponentials, interpreted with race detection, against
  the float64 formula: each tile's softmax term less the label's `hit` (none at label -1).
  `edges` overwrite the first labels."""
  rng = np.random.default_rng(seed)
  probs = jnp.asarray(rng.uniform(0.0, 1.0, (rows, v)), jnp.bfloat16)
  scale = jnp.asarray(rng.uniform(0.5, 2.0, (-(-v // block_n), rows)), jnp.float32)
  labels = rng.integers(0, v, rows).astype(np.int32)
  labels[: len(edges)] = edges
  hit = jnp.asarray(rng.uniform(0.5, 2.0, rows), jnp.float32)
  out = mosaic_kernel.cotangent_in_place(
    probs,
    scale,
    jnp.asarray(labels),
    hit,
    block_n=block_n,
    num_sms=num_sms,
    interpret=plgpu.InterpretGPUParams(detect_races=True),
  )
  assert not interpret_pallas_call.get_races().races_found
  assert out.shape == probs.shape and out.dtype == jnp.bfloat16
  want = (
    np.asarray(probs, np.float64) * np.repeat(np.asarray(scale, np.float64).T, block_n, 1)[:, :v]
  )
  valid = labels >= 0
  want[np.flatnonzero(valid), labels[valid]] -= np.asarray(hit, np.float64)[valid]
  np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=8e-3, atol=1e-6)


@pytest.mark.host_only
@pytest.mark.parametrize(
  ("v", "block_n", "num_sms"), [(576, 256, 2), (512, 128, 2), (1024, 256, 1)]
)
def test_the_cotangent_kernel_writes_each_tiles_softmax_term_less_the_label(v, block_n, num_sms):
  """576 columns: blocks of 64 and a 64-column tail tile; 512: blocks of 128; 1024 on one SM:
  two column groups of four blocks, more than the three stages (each slot reused). Labels in
  several tiles, on tile edges, and -1 (padding rows: no column)."""
  _check_cotangent_kernel(128, v, block_n, num_sms, seed=7, edges=(-1, 0, block_n - 1, v - 1))


@pytest.mark.host_only
def test_the_cotangent_kernel_takes_more_row_bands_than_its_ctas_target():
  """576 rows (9 bands) on 2 SMs: more bands than the 4 CTAs per SM the grid aims at, so
  each band is one column group of every block; against the float64 formula."""
  _check_cotangent_kernel(576, 256, 128, num_sms=2, seed=9)


@pytest.mark.parametrize(
  ("rows", "v", "block_n"),
  [
    (100, 512, 128),  # Rows not whole 64-row bands: the last band's rows would go unwritten.
    (128, 100, 128),  # Columns not whole 64-column blocks.
    (128, 512, 192),  # 128-column blocks that straddle two 192-column tiles of `scale`.
  ],
)
def test_the_cotangent_kernel_refuses_shapes_that_do_not_tile(rows, v, block_n):
  """`cotangent_in_place` works in 64-row bands and 128- (or 64-) column blocks, each within
  one tile of `scale`; another shape is refused before any kernel runs."""
  rng = np.random.default_rng(3)
  probs = jnp.asarray(rng.uniform(0.0, 1.0, (rows, v)), jnp.bfloat16)
  scale = jnp.asarray(rng.uniform(0.5, 2.0, (-(-v // block_n), rows)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, v, rows), jnp.int32)
  hit = jnp.ones((rows,), jnp.float32)
  with pytest.raises(ValueError, match="must tile"):
    mosaic_kernel.cotangent_in_place(probs, scale, labels, hit, block_n=block_n, num_sms=2)


@pytest.mark.host_only
def test_gradient_in_forward_matches_the_reference_in_every_column(capfd):
  """Peaked logits (scale 3), so that every column's softmax term is well above the bound:
  three row chunks (the last partial), three tiles and a 64-column tail, each compared."""
  b, h, v = 300, 128, 448
  x, labels, w = _inputs(b, h, v, seed=5, scale=3.0)
  config = mosaic.MosaicLossConfig(
    block_n=128, num_stages=2, grid_tile_m=2, gradient_in_forward=True, row_chunks=3
  )
  impl = mosaic.MosaicLoss(interpret=True, config=config)

  def fn(x, w):
    return api.linear_softmax_cross_entropy_loss(x, labels, w, implementation=impl)

  out, vjp = jax.vjp(fn, x, w)
  dx, dw = vjp(jnp.float32(0.7))
  ref, (ref_dx, ref_dw) = references.high_precision_vjp(
    lambda a, c: references.linear_softmax_cross_entropy_loss(a, labels, c),
    (x, w),
    jnp.float32(0.7),
  )
  assert "RACE DETECTED" not in capfd.readouterr().out
  assert compare.relative_error(out, ref) < 1e-5
  assert compare.relative_error(dx, ref_dx) < 1e-2
  for cols in (slice(0, 128), slice(128, 256), slice(256, 384), slice(384, 448)):
    assert compare.relative_error(dw[:, cols], ref_dw[:, cols]) < 1e-2, cols


@pytest.mark.host_only
def test_gradient_in_forward_of_the_mean_divides_by_the_rows_not_the_padded_rows():
  """Reduction mean over 200 rows in two 128-row chunks (56 padding rows): the gradients
  formed in the forward pass are the float64 reference's, each row weighing 1/200 (1/256,
  counting the padding, would shrink both by a fifth)."""
  x, labels, w = _inputs(200, 128, 256, seed=13, scale=3.0)
  config = mosaic.MosaicLossConfig(
    block_n=128, num_stages=2, grid_tile_m=2, gradient_in_forward=True, row_chunks=2
  )
  impl = mosaic.MosaicLoss(interpret=True, config=config)

  def fn(x, w):
    return api.linear_softmax_cross_entropy_loss(
      x, labels, w, reduction="mean", implementation=impl
    )

  out, (dx, dw) = jax.value_and_grad(fn, argnums=(0, 1))(x, w)
  ref, (ref_dx, ref_dw) = references.high_precision_vjp(
    lambda a, c: references.linear_softmax_cross_entropy_loss(a, labels, c, reduction="mean"),
    (x, w),
    jnp.float32(1.0),
  )
  assert compare.relative_error(out, ref) < 1e-5
  assert compare.relative_error(dx, ref_dx) < 1e-2
  assert compare.relative_error(dw, ref_dw) < 1e-2


@pytest.mark.parametrize(
  ("b", "row_chunks", "rows"), [(1000, 4, 256), (8192, 8, 1024), (100, 8, 128), (300, 3, 128)]
)
def test_gradient_in_forward_chunks_hold_b_over_row_chunks_rows(b, row_chunks, rows, monkeypatch):
  """Each row chunk's exponentials are [rows, V] in memory: B / row_chunks rows, rounded up
  to whole 128-row tiles (8192 rows in 8 chunks: 1024 rows, 256 MiB at V=131072 in bfloat16,
  where one chunk of all the rows would take 2 GiB and chunks of 128 rows 64 roundings of
  dweights). Traced only: the kernel's calls see chunks of exactly that many rows."""
  seen = []
  tile_stats = mosaic.mosaic_kernel.tile_stats

  def spy(x, *args, **kwargs):
    seen.append(x.shape[0])
    return tile_stats(x, *args, **kwargs)

  monkeypatch.setattr(mosaic.mosaic_kernel, "tile_stats", spy)
  shapes = (
    jax.ShapeDtypeStruct((b, 128), jnp.bfloat16),
    jax.ShapeDtypeStruct((b,), jnp.int32),
    jax.ShapeDtypeStruct((128, 512), jnp.bfloat16),
  )
  config = mosaic.MosaicLossConfig(
    block_n=128, num_stages=2, gradient_in_forward=True, row_chunks=row_chunks
  )
  jax.make_jaxpr(lambda *a: mosaic.gradient_in_forward(spec.canonicalize(*a), config))(*shapes)
  assert seen and set(seen) == {rows}, seen


def test_gradient_in_forward_serves_summed_unsharded_whole_64_column_vocabularies():
  x, labels, w = _inputs(16, 128, 256)
  record = spec.canonicalize(x, labels, w, reduction="mean")
  assert mosaic.in_forward_reason(record) is None
  none = spec.canonicalize(x, labels, w, reduction="none")
  assert "reduction none" in mosaic.in_forward_reason(none)
  odd = spec.canonicalize(x, labels % 200, w[:, :200])
  assert "V=200" in mosaic.in_forward_reason(odd)
  # Five 64-column blocks: a multiple of 64 that 128 does not divide.
  wider = jnp.concatenate([w, w[:, :64]], axis=1)
  assert mosaic.in_forward_reason(spec.canonicalize(x, labels, wider)) is None
  shard = dataclasses.replace(record, vocab_shard=partitioning.Shard(("v",), 2))
  assert "vocabulary shard" in mosaic.in_forward_reason(shard)
  with pytest.raises(ValueError, match="row_chunks"):
    mosaic.MosaicLossConfig(row_chunks=0)


@pytest.mark.parametrize("block_n", [64, 192])
def test_gradient_in_forward_refuses_tiles_not_whole_128_column_stores(block_n):
  """wgmma takes tiles of 64 and 192 columns, which the forward alone accepts; the
  exponentials leave a tile in 128-column stores, which such a tile does not fill (the trace
  failed on a [64, 64] value for a [64, 128] slot): gradient_in_forward refuses them, naming
  block_n, and so does the config check of the kernel writing the exponentials."""
  x, labels, w = _inputs(128, 128, 384)
  record = spec.canonicalize(x, labels, w)
  config = mosaic.MosaicLossConfig(block_n=block_n, num_stages=2)
  assert mosaic.MosaicLoss(config=config)._unsupported_reason(record) is None
  in_forward = dataclasses.replace(config, gradient_in_forward=True)
  reason = mosaic.MosaicLoss(config=in_forward)._unsupported_reason(record)
  assert reason is not None and f"block_n={block_n}" in reason, reason
  kernel = mosaic_kernel.MosaicLossKernelConfig(block_n=block_n, block_k=64, num_stages=2)
  assert mosaic_kernel.config_reason(kernel, 128, 2) is None
  assert f"block_n={block_n}" in mosaic_kernel.config_reason(kernel, 128, 2, probabilities=True)
  wide = dataclasses.replace(kernel, block_n=256)
  assert mosaic_kernel.config_reason(wide, 128, 2, probabilities=True) is None


@pytest.mark.host_only
def test_gradient_in_forward_falls_back_for_reduction_none(capfd):
  """gradient_in_forward cannot serve reduction none (each row's cotangent comes in the
  backward pass): the recomputing backward runs, and the gradients match the reference."""
  b, h, v = 16, 128, 256
  x, labels, w = _inputs(b, h, v, seed=9)
  config = mosaic.MosaicLossConfig(
    block_n=128, num_stages=2, grid_tile_m=2, gradient_in_forward=True, row_chunks=2
  )
  _check_none_reduction_vjp(mosaic.MosaicLoss(interpret=True, config=config), x, labels, w, 2)
  assert "RACE DETECTED" not in capfd.readouterr().out


def _in_forward_loss():
  """The loss of (x, w, labels) through the interpreted kernel with `gradient_in_forward`."""
  config = mosaic.MosaicLossConfig(
    block_n=128, num_stages=2, grid_tile_m=2, gradient_in_forward=True, row_chunks=2
  )
  impl = mosaic.MosaicLoss(interpret=True, config=config)
  return lambda x, w, labels: api.linear_softmax_cross_entropy_loss(
    x, labels, w, implementation=impl
  )


@pytest.mark.host_only
def test_gradient_in_forward_is_nan_for_a_traced_label_outside_the_vocabulary():
  """The gradients formed in the forward pass do not know the output's cotangent: a label
  past V (only a trace holds it) makes the loss, its row of dx and all of dweights NaN, as
  the recomputing backward's do; the other rows of dx stay finite."""
  x, labels, w = _inputs(16, 128, 256, seed=4)
  fn = _in_forward_loss()
  valid_loss, (valid_dx, _) = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(x, w, labels)
  assert np.isfinite(float(valid_loss)) and np.isfinite(np.asarray(valid_dx)).all()
  loss, (dx, dw) = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(x, w, labels.at[3].set(256))
  assert np.isnan(float(loss))
  np.testing.assert_array_equal(np.isnan(np.asarray(dx)).any(axis=1), np.arange(16) == 3)
  assert np.isnan(np.asarray(dx)[3]).all() and np.isnan(np.asarray(dw)).all()


def _producer_body(hlo: str, name: str) -> str:
  """The line that defines `name` in compiled HLO text, with the body of the computation it
  calls (a fusion's), if any."""
  line = next(ln for ln in hlo.splitlines() if ln.strip().startswith(f"{name} = "))
  called = re.search(r"calls=(%[\w.-]+)", line)
  if called is None:
    return line
  body = re.search(rf"\n{re.escape(called.group(1))} .*?\n}}", hlo, re.S)
  return line + body.group(0)


@pytest.mark.host_only
def test_gradient_in_forward_gradients_are_not_rescaled_under_grad():
  """Under jax.grad (a unit cotangent) the gradients formed in the forward pass are the
  output as they are: no pass over dweights multiplies them, even with traced labels (whose
  check would otherwise keep a data-dependent scale)."""
  x, labels, w = _inputs(256, 128, 256, seed=5)
  fn = _in_forward_loss()
  hlo = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(x, w, labels).compile().as_text()
  entry = re.search(r"\nENTRY .*?\n}", hlo, re.S).group(0)
  root = next(ln for ln in entry.splitlines() if ln.strip().startswith("ROOT"))
  dw_name = root.rsplit("(", 1)[1].rstrip(")").split(", ")[-1]
  producer = _producer_body(hlo, dw_name)
  assert "multiply(" not in producer, producer


def test_gradient_in_forward_leaves_the_primal_one_kernel_pass():
  """Without differentiation the forward is the statistics kernel alone (V is whole tiles:
  no matmul in XLA); the forward rule under differentiation also forms the gradients."""
  x, labels, w = _inputs(512, 128, 512)
  config = mosaic.MosaicLossConfig(block_n=128, num_stages=2, gradient_in_forward=True)
  op = mosaic.MosaicLoss(config=config)
  record = spec.canonicalize(x, labels, w)
  primal = str(jax.make_jaxpr(lambda r: op._fwd_primal(r, config))(record))
  assert primal.count("mpmd_map") == 1 and "dot_general" not in primal
  rule = str(jax.make_jaxpr(lambda r: op._fwd(r, config))(record))
  assert rule.count("dot_general") == 4  # dx and dweights: the first chunk's and the loop's.


def test_gradient_in_forward_lowers_for_cuda_at_the_benchmark_shape():
  shapes = (
    jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16),
    jax.ShapeDtypeStruct((8192,), jnp.int32),
    jax.ShapeDtypeStruct((4096, 131072), jnp.bfloat16),
  )
  config = mosaic.MosaicLossConfig(num_stages=3, gradient_in_forward=True)
  op = mosaic.MosaicLoss(config=config)
  record = jax.eval_shape(lambda *a: spec.canonicalize(*a), *shapes)
  assert op._unsupported_reason(record) is None
  # Four stages and the exponentials' slot exceed shared memory (Mosaic GPU refuses them).
  four = mosaic.MosaicLoss(config=dataclasses.replace(config, num_stages=4))
  assert "shared memory" in four._unsupported_reason(record)

  def fn(x, labels, w):
    return op._fwd(spec.canonicalize(x, labels, w), config)

  text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text and "while" in text
  # The cotangent kernel writes over the exponentials' buffer: no second [rows, V] array.
  assert "output_operand_alias" in text


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_gradient_in_forward_counts_the_exponentials_only_where_it_serves(reduction):
  """Four stages and the exponentials' slot exceed shared memory at the benchmark shape, and
  a 192-column tile leaves its exponentials in a partial store: both refused where
  gradient_in_forward serves the call (sum), and both accepted for reduction none, which it
  cannot serve (the forward then writes no exponentials, as without gradient_in_forward)."""
  shapes = (
    jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16),
    jax.ShapeDtypeStruct((8192,), jnp.int32),
    jax.ShapeDtypeStruct((4096, 131072), jnp.bfloat16),
  )
  record = jax.eval_shape(lambda *a: spec.canonicalize(*a, reduction=reduction), *shapes)
  serves = mosaic.in_forward_reason(record) is None
  assert serves == (reduction == "sum")
  for config in (
    mosaic.MosaicLossConfig(num_stages=4),
    mosaic.MosaicLossConfig(block_n=192, num_stages=3),
  ):
    assert mosaic.MosaicLoss(config=config)._unsupported_reason(record) is None, config
    in_forward = dataclasses.replace(config, gradient_in_forward=True)
    reason = mosaic.MosaicLoss(config=in_forward)._unsupported_reason(record)
    assert (reason is not None) == serves, (in_forward, reason)


@pytest.mark.parametrize(("v", "chunk"), [(512, 128), (384, 256)])
def test_recomputing_backward_takes_the_configs_vocabulary_chunks(v, chunk, monkeypatch):
  """The backward recomputes [B, vocab_chunk_size] logits at a time, so that no [B, V] array
  exists (the module's promise): a chunk under V is the config's, not the whole vocabulary.
  Traced only."""
  seen = []
  backward = mosaic.chunked_xla.backward

  def spy(args, chunks, *rest):
    seen.append(chunks.vocab_chunk_size)
    return backward(args, chunks, *rest)

  monkeypatch.setattr(mosaic.chunked_xla, "backward", spy)
  x, labels, w = _inputs(16, 128, v)
  config = mosaic.MosaicLossConfig(block_n=128, num_stages=2, vocab_chunk_size=chunk)
  op = mosaic.MosaicLoss(interpret=True, config=config)

  def fn(x, w):
    return api.linear_softmax_cross_entropy_loss(x, labels, w, implementation=op)

  jax.make_jaxpr(jax.grad(fn, argnums=(0, 1)))(x, w)
  assert seen == [chunk]


def test_the_kernel_tiles_as_the_heuristic_config_says():
  """The kernel's tiling is the op config's: the heuristic's 256-column tiles, its 3 stages
  and its bands of 8 row tiles (0.96x the time of 32 at the benchmark shapes), and a
  contraction depth of 128 bytes (64 bfloat16 or float16 elements)."""
  x, labels, w = _inputs(16, 256, 384)
  record = spec.canonicalize(x, labels, w)
  config = mosaic.MosaicLoss()._get_heuristics_config(record)
  assert (config.block_n, config.num_stages, config.grid_tile_m) == (256, 3, 8)
  for dtype in (jnp.bfloat16, jnp.float16):
    kernel = mosaic._kernel_config(dtype, config)
    assert (kernel.block_n, kernel.block_k, kernel.num_stages, kernel.grid_tile_m) == (
      256,
      64,
      3,
      8,
    )


def _interpret_shapes():
  return opdb.get("linear_softmax_cross_entropy_loss").matrices[opdb.CPU].interpret_shapes


@pytest.mark.parametrize("index", [1, 2])
def test_the_matrix_interpret_shapes_for_the_kernel_are_ones_it_serves(index):
  """The op database's CPU interpret shapes after the first suit the Mosaic kernel (H a
  multiple of 64), so the matrix runs the kernel there rather than skipping it; the first of
  them (V % 64 == 0) takes gradient_in_forward's pass over row chunks."""
  shape = _interpret_shapes()[index]
  b, h, v = shape["b"], shape["h"], shape["v"]
  assert h % 64 == 0
  for dtype in shape.get("dtypes", ("float32", "bfloat16")):
    x, w = jnp.zeros((b, h), dtype), jnp.zeros((h, v), dtype)
    args = spec.SPEC.canonicalize(x, jnp.zeros((b,), jnp.int32), w, reduction="sum")
    assert mosaic.MosaicLoss(interpret=True)._unsupported_reason(args) is None, (shape, dtype)
    assert (mosaic.in_forward_reason(args) is None) == (index == 1), shape
