"""Pallas Mosaic TPU grouped matmuls over contiguous row groups.

`grouped_matmul`: out[rows of g] = lhs[rows of g] @ rhs[g] (or @ rhs[g].T),
the forward pass and the lhs gradient. `transposed_grouped_matmul`:
out[g] = lhs[rows of g].T @ rhs[rows of g], the rhs gradient.

Both walk a list of work items, each a (segment, row tile) pair: a row tile of
`block_m` rows that a segment of rows (a group) overlaps. A tile that straddles
a group boundary is visited once per group, by consecutive items, so its
output block stays in VMEM between them. The list is computed by a few small
XLA ops and handed to the kernel as scalar-prefetched SMEM arrays that the
block index maps read. Its length is static (row tiles + segments - 1, the
most it can need); the items past the real ones are dead: they keep the last
real item's block indices (no DMA) and do nothing.

`grouped_matmul` covers every row of the output: rows before a group offset
and rows past the last group form two zero segments, written without a matmul.
Each item writes the rows of its segment at its last contraction step; the
first item of a tile zeroes the tile's other rows, which later items overwrite.

`transposed_grouped_matmul` accumulates a group's items in a float32 VMEM
block and stores it at the group's last item; an empty group has one item that
stores zeros. In a tile that the group covers only in part, rows outside the
group are masked to zero in both operands before the matmul (a tile past M
holds undefined rows); a tile inside the group is used as it is.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tokamax._src.ops import partitioning

# Kinds of `grouped_matmul` work items.
_DEAD, _ZERO, _COMPUTE = 0, 1, 2


def _work_items(
  starts: jax.Array, ends: jax.Array, m: int, block_m: int, keep_empty: bool
) -> dict[str, jax.Array]:
  """The work list over the (segment, row tile) pairs of row segments.

  Args:
    starts: int32 [S] first row of each segment, in row order.
    ends: int32 [S] end row of each segment (>= its start).
    m: Rows.
    block_m: Rows per tile.
    keep_empty: Whether an empty segment gets one item (else none).

  Returns:
    int32 [m tiles + S - 1] arrays: "segment", "tile", "live" (0 past the
    real items, which repeat the last real item's segment and tile).
  """
  num_tiles = pl.cdiv(m, block_m)
  num_items = num_tiles + starts.shape[0] - 1
  nonempty = ends > starts
  first_tile = jnp.minimum(starts // block_m, num_tiles - 1)
  last_tile = jnp.where(nonempty, (ends - 1) // block_m, first_tile)
  counts = jnp.where(nonempty, last_tile - first_tile + 1, 1 if keep_empty else 0)
  item_ends = jnp.cumsum(counts)
  total = item_ends[-1]
  index = jnp.arange(num_items, dtype=jnp.int32)
  real = jnp.minimum(index, total - 1)
  segment = jnp.searchsorted(item_ends, real, side="right").astype(jnp.int32)
  tile = first_tile[segment] + real - (item_ends[segment] - counts[segment])
  return {
    "segment": segment,
    "tile": tile.astype(jnp.int32),
    "live": (index < total).astype(jnp.int32),
  }


def _changed(x: jax.Array, shift: int) -> jax.Array:
  """Whether x[i] differs from x[i - shift] (shift 1) or x[i + 1] (shift -1); True at the edge."""
  edge = jnp.ones((1,), bool)
  if shift == 1:
    return jnp.concatenate([edge, x[1:] != x[:-1]])
  return jnp.concatenate([x[:-1] != x[1:], edge])


def _grouped_matmul_kernel(
  tile_ref,
  group_ref,
  kind_ref,
  start_ref,
  end_ref,
  first_ref,
  lhs_ref,
  rhs_ref,
  out_ref,
  acc_ref,
  *,
  transpose_rhs: bool,
  precision,
  block_m: int,
  num_k: int,
):
  i, k = pl.program_id(1), pl.program_id(2)
  compute = kind_ref[i] == _COMPUTE

  @pl.when(compute & (k == 0))
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(compute)
  def _():
    contract = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
    acc_ref[...] += lax.dot_general(
      lhs_ref[...], rhs_ref[...], contract, precision=precision, preferred_element_type=jnp.float32
    )

  @pl.when((kind_ref[i] != _DEAD) & (k == num_k - 1))
  def _():
    rows = tile_ref[i] * block_m + lax.broadcasted_iota(jnp.int32, out_ref.shape, 0)
    start, end = start_ref[i], end_ref[i]
    mine = (rows >= start) & (rows < end)
    product_end = jnp.where(compute, end, start)  # A zero segment takes no product row.
    value = jnp.where((rows >= start) & (rows < product_end), acc_ref[...], 0.0)
    value = value.astype(out_ref.dtype)

    @pl.when(first_ref[i] == 1)
    def _():
      out_ref[...] = value

    @pl.when(first_ref[i] == 0)
    def _():
      out_ref[...] = jnp.where(mine, value, out_ref[...])


def grouped_matmul(
  lhs: jax.Array,
  rhs: jax.Array,
  starts: jax.Array,
  ends: jax.Array,
  *,
  transpose_rhs: bool,
  out_dtype,
  precision,
  block_m: int,
  block_k: int,
  block_n: int,
  vmem_limit_bytes: int,
  interpret: pltpu.InterpretParams | None,
) -> jax.Array:
  """out[starts[g]:ends[g]] = lhs[starts[g]:ends[g]] @ rhs[g] (`transpose_rhs`: rhs[g].T).

  Args:
    lhs: [M, K].
    rhs: [G, K, N], or [G, N, K] with `transpose_rhs`.
    starts: int32 [G] first row of each group, in row order.
    ends: int32 [G] end row of each group, contiguous: ends[g] == starts[g + 1].
    transpose_rhs: Whether rhs is [G, N, K].
    out_dtype: The output dtype.
    precision: The matmul precision.
    block_m: Rows per tile (a multiple of 8, 16 for 16-bit inputs).
    block_k: Contraction per step; divides K.
    block_n: Output columns per tile (a multiple of 128, or N).
    vmem_limit_bytes: Scoped VMEM that Mosaic may use.
    interpret: The TPU interpreter's params, or None to compile.

  Returns:
    [M, N]; rows outside every group are zero.
  """
  m, k = lhs.shape
  num_groups = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  if k % block_k:
    raise ValueError(f"block_k={block_k} must divide K={k}")
  # Segments: rows before the groups, the groups, rows after them (the first and
  # last are zero segments).
  zero = jnp.zeros((1,), jnp.int32)
  seg_starts = jnp.concatenate([zero, starts, ends[-1:]])
  seg_ends = jnp.concatenate([starts[:1], ends, jnp.full((1,), m, jnp.int32)])
  items = _work_items(seg_starts, seg_ends, m, block_m, keep_empty=False)
  segment, tile, live = items["segment"], items["tile"], items["live"]
  is_group = (segment >= 1) & (segment <= num_groups)
  kind = jnp.where(live == 1, jnp.where(is_group, _COMPUTE, _ZERO), _DEAD).astype(jnp.int32)
  group = jnp.clip(segment - 1, 0, num_groups - 1)
  first = _changed(tile, 1).astype(jnp.int32)
  prefetch = (tile, group, kind, seg_starts[segment], seg_ends[segment], first)
  num_k = k // block_k

  def k_step(kk, i, kind_ref):  # Items without a matmul keep the last block: no DMA.
    return jnp.where(kind_ref[i] == _COMPUTE, kk, num_k - 1)

  def lhs_map(j, i, kk, tile_ref, group_ref, kind_ref, *_):
    return tile_ref[i], k_step(kk, i, kind_ref)

  def rhs_map(j, i, kk, tile_ref, group_ref, kind_ref, *_):
    kk = k_step(kk, i, kind_ref)
    return (group_ref[i], j, kk) if transpose_rhs else (group_ref[i], kk, j)

  def out_map(j, i, kk, tile_ref, *_):
    return tile_ref[i], j

  rhs_block = (block_n, block_k) if transpose_rhs else (block_k, block_n)
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=len(prefetch),
    grid=(pl.cdiv(n, block_n), tile.shape[0], num_k),
    in_specs=[
      pl.BlockSpec((block_m, block_k), lhs_map),
      pl.BlockSpec((pl.Squeezed(), *rhs_block), rhs_map),
    ],
    out_specs=pl.BlockSpec((block_m, block_n), out_map),
    scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)],
  )
  kernel = functools.partial(
    _grouped_matmul_kernel,
    transpose_rhs=transpose_rhs,
    precision=precision,
    block_m=block_m,
    num_k=num_k,
  )
  return pl.pallas_call(
    kernel,
    out_shape=partitioning.kernel_output((m, n), out_dtype, *prefetch, lhs, rhs),
    grid_spec=grid_spec,
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "arbitrary", "arbitrary"),
      vmem_limit_bytes=vmem_limit_bytes,
    ),
    interpret=interpret,
    name="tokamax_grouped_matmul",
  )(*prefetch, lhs, rhs)


def _transposed_grouped_matmul_kernel(
  tile_ref,
  group_ref,
  start_ref,
  end_ref,
  first_ref,
  last_ref,
  lhs_ref,
  rhs_ref,
  out_ref,
  acc_ref,
  *,
  precision,
  block_m: int,
):
  i = pl.program_id(2)
  start, end, row0 = start_ref[i], end_ref[i], tile_ref[i] * block_m
  whole = (start <= row0) & (row0 + block_m <= end)  # Every row of the tile is the group's.

  @pl.when(first_ref[i] == 1)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  def accumulate(masked: bool):
    def rows_of_group(x):
      if not masked:
        return x
      rows = row0 + lax.broadcasted_iota(jnp.int32, x.shape, 0)
      return jnp.where((rows >= start) & (rows < end), x, jnp.zeros_like(x))

    acc_ref[...] += lax.dot_general(
      rows_of_group(lhs_ref[...]),
      rows_of_group(rhs_ref[...]),
      (((0,), (0,)), ((), ())),
      precision=precision,
      preferred_element_type=jnp.float32,
    )

  pl.when(whole)(functools.partial(accumulate, False))
  pl.when((start < end) & ~whole)(functools.partial(accumulate, True))

  @pl.when(last_ref[i] == 1)
  def _():
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def transposed_grouped_matmul(
  lhs: jax.Array,
  rhs: jax.Array,
  starts: jax.Array,
  ends: jax.Array,
  *,
  out_dtype,
  precision,
  block_m: int,
  block_k: int,
  block_n: int,
  vmem_limit_bytes: int,
  interpret: pltpu.InterpretParams | None,
) -> jax.Array:
  """out[g] = lhs[starts[g]:ends[g]].T @ rhs[starts[g]:ends[g]].

  Args:
    lhs: [M, K].
    rhs: [M, N].
    starts: int32 [G] first row of each group, in row order.
    ends: int32 [G] end row of each group (groups do not overlap).
    out_dtype: The output dtype.
    precision: The matmul precision.
    block_m: Contracted rows per step (a multiple of 128).
    block_k: Output rows per tile (a multiple of 128, or K).
    block_n: Output columns per tile (a multiple of 128, or N).
    vmem_limit_bytes: Scoped VMEM that Mosaic may use.
    interpret: The TPU interpreter's params, or None to compile.

  Returns:
    [G, K, N]; empty groups give zeros.
  """
  m, k = lhs.shape
  n = rhs.shape[1]
  num_groups = starts.shape[0]
  items = _work_items(starts, ends, m, block_m, keep_empty=True)
  group, tile, live = items["segment"], items["tile"], items["live"]
  live = live == 1
  first = (live & _changed(group, 1)).astype(jnp.int32)
  last = (live & (_changed(group, -1) | ~jnp.roll(live, -1))).astype(jnp.int32)
  # Dead items get an empty row range: no matmul.
  start = jnp.where(live, starts[group], 0)
  end = jnp.where(live, ends[group], 0)
  prefetch = (tile, group, start, end, first, last)

  def lhs_map(kk, j, i, tile_ref, *_):
    return tile_ref[i], kk

  def rhs_map(kk, j, i, tile_ref, *_):
    return tile_ref[i], j

  def out_map(kk, j, i, tile_ref, group_ref, *_):
    return group_ref[i], kk, j

  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=len(prefetch),
    grid=(pl.cdiv(k, block_k), pl.cdiv(n, block_n), tile.shape[0]),
    in_specs=[
      pl.BlockSpec((block_m, block_k), lhs_map),
      pl.BlockSpec((block_m, block_n), rhs_map),
    ],
    out_specs=pl.BlockSpec((pl.Squeezed(), block_k, block_n), out_map),
    scratch_shapes=[pltpu.VMEM((block_k, block_n), jnp.float32)],
  )
  kernel = functools.partial(
    _transposed_grouped_matmul_kernel, precision=precision, block_m=block_m
  )
  return pl.pallas_call(
    kernel,
    out_shape=partitioning.kernel_output((num_groups, k, n), out_dtype, *prefetch, lhs, rhs),
    grid_spec=grid_spec,
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "arbitrary"),
      vmem_limit_bytes=vmem_limit_bytes,
    ),
    interpret=interpret,
    name="tokamax_transposed_grouped_matmul",
  )(*prefetch, lhs, rhs)
