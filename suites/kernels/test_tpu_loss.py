"""Mosaic TPU linear_softmax_cross_entropy_loss on CPU: the fused log-sum-exp kernel and the
dx/dweights kernels in Pallas's TPU interpreter against float64 references (forward and both
gradients, odd B and V, large logits), the block cost models and their VMEM checks, and
`jax.export` for a TPU v5 from a CPU host.

Not covered here (needs a TPU): Mosaic's own compilation of the lowered kernels (layouts,
VMEM allocation) and their speed.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax._src import export, tpu
from tokamax._src.ops.linear_softmax_cross_entropy_loss import (
  api,
  mosaic_tpu,
  mosaic_tpu_kernel,
  spec,
)
from tokamax_harness import compare, references

# On any host the TPU kernels run in the TPU interpreter, on the host CPU.
pytestmark = [
  pytest.mark.op("linear_softmax_cross_entropy_loss", "mosaic_tpu"),
  pytest.mark.usefixtures("on_cpu"),
  pytest.mark.host_only,
]

Config = mosaic_tpu.MosaicTpuLossConfig
# 16-row tiles (a partial last one at odd B), 128-column tiles and K steps, forward and
# backward kernels.
SMALL = Config(block_b=16, block_v=128, block_k=128, bwd_block_b=16, bwd_block_v=128)
# Backward tiles twice the forward's: the backward's XLA tail starts after its own one tile of
# 256 columns (44 columns), not after the forward's two tiles of 128.
WIDE_BACKWARD = Config(block_b=16, block_v=128, block_k=128, bwd_block_b=16, bwd_block_v=256)
# Backward tiles wider than V=300: the backward recomputes 128-column chunks in XLA.
XLA_BACKWARD = Config(block_b=16, block_v=128, block_k=128, bwd_block_v=384, vocab_chunk_size=128)


def _inputs(b, h, v, dtype, seed=0, scale=1.0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((b, h)) * scale, dtype)
  w = jnp.asarray(rng.standard_normal((h, v)) / np.sqrt(h), dtype)
  labels = jnp.asarray(rng.integers(0, v, b), jnp.int32)
  return x, labels, w


@pytest.mark.parametrize(
  ("b", "h", "v", "dtype", "reduction", "config"),
  [
    # A partial row tile, two K steps, two vocabulary tiles and a 44-column tail.
    (37, 256, 300, "float32", "none", SMALL),
    (37, 256, 300, "bfloat16", "sum", SMALL),
    # H=32 in one step (the whole dimension); the cost model's blocks; a 107-column tail.
    (24, 32, 1003, "float32", "mean", None),
    # No tail: V is two whole tiles.
    (9, 128, 256, "bfloat16", "mean", SMALL),
    (37, 256, 300, "float32", "sum", XLA_BACKWARD),
    (21, 128, 300, "float32", "sum", WIDE_BACKWARD),
  ],
)
def test_interpret_matches_reference_with_gradients(b, h, v, dtype, reduction, config):
  x, labels, w = _inputs(b, h, v, dtype, seed=b + v)
  impl = mosaic_tpu.MosaicTpuLoss(interpret=True, config=config)

  def fn(x, w):
    return api.linear_softmax_cross_entropy_loss(
      x, labels, w, reduction=reduction, implementation=impl
    )

  out, vjp = jax.vjp(fn, x, w)
  ct = jnp.asarray(np.random.default_rng(1).standard_normal(out.shape), jnp.float32)
  dx, dw = vjp(ct)
  ref, (ref_dx, ref_dw) = references.high_precision_vjp(
    lambda a, c: references.linear_softmax_cross_entropy_loss(a, labels, c, reduction=reduction),
    (x, w),
    ct,
  )
  bound = 1e-5 if dtype == "float32" else 1e-2
  assert out.dtype == jnp.float32 and out.shape == ref.shape
  assert dx.dtype == x.dtype and dw.dtype == w.dtype
  assert compare.relative_error(out, ref) < bound
  assert compare.relative_error(dx, ref_dx) < bound
  assert compare.relative_error(dw, ref_dw) < bound


def test_interpret_on_two_cores_matches_reference():
  """A v5p megacore in the interpreter: two cores split the grid's "parallel" axes, in a random
  order. Only the row tiles may be parallel: a vocabulary tile or contraction step (forward,
  dx) or a row tile (dweights) split between the cores would leave each core a part of the
  accumulation, each in its own VMEM."""
  # Three row tiles, two K steps, three vocabulary tiles and a tail: nine (row, vocabulary)
  # tiles, so that a split of an accumulating axis between the cores splits a row or a column.
  b, h, v = 37, 256, 400
  x, labels, w = _inputs(b, h, v, "float32", seed=11)
  params = mosaic_tpu.pltpu.InterpretParams(num_cores_or_threads=2, random_seed=3)
  impl = mosaic_tpu.MosaicTpuLoss(interpret=params, config=SMALL)

  def fn(x, w):
    return api.linear_softmax_cross_entropy_loss(x, labels, w, reduction="sum", implementation=impl)

  out, (dx, dw) = jax.value_and_grad(fn, argnums=(0, 1))(x, w)
  ref, (ref_dx, ref_dw) = references.high_precision_vjp(
    lambda a, c: references.linear_softmax_cross_entropy_loss(a, labels, c, reduction="sum"),
    (x, w),
    jnp.ones((), jnp.float32),
  )
  assert compare.relative_error(out, ref) < 1e-5
  assert compare.relative_error(dx, ref_dx) < 1e-5
  assert compare.relative_error(dw, ref_dw) < 1e-5


def test_interpret_large_logits():
  """Logits in the thousands: every tile's maximum must be kept (no overflow, no -inf)."""
  x, labels, w = _inputs(21, 128, 389, "float32", seed=5, scale=1000.0)
  impl = mosaic_tpu.MosaicTpuLoss(interpret=True, config=SMALL)
  hi = jax.lax.Precision.HIGHEST

  def fn(x, w):
    return api.linear_softmax_cross_entropy_loss(
      x, labels, w, reduction="none", precision=hi, implementation=impl
    )

  out, vjp = jax.vjp(fn, x, w)
  ct = jnp.ones(out.shape, jnp.float32)
  dx, dw = vjp(ct)
  ref, (ref_dx, ref_dw) = references.high_precision_vjp(
    lambda a, c: references.linear_softmax_cross_entropy_loss(a, labels, c, reduction="none"),
    (x, w),
    ct,
  )
  assert float(np.abs(ref).max()) > 1000
  assert compare.relative_error(out, ref) < 1e-5
  assert compare.relative_error(dx, ref_dx) < 1e-3
  assert compare.relative_error(dw, ref_dw) < 1e-3


def test_interpret_bfloat16_label_logits_accumulate_in_float32():
  """bfloat16 inputs with logits near 100, where bfloat16 holds steps of 0.5: each row's loss
  (log-sum-exp less the label's logit, both summed in float32) matches float64 numpy of the
  same bfloat16 values to float32 rounding, not to a bfloat16 rounding of the label's logit."""
  x, labels, w = _inputs(21, 128, 300, "bfloat16", seed=6, scale=60.0)
  impl = mosaic_tpu.MosaicTpuLoss(interpret=True, config=SMALL)
  out = api.linear_softmax_cross_entropy_loss(
    x, labels, w, reduction="none", precision=jax.lax.Precision.HIGHEST, implementation=impl
  )
  logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  picked = logits[np.arange(21), np.asarray(labels)]
  assert np.abs(picked).max() > 64  # bfloat16 steps of 0.5 or more there.
  want = np.logaddexp.reduce(logits, axis=1) - picked
  np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=0, atol=2e-3)


def test_interpret_bfloat16_backward_tail_from_float32_logits():
  """bfloat16 inputs with logits of a few tens: the backward's XLA tail (columns 256..299 past
  its two tiles) recomputes its logits in float32, so its softmax, dweights and dx share hold to
  one bfloat16 rounding of the cotangents (about 2e-3 here), not to a rounding of the logits
  (a few per cent in the exponentials)."""
  x, labels, w = _inputs(37, 128, 300, "bfloat16", seed=8, scale=10.0)
  impl = mosaic_tpu.MosaicTpuLoss(interpret=True, config=SMALL)

  def fn(x, w):
    return api.linear_softmax_cross_entropy_loss(
      x, labels, w, precision=jax.lax.Precision.HIGHEST, implementation=impl
    )

  dx, dw = jax.grad(fn, argnums=(0, 1))(x, w)
  _, (ref_dx, ref_dw) = references.high_precision_vjp(
    lambda a, c: references.linear_softmax_cross_entropy_loss(a, labels, c),
    (x, w),
    jnp.ones((), jnp.float32),
  )
  assert compare.relative_error(dw[:, 256:], ref_dw[:, 256:]) < 5e-3
  assert compare.relative_error(dx, ref_dx) < 5e-3


def test_the_kernel_alone_gives_the_log_sum_exp_of_its_tiles():
  x, _, w = _inputs(45, 256, 520, "float32", seed=2, scale=10.0)
  got = mosaic_tpu_kernel.logsumexp(
    x,
    w,
    n_tiles=3,
    precision=jax.lax.Precision.HIGHEST,
    block_b=16,
    block_v=128,
    block_k=128,
    vmem_limit_bytes=tpu.V5E.vmem_limit_bytes,
    interpret=mosaic_tpu.pltpu.InterpretParams(),
  )
  logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  want = np.logaddexp.reduce(logits[:, :384], axis=1)  # Columns 384.. are not the kernel's.
  assert got.shape == (45,)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-5)


def _record(b, h, v, dtype="bfloat16"):
  shapes = (
    jax.ShapeDtypeStruct((b, h), dtype),
    jax.ShapeDtypeStruct((b,), jnp.int32),
    jax.ShapeDtypeStruct((h, v), dtype),
  )
  return jax.eval_shape(spec.canonicalize, *shapes)


def _export(fn, *shapes, device_kind="TPU v5 lite"):
  with export.abstract_tpu(device_kind):
    return jax.export.export(jax.jit(fn), platforms=("tpu",))(*shapes)


@pytest.mark.parametrize("implementation", ["mosaic_tpu", None])
@pytest.mark.parametrize(("dtype", "v"), [("bfloat16", 50257), ("float32", 10000)])
def test_export_for_tpu_v5_has_the_mosaic_tpu_call(implementation, dtype, v):
  b, h = 512, 1024
  shapes = (
    jax.ShapeDtypeStruct((b, h), dtype),
    jax.ShapeDtypeStruct((b,), jnp.int32),
    jax.ShapeDtypeStruct((h, v), dtype),
  )

  def forward(x, labels, w):
    return api.linear_softmax_cross_entropy_loss(x, labels, w, implementation=implementation)

  def forward_backward(x, labels, w):
    return jax.value_and_grad(forward, argnums=(0, 2))(x, labels, w)

  for fn, calls in ((forward, 1), (forward_backward, 3)):
    exported = _export(fn, *shapes)
    text = exported.mlir_module()
    assert exported.platforms == ("tpu",)
    # The forward's kernel; the backward's dx and dweights kernels.
    assert text.count("tpu_custom_call") == calls, fn.__name__
    # No [B, V] logits (only the tails' [B, V % block_v]).
    assert f"tensor<{b}x{v}xf32>" not in text, fn.__name__


def test_export_for_tpu_v5p():
  exported = _export(
    lambda x, labels, w: api.linear_softmax_cross_entropy_loss(x, labels, w),
    jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16),
    jax.ShapeDtypeStruct((4096,), jnp.int32),
    jax.ShapeDtypeStruct((4096, 256000), jnp.bfloat16),
    device_kind="TPU v5",
  )
  assert "tpu_custom_call" in exported.mlir_module()


def test_kernels_ask_for_the_scoped_vmem_limit_of_v5p():
  """The forward and both backward kernels ask Mosaic for v5p's scoped VMEM limit (32 MiB of
  its 64 MiB), the limit their blocks were checked against."""
  shapes = (
    jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16),
    jax.ShapeDtypeStruct((512,), jnp.int32),
    jax.ShapeDtypeStruct((1024, 10000), jnp.bfloat16),
  )

  def forward_backward(x, labels, w):
    loss = lambda x, w: api.linear_softmax_cross_entropy_loss(
      x, labels, w, implementation="mosaic_tpu"
    )
    return jax.value_and_grad(loss, argnums=(0, 1))(x, w)

  text = _export(forward_backward, *shapes, device_kind="TPU v5").mlir_module()
  assert text.count("tpu_custom_call") == 3
  sizes = re.findall(r"\\22size\\22: (\d+)", text)
  assert sizes == [str(32 << 20)] * 3, sizes


@pytest.mark.parametrize(("dtype", "block_b"), [("float32", 40), ("bfloat16", 48)])
def test_heuristic_blocks_of_fewer_rows_than_a_block(dtype, block_b):
  """B=37 rows, below every row block: the one row candidate is B padded to whole sublanes (8
  for float32, 16 for bfloat16); V=256 is one whole vocabulary tile (no XLA tail), H=128 one
  contraction step. The call runs in the kernel with these blocks and matches the reference."""
  b, h, v = 37, 128, 256
  x, labels, w = _inputs(b, h, v, dtype, seed=4)
  impl = mosaic_tpu.MosaicTpuLoss(interpret=True)
  record = spec.canonicalize(x, labels, w)
  config = impl._get_heuristics_config(record)
  assert (config.block_b, config.block_v, config.block_k) == (block_b, 256, 128)
  assert impl._unsupported_reason(record) is None
  out = api.linear_softmax_cross_entropy_loss(x, labels, w, reduction="none", implementation=impl)
  ref = references.high_precision(references.linear_softmax_cross_entropy_loss)(
    x, labels, w, reduction="none"
  )
  assert compare.relative_error(out, ref) < (1e-5 if dtype == "float32" else 1e-2)


def test_autotuning_configs_are_the_eight_best_that_fit():
  """Autotuning times the cost model's eight best blocks (of many that fit), each one that
  `config_reason` accepts, the heuristic's among them."""
  record = _record(4096, 2048, 65536)
  op = mosaic_tpu.MosaicTpuLoss()
  with export.abstract_tpu():
    configs = op._get_autotuning_configs(record)
    fitting = [
      c for c in mosaic_tpu._candidates(record) if mosaic_tpu.config_reason(record, c) is None
    ]
    assert len(fitting) > 8
    assert len(configs) == 8
    assert all(mosaic_tpu.config_reason(record, c) is None for c in configs)
    assert op._get_heuristics_config(record) in configs


def test_kernels_refuse_tiles_past_the_vocabulary():
  """The kernels read whole tiles of `w`: tiles past its columns, no tile, or a contraction
  block that does not divide H are refused before anything is read."""
  x, labels, w = _inputs(16, 256, 300, "float32")
  common = dict(precision=None, block_b=16, vmem_limit_bytes=tpu.V5E.vmem_limit_bytes)
  common["interpret"] = mosaic_tpu.pltpu.InterpretParams()
  lse, g = jnp.zeros((16,), jnp.float32), jnp.ones((16,), jnp.float32)
  for n_tiles, block_v in ((3, 128), (2, 256), (0, 128)):
    with pytest.raises(ValueError, match="do not fit V=300"):
      mosaic_tpu_kernel.logsumexp(x, w, n_tiles=n_tiles, block_v=block_v, block_k=128, **common)
    with pytest.raises(ValueError, match="do not fit V=300"):
      mosaic_tpu_kernel.backward(x, w, labels, lse, g, n_tiles=n_tiles, block_v=block_v, **common)
  with pytest.raises(ValueError, match="block_k=96 must divide H=256"):
    mosaic_tpu_kernel.logsumexp(x, w, n_tiles=2, block_v=128, block_k=96, **common)


def test_backward_in_xla_where_its_blocks_do_not_fit():
  """H=65536: no backward tile with the whole H fits in v5e's VMEM; the forward splits H."""
  b, h, v = 256, 65536, 1024
  shapes = (
    jax.ShapeDtypeStruct((b, h), jnp.bfloat16),
    jax.ShapeDtypeStruct((b,), jnp.int32),
    jax.ShapeDtypeStruct((h, v), jnp.bfloat16),
  )
  record = _record(b, h, v)
  with export.abstract_tpu():
    config = mosaic_tpu.MosaicTpuLoss()._get_heuristics_config(record)
    assert mosaic_tpu.config_reason(record, config) is None
    assert "VMEM" in mosaic_tpu.bwd_config_reason(record, config)
  loss = lambda x, labels, w: api.linear_softmax_cross_entropy_loss(
    x, labels, w, implementation="mosaic_tpu"
  )
  text = _export(jax.grad(loss, argnums=(0, 2)), *shapes).mlir_module()
  assert text.count("tpu_custom_call") == 1


def test_mosaic_keeps_naming_the_gpu_kernel():
  assert spec.SPEC.platform_name("mosaic", "tpu") == "mosaic"
  assert spec.SPEC.default_order("tpu") == ("mosaic_tpu", "xla")
  with export.abstract_tpu():
    assert spec.SPEC.resolve("mosaic_tpu") == ["mosaic_tpu"]
    assert spec.SPEC.resolve(None) == ["mosaic_tpu", "xla"]
  # On this CPU host the kernel refuses to compile; None runs XLA.
  x, labels, w = _inputs(8, 128, 256, "float32")
  with pytest.raises(NotImplementedError, match="runs on tpu, not on "):
    api.linear_softmax_cross_entropy_loss(x, labels, w, implementation="mosaic_tpu")
  assert api.linear_softmax_cross_entropy_loss(x, labels, w).shape == ()


def test_unsupported_reasons_name_the_feature():
  impl = mosaic_tpu.MosaicTpuLoss(interpret=True)
  x, labels, w = _inputs(16, 128, 300, "float16")
  with pytest.raises(NotImplementedError, match="dtype float16"):
    impl(x, labels, w)
  x, w = x.astype(jnp.float32), w.astype(jnp.float32)
  cases = {
    "block_v=100 must be a multiple of 128": Config(block_v=100),
    "V=300 is below one vocabulary tile": Config(block_v=384, block_k=128),
    "block_k=256 must divide H=128": Config(block_v=128, block_k=256),
    "block_b=12 must be a multiple of 8": Config(block_b=12, block_k=128),
    "VMEM": Config(block_b=16384, block_v=256, block_k=128),
  }
  for reason, config in cases.items():
    with pytest.raises(NotImplementedError, match=reason):
      impl.with_config(config)(x, labels, w)
  with pytest.raises(NotImplementedError, match="below one vocabulary tile"):
    impl(x[:, :], labels % 100, w[:, :100])  # V=100: no whole tile.
  with pytest.raises(ValueError, match="labels"):
    impl(x, labels.at[0].set(300), w)
  # A sequence falls back to the next implementation.
  out = api.linear_softmax_cross_entropy_loss(
    x.astype(jnp.float16), labels, w.astype(jnp.float16), implementation=[impl, "xla"]
  )
  assert out.shape == ()


# B1000 H512 V1000 bfloat16 with 256 x 256 blocks: 4 row tiles, 3 whole vocabulary tiles
# (768 columns) and a tail of 232 columns that XLA computes; by hand from the model's rules.
_TAIL = 1000 - 768
_FWD_COSTS = {
  # Two contraction steps: the x block is read again for every vocabulary tile.
  256: (
    2 * 512 * (4 * 256 * 768 + 1000 * _TAIL),
    (4 * 512 * 768 + 3 * 4 * 256 * 512) * 2 + (512 * _TAIL + 1000 * 512) * 2,
    4 * 3 * 2,
  ),
  # One contraction step: the x block stays across the vocabulary tiles.
  512: (
    2 * 512 * (4 * 256 * 768 + 1000 * _TAIL),
    (4 * 512 * 768 + 4 * 256 * 512) * 2 + (512 * _TAIL + 1000 * 512) * 2,
    4 * 3,
  ),
}


@pytest.mark.parametrize("block_k", list(_FWD_COSTS))
def test_cost_model_counts_by_hand(block_k, roofline_calls):
  """The flops, HBM bytes and grid steps of the forward and backward cost models."""
  record = _record(1000, 512, 1000, "bfloat16")
  config = mosaic_tpu.MosaicTpuLossConfig(
    block_b=256, block_v=256, block_k=block_k, bwd_block_b=256, bwd_block_v=256
  )
  mosaic_tpu.estimated_seconds(record, config)
  mosaic_tpu.bwd_estimated_seconds(record, config)
  # Backward: dx reads the weights per row tile, writes float32 dx; dweights reads x per
  # vocabulary tile, reads and writes its columns; the tail: three [H, tail] and two [B, H].
  dx_hbm = (4 * 512 * 768 + 1000 * 512) * 2 + 4 * 1000 * 512
  dw_hbm = (3 * 4 * 256 * 512 + 2 * 512 * 768) * 2
  tail_hbm = (3 * 512 * _TAIL + 2 * 1000 * 512) * 2
  bwd_flops = 8 * 4 * 256 * 512 * 768 + 6 * 1000 * 512 * _TAIL
  assert roofline_calls == [
    (*_FWD_COSTS[block_k], 2),
    (bwd_flops, dx_hbm + dw_hbm + tail_hbm, 2 * 4 * 3, 2),
  ]


@pytest.mark.parametrize("device_kind", ["TPU v5 lite", "TPU v5"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
  ("b", "h", "v"), [(4096, 2048, 65536), (8192, 4096, 131072), (4096, 4096, 256000)]
)
def test_heuristic_blocks_fit_vmem(device_kind, dtype, b, h, v):
  record = _record(b, h, v, dtype)
  op = mosaic_tpu.MosaicTpuLoss()
  with export.abstract_tpu(device_kind):
    chip = tpu.chip()
    config = op._get_heuristics_config(record)
    assert mosaic_tpu.config_reason(record, config) is None
    assert mosaic_tpu.vmem_bytes(record, config) <= chip.vmem_limit_bytes
    best = min(
      mosaic_tpu.estimated_seconds(record, c)
      for c in mosaic_tpu._candidates(record)
      if mosaic_tpu.config_reason(record, c) is None
    )
    assert mosaic_tpu.estimated_seconds(record, config) == best
    # Large shapes get large tiles (few grid steps, the weights streamed few times).
    assert config.block_b >= 256 and config.block_v >= 512
    # The backward kernels' blocks fit too, and are their cost model's best.
    assert mosaic_tpu.bwd_config_reason(record, config) is None
    assert mosaic_tpu.bwd_vmem_bytes(record, config) <= chip.vmem_limit_bytes
    bwd_best = min(
      mosaic_tpu.bwd_estimated_seconds(record, Config(bwd_block_b=c.block_b, bwd_block_v=c.block_v))
      for c in mosaic_tpu._candidates(record)
      if mosaic_tpu.bwd_config_reason(record, Config(bwd_block_b=c.block_b, bwd_block_v=c.block_v))
      is None
    )
    assert mosaic_tpu.bwd_estimated_seconds(record, config) == bwd_best
    assert config.bwd_block_b >= 256 and config.bwd_block_v >= 256
  assert chip.name == ("v5e" if device_kind == "TPU v5 lite" else "v5p")


def test_vmem_limit_is_the_target_chips():
  record = _record(8192, 4096, 131072)
  config = Config(block_b=512, block_v=2048, block_k=2048)
  # Double-buffered bf16 blocks, two float32 tiles, four lane-padded columns.
  expected = 2 * (512 * 2048 + 2048 * 2048) * 2 + 2 * 4 * 512 * 2048 + 4 * 4 * 512 * 128
  assert mosaic_tpu.vmem_bytes(record, config) == expected  # 29 MiB.
  big = Config(block_b=1024, block_v=2048, block_k=2048)  # 42 MiB.
  with export.abstract_tpu("TPU v5 lite"):  # 64 MiB of v5e's 128 MiB.
    assert mosaic_tpu.config_reason(record, config) is None
    assert mosaic_tpu.config_reason(record, big) is None
  with export.abstract_tpu("TPU v5"):  # 32 MiB of v5p's 64 MiB.
    assert mosaic_tpu.config_reason(record, config) is None
    assert "over the 33554432 used on v5p" in mosaic_tpu.config_reason(record, big)


def test_cost_model_prefers_large_blocks():
  record = _record(8192, 4096, 131072)
  small, large = Config(block_b=128, block_v=128, block_k=128), Config(block_b=512, block_v=1024)
  with export.abstract_tpu():
    assert mosaic_tpu.estimated_seconds(record, large) < mosaic_tpu.estimated_seconds(record, small)


def test_unsupported_reasons_at_the_edges():
  """Mosaic's tiling: row tiles of 8 sublanes for float32 and 16 for bfloat16; block_k a
  divisor of H that is a multiple of 128 (or H itself)."""

  def reason(dtype="float32", h=256, **config):
    record = _record(64, h, 512, dtype)
    with export.abstract_tpu():
      return mosaic_tpu.config_reason(record, Config(**{"block_k": 128, **config}))

  assert reason(block_b=8) is None
  assert reason(block_b=8, block_v=512) is None  # One tile of the whole V=512.
  assert "block_b=8 must be a multiple of 16" in reason("bfloat16", block_b=8)
  assert reason("bfloat16", block_b=16) is None
  # H=256: 64 divides it but is no multiple of 128; H itself is fine.
  assert "block_k=64 must divide H=256" in reason(block_b=16, block_k=64)
  assert reason(block_b=16, block_k=256) is None
  assert reason(h=96, block_b=16, block_k=96) is None
  assert "block_k=32 must divide H=96" in reason(h=96, block_b=16, block_k=32)
  # Vocabulary tiles are lanes: 192 (a multiple of 8 and 64, under V=512) is refused, forward
  # and backward; 384 is fine.
  assert "block_v=192 must be a multiple of 128" in reason(block_b=16, block_v=192)
  assert reason(block_b=16, block_v=384) is None
  with export.abstract_tpu():
    backward = mosaic_tpu.bwd_config_reason(_record(64, 256, 512), Config(bwd_block_v=192))
  assert "bwd_block_v=192 must be a multiple of 128" in backward


def test_interpret_logits_far_below_zero():
  """Every logit near -200 (exp underflows to 0 in float32): the log-sum-exp must take the
  row's own maximum (the running maximum starts at -inf, not 0). The bound allows for float32
  logits of that size."""
  rng = np.random.default_rng(8)
  b, h, v = 21, 128, 300
  x = jnp.asarray(np.abs(rng.standard_normal((b, h))) * 30.0, jnp.float32)
  w = jnp.asarray(-np.abs(rng.standard_normal((h, v))) / np.sqrt(h), jnp.float32)
  labels = jnp.asarray(rng.integers(0, v, b), jnp.int32)
  hi = jax.lax.Precision.HIGHEST
  impl = mosaic_tpu.MosaicTpuLoss(interpret=True, config=SMALL)
  out = api.linear_softmax_cross_entropy_loss(
    x, labels, w, reduction="none", precision=hi, implementation=impl
  )
  logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  assert logits.max() < -110
  want = np.logaddexp.reduce(logits, axis=1) - logits[np.arange(b), np.asarray(labels)]
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-3)


def test_backward_vmem_counts_the_larger_kernel():
  """The backward kernels' VMEM: double-buffered x [block_b, H] and weights [H, block_v]
  blocks, three double-buffered float32 [block_b, 128] row blocks (lse, labels, cotangents),
  three float32 [block_b, block_v] tile temporaries, and the larger of dx's float32
  accumulator and double-buffered float32 output [block_b, H] or dweights' float32
  accumulator and double-buffered output [H, block_v] in the weights' dtype."""
  record = _record(4096, 1024, 65536)  # bfloat16.
  h = 1024

  def expected(bb, bv):
    common = 2 * (bb * h + h * bv) * 2 + 3 * 2 * 4 * bb * 128 + 3 * 4 * bb * bv
    return common + max(4 * bb * h + 2 * 4 * bb * h, 4 * h * bv + 2 * 2 * h * bv)

  for bb, bv in ((256, 512), (1024, 128)):  # The dweights blocks larger; then dx's.
    config = Config(bwd_block_b=bb, bwd_block_v=bv)
    assert mosaic_tpu.bwd_vmem_bytes(record, config) == expected(bb, bv), (bb, bv)
