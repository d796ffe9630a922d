"""Mosaic GPU (Hopper) ragged-contracting grouped matmul: the drhs kernel.

`out[g] = lhs[rows of g].T @ rhs[rows of g]`, lhs [M,K], rhs [M,N], out [G,K,N].

Persistent over work items (group, K tile, N tile). Each item pipelines over
row chunks of `block_m` rows that start at its group's first row rounded down
to `chunk_align` rows (8 by default, the TMA row tiling): a group of s rows
starting at row r needs ceil((s + r mod chunk_align) / block_m) chunks, zero
for an empty group, which then just writes zeros. (`chunk_align=block_m` gives
chunks at multiples of `block_m`, up to one more per group.) The first and last
chunk of a group may hold rows of its neighbours, and the last one may run past
the last row, which TMA reads as zeros: the compute warpgroups zero the rows
outside the group in shared memory before their wgmma: each its own 64 columns
of the lhs tile and alternate 64-column tiles of the shared rhs tile, then a
barrier, so that a non-finite value in a row outside the group (0 * inf) cannot
reach the group's product. Two compute warpgroups each own 64 rows of the K
tile; a third warpgroup issues the TMA loads.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax._src.ops import mosaic_gemm as gemm
from tokamax._src.ops.ragged_dot import spec

WG_ROWS = gemm.WG_ROWS
NUM_COMPUTE_WGS = gemm.NUM_COMPUTE_WGS
ROW_ALIGN = gemm.ROW_ALIGN
# Row alignment of each group's first chunk when `MosaicRaggedDotDrhsConfig.chunk_align` is None
# (read at trace time, so that a benchmark can compare ROW_ALIGN with block_m).
CHUNK_ALIGN = ROW_ALIGN


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicRaggedDotDrhsConfig:
  """Tiling of the drhs kernel.

  Attributes:
    block_n: Output columns per work item.
    block_m: Rows of lhs/rhs (the contraction) per pipeline stage.
    num_stages: Shared-memory stages of the load pipeline.
    epi_n: Output columns per epilogue store.
    chunk_align: A group's first row chunk starts at its first row rounded
      down to a multiple of this (a multiple of ROW_ALIGN dividing block_m);
      None: CHUNK_ALIGN.
  """

  block_n: int = 256
  block_m: int = 64
  num_stages: int = 4
  epi_n: int = 128
  chunk_align: int | None = None

  @property
  def block_k(self) -> int:
    return WG_ROWS * NUM_COMPUTE_WGS


def smem_bytes(config: MosaicRaggedDotDrhsConfig, in_itemsize: int, out_itemsize: int) -> int:
  stage = (config.block_k + config.block_n) * config.block_m * in_itemsize
  epilogue = NUM_COMPUTE_WGS * WG_ROWS * config.epi_n * out_itemsize
  return config.num_stages * stage + epilogue


def config_reason(
  config: MosaicRaggedDotDrhsConfig, m: int, k: int, n: int, in_itemsize: int, out_itemsize: int
):
  del m
  if (reason := gemm.columns_reason(config, n)) is not None:
    return reason
  if k % config.block_k:
    return f"K={k} must be a multiple of {config.block_k}"
  if (reason := gemm.tile_reason(config, "block_m", in_itemsize)) is not None:
    return reason
  align = chunk_align(config)
  if align % ROW_ALIGN or config.block_m % align:
    return f"chunk_align={align} must be a multiple of {ROW_ALIGN} dividing {config.block_m}"
  return gemm.smem_reason(config, smem_bytes(config, in_itemsize, out_itemsize))


def chunk_align(config: MosaicRaggedDotDrhsConfig) -> int:
  """Row alignment of each group's first chunk."""
  return CHUNK_ALIGN if config.chunk_align is None else config.chunk_align


def group_bounds(sizes: jax.Array, before: jax.Array | None, m: int) -> jax.Array:
  """int32 [G, 2]: first and end row of each group, clipped to [0, m]."""
  return jnp.stack(spec.group_row_bounds(sizes, before, m), axis=1)


def ragged_contracting_dot(
  lhs: jax.Array,
  rhs: jax.Array,
  sizes: jax.Array,
  before: jax.Array | None,
  *,
  out_dtype,
  config: MosaicRaggedDotDrhsConfig,
  num_sms: int,
  interpret=None,
) -> jax.Array:
  """Per group g, `lhs[rows g].T @ rhs[rows g]`.

  Args:
    lhs: [M, K].
    rhs: [M, N].
    sizes: [G] rows per group.
    before: Rows before the first group, or None.
    out_dtype: Output dtype.
    config: Tiling.
    num_sms: Persistent CTAs.
    interpret: Pallas interpret parameters, or None.

  Returns:
    [G, K, N].
  """
  m, k = lhs.shape
  n = rhs.shape[1]
  g = sizes.shape[0]
  bk, bn, bm = config.block_k, config.block_n, config.block_m
  epi_n = config.epi_n
  k_tiles, n_tiles = k // bk, n // bn
  align = chunk_align(config)
  bounds = group_bounds(sizes, before, m)
  tf = gemm.transforms(lhs.dtype)
  out_tf = gemm.transforms(out_dtype) if epi_n * jnp.dtype(out_dtype).itemsize >= 128 else ()
  out_dtype = jnp.dtype(out_dtype)

  def make_pipeline(body, compute_context, steps, row0, ki, ni):
    # Row chunks at element offsets row0 + s * bm (row0 a multiple of align).
    rows = lambda s: pl.multiple_of(row0 + s * bm, align)
    in_specs = [
      plgpu.BlockSpec(
        (pl.Element(bm), bk), lambda s: (rows(s), ki), transforms=tf, delay_release=0
      ),
      plgpu.BlockSpec(
        (pl.Element(bm), bn), lambda s: (rows(s), ni), transforms=tf, delay_release=0
      ),
    ]
    return gemm.pipeline(body, compute_context, steps, in_specs, config.num_stages)

  def kernel(bounds_ref, lhs_ref, rhs_ref, out_ref):
    nothing = lambda *_, **__: None

    @functools.partial(
      pl.run_scoped,
      allocs=make_pipeline(nothing, nothing, jnp.int32(1), jnp.int32(0), 0, 0).get_allocations(
        lhs_ref, rhs_ref
      ),
      o_smem=plgpu.SMEM((NUM_COMPUTE_WGS, WG_ROWS, epi_n), out_dtype, transforms=out_tf),
      masked=plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS),
      collective_axes="wg",
    )
    def scope(allocs, o_smem, masked):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((g * k_tiles * n_tiles,), collective_axes="sm")
      def _item_loop(info):
        (idx,) = info.index
        gi = lax.div(idx, k_tiles * n_tiles)
        rest = lax.rem(idx, k_tiles * n_tiles)
        ki = lax.div(rest, n_tiles)
        ni = lax.rem(rest, n_tiles)
        start = bounds_ref[gi, 0]
        end = bounds_ref[gi, 1]
        row0 = lax.div(start, align) * align
        steps = jnp.where(end > start, lax.div(end - row0 + bm - 1, bm), 0)

        def mma(idxs, a_smem, b_smem, acc):
          (s,) = idxs
          a_wg = a_smem.at[:, pl.ds(wg * WG_ROWS, WG_ROWS)]

          # Only a chunk that holds rows outside the group: one starting before it (an
          # unaligned first row) or running past its end.
          first_partial = (s == 0) & (row0 < start)
          last_partial = (s == steps - 1) & (row0 + steps * bm > end)

          @pl.when(first_partial | last_partial)
          def _mask_rows_outside_group():
            row = (
              row0
              + s * bm
              + plgpu.layout_cast(
                lax.broadcasted_iota(jnp.int32, (bm, WG_ROWS), 0), plgpu.Layout.WGMMA
              )
            )
            keep = (row >= start) & (row < end)
            zero = jnp.zeros((), a_wg.dtype)
            a_wg[...] = jnp.where(keep, a_wg[...], zero)
            for c in range(bn // WG_ROWS):

              @pl.when(wg == c % NUM_COMPUTE_WGS)
              def _mask_rhs_tile(c=c):
                b_tile = b_smem.at[:, pl.ds(c * WG_ROWS, WG_ROWS)]
                b_tile[...] = jnp.where(keep, b_tile[...], zero)

            plgpu.commit_smem()
            # The other warpgroup's wgmma reads the rhs tiles this one masked.
            plgpu.barrier_arrive(masked)
            plgpu.barrier_wait(masked)

          plgpu.wgmma(acc, a_wg.T, b_smem)
          plgpu.wgmma_wait(0)
          return acc

        o_wg = o_smem.at[wg]

        def store(c):
          rows = pl.ds(ki * bk + wg * WG_ROWS, WG_ROWS)
          plgpu.copy_smem_to_gmem(o_wg, out_ref.at[gi, rows, pl.ds(ni * bn + c * epi_n, epi_n)])

        compute_context = gemm.stored_accumulator(bn, epi_n, o_wg, out_dtype, store)
        make_pipeline(mma, compute_context, steps, row0, ki, ni)(
          lhs_ref, rhs_ref, allocations=allocs
        )

      plgpu.wait_smem_to_gmem(0)

  call = gemm.kernel(
    kernel, jax.ShapeDtypeStruct((g, k, n), out_dtype), num_sms=num_sms, interpret=interpret
  )
  return call(bounds, lhs, rhs)
