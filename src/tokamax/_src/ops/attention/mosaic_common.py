"""Masking and block ranges shared by the Mosaic GPU attention kernels.

Every kernel walks one operand in blocks while it holds a block of the other.
For a held block it needs the range of streamed blocks that can see anything
(`lo`, `hi`) and, inside it, the range that needs no mask at all (`full_lo`,
`full_hi`); the steps in [lo, full_lo) and [full_hi, hi) apply `visible`.
"""

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class Masking:
  """The static part of the visibility rule (see `spec.visible`).

  Attributes:
    causal: key j is visible to query i only when j <= i.
    window: (left, right): only i - left <= j <= i + right, or None.
    q_len: whether per-batch query lengths apply (rows >= q_len are dropped).
    kv_len: whether per-batch key lengths apply (keys >= kv_len are hidden).
  """

  causal: bool = False
  window: tuple[int, int] | None = None
  q_len: bool = False
  kv_len: bool = False


def _i32(x) -> jax.Array:
  return jnp.asarray(x, jnp.int32)


_OFFSET = 1 << 30  # Keeps dividends non-negative so truncation is floor.


def _floor_div(x, d: int) -> jax.Array:
  """Floor division of int32 `x` (|x| < 2**30) by a positive constant."""
  k = _OFFSET // d
  return lax.div(_i32(x) + k * d, _i32(d)) - k


def _cdiv(x, d: int) -> jax.Array:
  return -_floor_div(-_i32(x), d)


def kv_blocks(m: Masking, r0, rows: int, block_kv: int, num_kv: int, kv_len):
  """Key blocks seen by query rows [r0, r0 + rows): (lo, full_lo, full_hi, hi)."""
  r0 = _i32(r0)
  r_last = r0 + rows - 1
  lo, hi = _i32(0), _i32(num_kv)
  full_lo, full_hi = _i32(0), _i32(num_kv)
  if m.causal:  # j <= i
    hi = jnp.minimum(hi, _cdiv(r_last + 1, block_kv))
    full_hi = jnp.minimum(full_hi, _floor_div(r0 + 1, block_kv))
  if m.window is not None:
    left, right = m.window
    lo = jnp.maximum(lo, _floor_div(r0 - left, block_kv))
    hi = jnp.minimum(hi, _cdiv(r_last + right + 1, block_kv))
    full_lo = jnp.maximum(full_lo, _cdiv(r_last - left, block_kv))
    full_hi = jnp.minimum(full_hi, _floor_div(r0 + right + 1, block_kv))
  if m.kv_len:
    hi = jnp.minimum(hi, _cdiv(kv_len, block_kv))
    full_hi = jnp.minimum(full_hi, _floor_div(kv_len, block_kv))
  return _clamp_ranges(lo, full_lo, full_hi, hi)


@dataclasses.dataclass(frozen=True)
class QueryTile:
  """What a CTA that holds `consumers` query blocks of `block_q` rows works on."""

  head: jax.Array
  batch: jax.Array
  kv_head: jax.Array
  q_len: jax.Array | int
  kv_len: jax.Array | int
  r0: jax.Array  # First query row of the CTA.
  ranges: list  # `kv_blocks` of each consumer's query block.
  lo: jax.Array  # Key blocks any consumer needs: [lo, hi).
  hi: jax.Array


def query_tile(
  m: Masking,
  len_ref,
  *,
  t: int,
  s_len: int,
  groups: int,
  block_q: int,
  block_kv: int,
  consumers: int,
) -> QueryTile:
  """The query tile of this CTA (grid axes "heads", "q_tiles", "batch"), heaviest causal first.

  `len_ref` holds int32 [2, B] query and key lengths.
  """
  rows_per_cta = consumers * block_q
  tile = pl.cdiv(t, rows_per_cta) - 1 - lax.axis_index("q_tiles")
  head = lax.axis_index("heads")
  batch = lax.axis_index("batch")
  q_len = len_ref[0, batch] if m.q_len else t
  kv_len = len_ref[1, batch] if m.kv_len else s_len
  r0 = tile * rows_per_cta
  num_kv = s_len // block_kv
  ranges = [
    kv_blocks(m, r0 + i * block_q, block_q, block_kv, num_kv, kv_len) for i in range(consumers)
  ]
  if t % rows_per_cta:
    # The last tile is partial: its consumers past row t (whole blocks, as block_q divides
    # t) get an empty range at the first consumer's start, which needs no extra key blocks.
    assert t % block_q == 0, (t, block_q)
    start = ranges[0][0]
    ranges = [
      tuple(jnp.where(r0 + i * block_q < t, x, start) for x in r) for i, r in enumerate(ranges)
    ]
  return QueryTile(
    head=head,
    batch=batch,
    kv_head=lax.div(head, jnp.int32(groups)),
    q_len=q_len,
    kv_len=kv_len,
    r0=r0,
    ranges=ranges,
    lo=functools.reduce(jnp.minimum, [r[0] for r in ranges]),
    hi=functools.reduce(jnp.maximum, [r[3] for r in ranges]),
  )


def of_consumer(wg, values):
  """values[wg] for a traced warpgroup index `wg`."""
  out = values[-1]
  for i in range(len(values) - 2, -1, -1):
    out = jnp.where(wg == i, values[i], out)
  return out


def q_blocks(m: Masking, c0, cols: int, block_q: int, num_q: int, q_len, kv_len):
  """Query blocks that see key columns [c0, c0 + cols): (lo, full_lo, full_hi, hi)."""
  c0 = _i32(c0)
  c_last = c0 + cols - 1
  lo, hi = _i32(0), _i32(num_q)
  full_lo, full_hi = _i32(0), _i32(num_q)
  if m.causal:  # i >= j
    lo = jnp.maximum(lo, _floor_div(c0, block_q))
    full_lo = jnp.maximum(full_lo, _cdiv(c_last, block_q))
  if m.window is not None:
    left, right = m.window  # j - right <= i <= j + left
    lo = jnp.maximum(lo, _floor_div(c0 - right, block_q))
    hi = jnp.minimum(hi, _cdiv(c_last + left + 1, block_q))
    full_lo = jnp.maximum(full_lo, _cdiv(c_last - right, block_q))
    full_hi = jnp.minimum(full_hi, _floor_div(c0 + left + 1, block_q))
  if m.q_len:
    hi = jnp.minimum(hi, _cdiv(q_len, block_q))
    full_hi = jnp.minimum(full_hi, _floor_div(q_len, block_q))
  if m.kv_len:
    hi = jnp.where(c0 < kv_len, hi, 0)
    full_hi = jnp.where(c_last < kv_len, full_hi, 0)
  return _clamp_ranges(lo, full_lo, full_hi, hi)


def _clamp_ranges(lo, full_lo, full_hi, hi):
  hi = jnp.maximum(hi, lo)
  full_lo = jnp.clip(full_lo, lo, hi)
  full_hi = jnp.clip(full_hi, full_lo, hi)
  return lo, full_lo, full_hi, hi


def visible(m: Masking, q_ids: jax.Array, k_ids: jax.Array, q_len, kv_len) -> jax.Array | None:
  """Elementwise visibility of absolute query ids against key ids (same shape)."""
  ok = None

  def both(a, b):
    return b if a is None else a & b

  if m.causal:
    ok = both(ok, k_ids <= q_ids)
  if m.window is not None:
    left, right = m.window
    ok = both(ok, (k_ids >= q_ids - left) & (k_ids <= q_ids + right))
  if m.kv_len:
    ok = both(ok, k_ids < kv_len)
  if m.q_len:
    ok = both(ok, q_ids < q_len)
  return ok


def log2_logits(s: jax.Array, bias: jax.Array | None, scale: float, soft_cap: float | None):
  """(biased, soft-capped logits of `s` in log2 units, tanh of the soft cap or None).

  The logits are None when neither a bias nor a soft cap applies: the scale then
  folds into the exponent (`s * scale * LOG2E`).
  """
  if bias is not None:
    bias = bias.astype(jnp.float32)
  if soft_cap is None:
    return (None if bias is None else s * (scale * LOG2E) + bias * LOG2E), None
  z = s * (scale / soft_cap) if bias is None else (s * scale + bias) * (1.0 / soft_cap)
  t = jnp.tanh(z)
  return t * (soft_cap * LOG2E), t


def hide(logits: jax.Array, ok: jax.Array | None, mask_tile: jax.Array | None) -> jax.Array:
  """`logits` with -inf where `ok` (see `visible`) or a mask tile (nonzero: visible) hides them."""
  if mask_tile is not None:
    keep = mask_tile != 0
    ok = keep if ok is None else ok & keep
  return logits if ok is None else jnp.where(ok, logits, -jnp.inf)


def extra_refs(refs, bias, mask) -> tuple:
  """(bias ref, mask ref), each None when absent, from a kernel's refs that start with them."""
  bias_ref = refs[0] if bias is not None else None
  mask_ref = refs[int(bias is not None)] if mask is not None else None
  return bias_ref, mask_ref


def is_full_plane(x) -> bool:
  """Whether a bias or mask [B|1, N|1, R|1, C|1] varies over both R and C."""
  return x is not None and x.shape[2] > 1 and x.shape[3] > 1


def plane_of(ref, batch, head):
  """The [R|1, C|1] slice of a bias or mask ref [B|1, N|1, R|1, C|1] at (batch, head)."""
  b, n = ref.shape[:2]
  return ref.at[batch if b > 1 else 0, head if n > 1 else 0]


def extra_planes(refs, batch, head, r0, rows: int) -> list:
  """(plane, row values) of the bias and mask refs (`extra_refs`) for a held block.

  The plane is the [R|1, C|1] slice of a ref [B|1, N|1, R|1, C|1] at (batch,
  head), or None without the ref; the row values are `extra_rows` at rows
  [r0, r0 + rows). `extra_tiles` reads the tiles of a step from them.
  """
  planes = []
  for ref in refs:
    plane = None if ref is None else plane_of(ref, batch, head)
    planes.append((plane, extra_rows(plane, r0, rows)))
  return planes


def extra_tiles(planes, r0, step, rows: int, cols: int) -> tuple:
  """(bias tile, mask tile) of `extra_planes` at column block `step`, each None when absent."""
  return tuple(extra_tile(plane, values, r0, step, rows, cols) for plane, values in planes)


def extra_rows(plane, r0, rows: int) -> jax.Array | None:
  """An [R, 1] plane's values at rows [r0, r0 + rows), or None if it is not [R, 1]."""
  if plane is None or plane.shape[1] > 1:
    return None
  layout = plgpu.Layout.WGMMA.reduce(1)
  return plgpu.load(plane.at[pl.ds(r0, rows), 0], layout=layout, optimized=False)


def extra_tile(plane, row_values, r0, step, rows: int, cols: int) -> jax.Array | None:
  """The [rows, cols] tile of a bias or mask plane at row r0 and column block `step`.

  Loaded from global memory into registers in the WGMMA layout; a broadcast dim
  is broadcast in registers. `row_values` is what `extra_rows` returned, so an
  [R, 1] plane is read once per held block.
  """
  if plane is None:
    return None
  shape, wgmma = (rows, cols), plgpu.Layout.WGMMA
  if row_values is not None:
    return lax.broadcast_in_dim(row_values, shape, [0])
  c0 = step * cols
  if plane.shape[0] == 1:
    col_values = plgpu.load(plane.at[0, pl.ds(c0, cols)], layout=wgmma.reduce(0), optimized=False)
    return lax.broadcast_in_dim(col_values, shape, [1])
  return plgpu.load(plane.at[pl.ds(r0, rows), pl.ds(c0, cols)], layout=wgmma, optimized=False)


def iota(shape: tuple[int, int], dim: int) -> jax.Array:
  """int32 iota in the WGMMA accumulator layout."""
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def rows(shape: tuple[int], value: float) -> jax.Array:
  """A float32 [rows] constant in the layout of a row reduction of a WGMMA tile."""
  return plgpu.layout_cast(jnp.full(shape, value, jnp.float32), plgpu.Layout.WGMMA.reduce(1))


def tile(shape: tuple[int, int], value: float) -> jax.Array:
  """A float32 constant tile in the WGMMA accumulator layout."""
  return plgpu.layout_cast(jnp.full(shape, value, jnp.float32), plgpu.Layout.WGMMA)


def smem_transforms(dtype, minor_dim: int, contracted: int | None = None) -> tuple:
  """Tiling and swizzle of a [rows, minor_dim] shared-memory tile used by wgmma.

  The swizzle is the largest (up to 128 bytes) that fits a row and, when the
  tile takes part in a product that contracts `contracted` elements, whole
  groups of swizzle // itemsize of them (wgmma takes one swizzle for both
  operands): a 32-element bfloat16 contraction takes 64 bytes.
  """
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = min(128, minor_dim * itemsize, (contracted or minor_dim) * itemsize)
  return (
    plgpu.TilingTransform((8, swizzle // itemsize)),
    plgpu.SwizzleTransform(swizzle),
  )
