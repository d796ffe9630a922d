"""Pallas Mosaic TPU kernels of the fused linear + softmax cross-entropy loss.

`logsumexp` computes each row's log-sum-exp over the first `n_tiles`
vocabulary tiles of x @ w without writing the [B, V] logits. The grid is
(row tile, vocabulary tile, contraction step): a float32 VMEM accumulator
collects a [block_b, block_v] logits tile over the K steps, and at the last
step the epilogue folds the tile into a running per-row maximum and sum of
exponentials (an online log-sum-exp across the vocabulary tiles, kept in VMEM
scratch). The row's log-sum-exp is stored after its last vocabulary tile.
The per-row maximum, sum and output are replicated across 128 lanes (as in
Pallas's TPU flash attention): lane-dense blocks, no [block_b, 1] layouts.

Row tiles are independent ("parallel", split across the TensorCores of a v5p
megacore); vocabulary tiles and contraction steps run in order. A partial last
row tile computes rows past B from undefined data; they are not stored.

`backward` recomputes the logits tiles from the log-sum-exp in two kernels (dx
over the vocabulary tiles of a row tile, dw over the row tiles of a vocabulary
tile), again without [B, V] arrays.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tokamax._src.ops import partitioning

LANES = 128


def _wide(a: jax.Array, width: int) -> jax.Array:
  """Lane-replicated [rows, 128] values tiled to [rows, width] (as in Pallas flash attention)."""
  return jnp.tile(a, (1, width // LANES))


def _kernel(x_ref, w_ref, out_ref, acc_ref, max_ref, sum_ref, *, precision, num_k: int):
  j, k = pl.program_id(1), pl.program_id(2)

  @pl.when((j == 0) & (k == 0))
  def _():
    max_ref[...] = jnp.full_like(max_ref, -jnp.inf)
    sum_ref[...] = jnp.zeros_like(sum_ref)

  @pl.when(k == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  acc_ref[...] += lax.dot_general(
    x_ref[...],
    w_ref[...],
    (((1,), (0,)), ((), ())),
    precision=precision,
    preferred_element_type=jnp.float32,
  )

  @pl.when(k == num_k - 1)
  def _():
    logits = acc_ref[...]
    previous = max_ref[...]  # [block_b, 128], the lanes equal.
    top = jnp.maximum(previous, logits.max(axis=1, keepdims=True))
    tile_sum = jnp.exp(logits - _wide(top, logits.shape[1])).sum(axis=1, keepdims=True)
    sum_ref[...] = sum_ref[...] * jnp.exp(previous - top) + tile_sum
    max_ref[...] = top

  @pl.when((j == pl.num_programs(1) - 1) & (k == num_k - 1))
  def _():
    out_ref[...] = max_ref[...] + jnp.log(sum_ref[...])


def logsumexp(
  x: jax.Array,
  w: jax.Array,
  *,
  n_tiles: int,
  precision,
  block_b: int,
  block_v: int,
  block_k: int,
  vmem_limit_bytes: int,
  interpret: pltpu.InterpretParams | None,
) -> jax.Array:
  """float32 [B]: log-sum-exp of each row of x @ w[:, :n_tiles * block_v].

  Args:
    x: [B, H].
    w: [H, V], V >= n_tiles * block_v; later columns are not read.
    n_tiles: Vocabulary tiles (at least 1).
    precision: The matmul precision.
    block_b: Rows per tile (a multiple of 8, 16 for 16-bit inputs).
    block_v: Vocabulary columns per tile (a multiple of 128).
    block_k: Contraction per step; divides H (a multiple of 128, or H).
    vmem_limit_bytes: Scoped VMEM that Mosaic may use.
    interpret: The TPU interpreter's params, or None to compile.
  """
  b, h = x.shape
  if h % block_k:
    raise ValueError(f"block_k={block_k} must divide H={h}")
  if n_tiles < 1 or n_tiles * block_v > w.shape[1]:
    raise ValueError(f"{n_tiles} tiles of {block_v} do not fit V={w.shape[1]}")
  num_k = h // block_k
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=0,
    grid=(pl.cdiv(b, block_b), n_tiles, num_k),
    in_specs=[
      pl.BlockSpec((block_b, block_k), lambda i, j, k: (i, k)),
      pl.BlockSpec((block_k, block_v), lambda i, j, k: (k, j)),
    ],
    out_specs=pl.BlockSpec((block_b, LANES), lambda i, j, k: (i, 0)),
    scratch_shapes=[
      pltpu.VMEM((block_b, block_v), jnp.float32),
      pltpu.VMEM((block_b, LANES), jnp.float32),
      pltpu.VMEM((block_b, LANES), jnp.float32),
    ],
  )
  out = pl.pallas_call(
    functools.partial(_kernel, precision=precision, num_k=num_k),
    out_shape=partitioning.kernel_output((b, LANES), jnp.float32, x, w),
    grid_spec=grid_spec,
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "arbitrary", "arbitrary"),
      vmem_limit_bytes=vmem_limit_bytes,
    ),
    interpret=interpret,
    name="tokamax_linear_softmax_cross_entropy_lse",
  )(x, w)
  return out[:, 0]


def _dlogits(x, w, lse_ref, label_ref, g_ref, col0, precision):
  """(softmax(x @ w) - onehot(label)) * g of one tile, in x's dtype (lse, label, g [rows, 128])."""
  logits = lax.dot_general(
    x, w, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
  )
  width = logits.shape[1]
  cols = col0 + lax.broadcasted_iota(jnp.int32, logits.shape, 1)
  hit = (cols == _wide(label_ref[...], width)).astype(jnp.float32)
  p = jnp.exp(logits - _wide(lse_ref[...], width))
  return ((p - hit) * _wide(g_ref[...], width)).astype(x.dtype)


def _dx_kernel(
  x_ref, w_ref, lse_ref, label_ref, g_ref, dx_ref, acc_ref, *, precision, block_v: int
):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  w = w_ref[...]
  dl = _dlogits(x_ref[...], w, lse_ref, label_ref, g_ref, j * block_v, precision)
  acc_ref[...] += lax.dot_general(
    dl, w, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
  )

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    dx_ref[...] = acc_ref[...].astype(dx_ref.dtype)


def _dw_kernel(
  x_ref, w_ref, lse_ref, label_ref, g_ref, dw_ref, acc_ref, *, precision, rows: int, block_v: int
):
  j, i = pl.program_id(0), pl.program_id(1)

  @pl.when(i == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  # Rows past B (a partial last row tile) hold undefined data: zero them and their dlogits.
  block_b = x_ref.shape[0]
  valid = i * block_b + lax.broadcasted_iota(jnp.int32, (block_b, 1), 0) < rows
  x = jnp.where(valid, x_ref[...], jnp.zeros((), x_ref.dtype))
  dl = _dlogits(x, w_ref[...], lse_ref, label_ref, g_ref, j * block_v, precision)
  dl = jnp.where(valid, dl, jnp.zeros((), dl.dtype))
  acc_ref[...] += lax.dot_general(
    x, dl, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
  )

  @pl.when(i == pl.num_programs(1) - 1)
  def _():
    dw_ref[...] = acc_ref[...].astype(dw_ref.dtype)


def backward(
  x: jax.Array,
  w: jax.Array,
  labels: jax.Array,
  lse: jax.Array,
  g: jax.Array,
  *,
  n_tiles: int,
  precision,
  block_b: int,
  block_v: int,
  vmem_limit_bytes: int,
  interpret: pltpu.InterpretParams | None,
) -> tuple[jax.Array, jax.Array]:
  """dx [B, H] (float32) and dw [H, n_tiles * block_v] (w's dtype) over the first tiles.

  Two kernels recompute each (row tile, vocabulary tile) of logits with the whole
  H in VMEM: dx accumulates dlogits @ w_tile.T over the vocabulary tiles of a row
  tile, dw accumulates x_tile.T @ dlogits over the row tiles of a vocabulary tile.

  Args:
    x: [B, H].
    w: [H, V], V >= n_tiles * block_v; later columns are not read.
    labels: int32 [B].
    lse: float32 [B], the rows' log-sum-exp over all V columns.
    g: float32 [B], the rows' loss cotangents.
    n_tiles: Vocabulary tiles (at least 1).
    precision: The matmul precision.
    block_b: Rows per tile (a multiple of 8, 16 for 16-bit inputs).
    block_v: Vocabulary columns per tile (a multiple of 128).
    vmem_limit_bytes: Scoped VMEM that Mosaic may use.
    interpret: The TPU interpreter's params, or None to compile.
  """
  b, h = x.shape
  if n_tiles < 1 or n_tiles * block_v > w.shape[1]:
    raise ValueError(f"{n_tiles} tiles of {block_v} do not fit V={w.shape[1]}")
  rows = [
    jnp.broadcast_to(a[:, None], (b, LANES))
    for a in (lse.astype(jnp.float32), labels.astype(jnp.int32), g.astype(jnp.float32))
  ]
  n_rows = pl.cdiv(b, block_b)

  def params(semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=vmem_limit_bytes)

  row_spec = lambda index: pl.BlockSpec((block_b, LANES), index)
  dx = pl.pallas_call(
    functools.partial(_dx_kernel, precision=precision, block_v=block_v),
    out_shape=partitioning.kernel_output((b, h), jnp.float32, x, w, *rows),
    grid=(n_rows, n_tiles),
    in_specs=[
      pl.BlockSpec((block_b, h), lambda i, j: (i, 0)),
      pl.BlockSpec((h, block_v), lambda i, j: (0, j)),
      *[row_spec(lambda i, j: (i, 0))] * 3,
    ],
    out_specs=pl.BlockSpec((block_b, h), lambda i, j: (i, 0)),
    scratch_shapes=[pltpu.VMEM((block_b, h), jnp.float32)],
    compiler_params=params(("parallel", "arbitrary")),
    interpret=interpret,
    name="tokamax_linear_softmax_cross_entropy_dx",
  )(x, w, *rows)
  dw = pl.pallas_call(
    functools.partial(_dw_kernel, precision=precision, rows=b, block_v=block_v),
    out_shape=partitioning.kernel_output((h, n_tiles * block_v), w.dtype, x, w, *rows),
    grid=(n_tiles, n_rows),
    in_specs=[
      pl.BlockSpec((block_b, h), lambda j, i: (i, 0)),
      pl.BlockSpec((h, block_v), lambda j, i: (0, j)),
      *[row_spec(lambda j, i: (i, 0))] * 3,
    ],
    out_specs=pl.BlockSpec((h, block_v), lambda j, i: (0, j)),
    scratch_shapes=[pltpu.VMEM((h, block_v), jnp.float32)],
    compiler_params=params(("parallel", "arbitrary")),
    interpret=interpret,
    name="tokamax_linear_softmax_cross_entropy_dw",
  )(x, w, *rows)
  return dx, dw
