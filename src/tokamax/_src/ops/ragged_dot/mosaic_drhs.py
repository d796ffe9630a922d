"""Mosaic GPU (Hopper) ragged-contracting grouped matmul: the drhs kernel.

`out[g] = lhs[rows of g].T @ rhs[rows of g]`, lhs [M,K], rhs [M,N], out [G,K,N].

Persistent over work items (group, N tile, K tile). Each item pipelines over
row chunks of `block_m` rows that start at its group's first row rounded down
to `chunk_align` rows (8 by default, the TMA row tiling): a group of s rows
starting at row r needs ceil((s + r mod chunk_align) / block_m) chunks, zero
for an empty group, which then just writes zeros. (`chunk_align=block_m` gives
chunks at multiples of `block_m`, up to one more per group.) The first and last
chunk of a group may hold rows of its neighbours, and the last one may run past
the last row, which TMA reads as zeros: the compute warpgroups zero the rows
outside the group of the lhs tile in shared memory before their wgmma. Two
compute warpgroups each own 64 rows of the K tile; a third warpgroup issues the
TMA loads.

With `accumulate`, the kernel adds the product to an existing [G, K, N] array in
place: each compute warpgroup loads its rows of the item's output tile by TMA
while its first wgmma runs, and adds them in the epilogue, so that reading the
running sum costs no time of its own.
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
    cluster: CTAs per cluster (1 or 2): the CTAs of a cluster take adjacent K
      tiles of one N tile and share its rhs tiles (TMA multicast).
  """

  block_n: int = 256
  block_m: int = 64
  num_stages: int = 4
  epi_n: int = 128
  chunk_align: int | None = None
  cluster: int = 1

  @property
  def block_k(self) -> int:
    return WG_ROWS * NUM_COMPUTE_WGS


def smem_bytes(
  config: MosaicRaggedDotDrhsConfig, in_itemsize: int, out_itemsize: int, accumulate: bool = False
) -> int:
  stage = (config.block_k + config.block_n) * config.block_m * in_itemsize
  # With `accumulate`, a warpgroup's whole output tile (its addend, then its sum).
  epilogue = NUM_COMPUTE_WGS * WG_ROWS * _epilogue_columns(config, accumulate) * out_itemsize
  return config.num_stages * stage + epilogue


def _epilogue_columns(config: MosaicRaggedDotDrhsConfig, accumulate: bool) -> int:
  return config.block_n if accumulate else config.epi_n


def config_reason(
  config: MosaicRaggedDotDrhsConfig,
  m: int,
  k: int,
  n: int,
  in_itemsize: int,
  out_itemsize: int,
  accumulate: bool = False,
):
  del m
  if (reason := gemm.columns_reason(config, n)) is not None:
    return reason
  if (reason := gemm.cluster_reason(config)) is not None:
    return reason
  if k % (config.block_k * config.cluster):
    return f"K={k} must be a multiple of {config.block_k * config.cluster} (block_k x cluster)"
  if (reason := gemm.tile_reason(config, "block_m", in_itemsize)) is not None:
    return reason
  align = chunk_align(config)
  if align % ROW_ALIGN or config.block_m % align:
    return f"chunk_align={align} must be a multiple of {ROW_ALIGN} dividing {config.block_m}"
  return gemm.smem_reason(config, smem_bytes(config, in_itemsize, out_itemsize, accumulate))


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
  accumulate: jax.Array | None = None,
  interpret=None,
) -> jax.Array:
  """Per group g, `lhs[rows g].T @ rhs[rows g]` (plus `accumulate[g]`).

  Args:
    lhs: [M, K].
    rhs: [M, N].
    sizes: [G] rows per group.
    before: Rows before the first group, or None.
    out_dtype: Output dtype.
    config: Tiling.
    num_sms: Persistent CTAs.
    accumulate: [G, K, N] in `out_dtype` to add the products to, in its own buffer
      (one rounding of the float32 sum), or None.
    interpret: Pallas interpret parameters, or None.

  Returns:
    [G, K, N].
  """
  m, k = lhs.shape
  n = rhs.shape[1]
  g = sizes.shape[0]
  bk, bn, bm = config.block_k, config.block_n, config.block_m
  epi_n = config.epi_n
  cluster = config.cluster
  k_tiles, n_tiles = k // bk, n // bn
  k_items = k_tiles // cluster  # Items along K per N tile, each of `cluster` K tiles.
  align = chunk_align(config)
  bounds = group_bounds(sizes, before, m)
  tf = gemm.transforms(lhs.dtype)
  out_tf = gemm.transforms(out_dtype) if epi_n * jnp.dtype(out_dtype).itemsize >= 128 else ()
  out_dtype = jnp.dtype(out_dtype)
  if accumulate is not None and (accumulate.shape, accumulate.dtype) != ((g, k, n), out_dtype):
    raise ValueError(
      f"accumulate must be {out_dtype.name} {(g, k, n)}, got "
      f"{accumulate.dtype.name} {accumulate.shape}"
    )
  epi_cols = _epilogue_columns(config, accumulate is not None)

  def make_pipeline(body, compute_context, steps, row0, ki, ni):
    # Row chunks at element offsets row0 + s * bm (row0 a multiple of align).
    rows = lambda s: pl.multiple_of(row0 + s * bm, align)
    in_specs = [
      plgpu.BlockSpec(
        (pl.Element(bm), bk), lambda s: (rows(s), ki), transforms=tf, delay_release=0
      ),
      plgpu.BlockSpec(
        (pl.Element(bm), bn),
        lambda s: (rows(s), ni),
        transforms=tf,
        delay_release=0,
        collective_axes=("cluster",) if cluster > 1 else None,
      ),
    ]
    return gemm.pipeline(body, compute_context, steps, in_specs, config.num_stages)

  def kernel(bounds_ref, lhs_ref, rhs_ref, out_ref):
    nothing = lambda *_, **__: None
    scratch = dict(
      o_smem=plgpu.SMEM((NUM_COMPUTE_WGS, WG_ROWS, epi_cols), out_dtype, transforms=out_tf)
    )
    if accumulate is not None:
      scratch["loaded"] = plgpu.Barrier(num_arrivals=1, num_barriers=NUM_COMPUTE_WGS)

    @functools.partial(
      pl.run_scoped,
      allocs=make_pipeline(nothing, nothing, jnp.int32(1), jnp.int32(0), 0, 0).get_allocations(
        lhs_ref, rhs_ref
      ),
      **scratch,
      collective_axes="wg",
    )
    def scope(allocs, o_smem, loaded=None):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((g * k_items * n_tiles,), collective_axes="sm")
      def _item_loop(info):
        (idx,) = info.index
        gi = lax.div(idx, k_items * n_tiles)
        rest = lax.rem(idx, k_items * n_tiles)
        # K tiles vary fastest: the CTAs at work share few rhs column tiles, which then stay in
        # L2 (the loss's dweights read a [rows, V] rhs far larger than L2 for each K tile).
        ni = lax.div(rest, k_items)
        ki = lax.rem(rest, k_items) * cluster
        if cluster > 1:
          ki += lax.axis_index("cluster")
        start = bounds_ref[gi, 0]
        end = bounds_ref[gi, 1]
        row0 = lax.div(start, align) * align
        steps = jnp.where(end > start, lax.div(end - row0 + bm - 1, bm), 0)
        o_wg = o_smem.at[wg]
        out_rows = pl.ds(ki * bk + wg * WG_ROWS, WG_ROWS)
        out_tile = lambda c0, cols: out_ref.at[gi, out_rows, pl.ds(ni * bn + c0, cols)]

        def load_addend():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # The previous item's stores.
          plgpu.copy_gmem_to_smem(out_tile(0, bn), o_wg, loaded.at[wg])

        def mma(idxs, a_smem, b_smem, acc):
          (s,) = idxs
          a_wg = a_smem.at[:, pl.ds(wg * WG_ROWS, WG_ROWS)]
          first_row = row0 + s * bm

          @pl.when((first_row < start) | (first_row + bm > end))
          def _mask_rows_outside_group():
            row = first_row + plgpu.layout_cast(
              lax.broadcasted_iota(jnp.int32, (bm, WG_ROWS), 0), plgpu.Layout.WGMMA
            )
            keep = (row >= start) & (row < end)
            a_wg[...] = jnp.where(keep, a_wg[...], jnp.zeros((), a_wg.dtype))
            plgpu.commit_smem()

          plgpu.wgmma(acc, a_wg.T, b_smem)
          if accumulate is not None:
            pl.when(s == 0)(load_addend)  # While the first wgmma runs.
          plgpu.wgmma_wait(0)
          return acc

        store = lambda c: plgpu.copy_smem_to_gmem(o_wg, out_tile(c * epi_n, epi_n))
        if accumulate is None:
          compute_context = gemm.stored_accumulator(bn, epi_n, o_wg, out_dtype, store)
        else:
          compute_context = _accumulating_context(
            bn, epi_n, o_wg, loaded.at[wg], steps, load_addend, out_tile
          )
        make_pipeline(mma, compute_context, steps, row0, ki, ni)(
          lhs_ref, rhs_ref, allocations=allocs
        )

      plgpu.wait_smem_to_gmem(0)

  out_shape = jax.ShapeDtypeStruct((g, k, n), out_dtype)
  launch = functools.partial(gemm.kernel, num_sms=num_sms, cluster=cluster, interpret=interpret)
  if accumulate is None:
    return launch(kernel, out_shape)(bounds, lhs, rhs)
  call = launch(kernel, ())
  buffer = jax.new_ref(accumulate)  # The kernel adds through it: XLA aliases the buffer.
  call(bounds, lhs, rhs, buffer)
  return jax.freeze(buffer)


def _accumulating_context(bn, epi_n, o_wg, loaded, steps, load_addend, out_tile):
  """A pipeline compute context that adds the float32 product to the addend in `o_wg`.

  The addend [WG_ROWS, bn] arrives in `o_wg` by TMA (`load_addend`, issued with the first
  wgmma, or here for an item of no steps); each column chunk's sum, rounded once, goes
  back over it, and the tile goes out to `out_tile`.
  """

  def compute_context(run):
    @functools.partial(pl.run_scoped, acc=plgpu.ACC((WG_ROWS, bn), jnp.float32))
    def _acc_scope(acc):
      run(acc)
      pl.when(steps == 0)(load_addend)
      plgpu.barrier_wait(loaded)
      product = acc[...]
      for c in range(bn // epi_n):
        chunk = o_wg.at[:, pl.ds(c * epi_n, epi_n)]
        total = product[:, c * epi_n : (c + 1) * epi_n] + chunk[...].astype(jnp.float32)
        chunk[...] = total.astype(chunk.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_wg, out_tile(0, bn))

  return compute_context
