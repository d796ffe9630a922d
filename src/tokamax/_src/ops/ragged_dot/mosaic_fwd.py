"""Mosaic GPU (Hopper) grouped matmul over row groups: the forward and dlhs kernel.

`out[rows of group g] = lhs[rows of group g] @ rhs[g]` (or `@ rhs[g].T`).

The kernel is persistent: every SM walks a list of work items, each a
(row block, N tile) pair that belongs to one segment of rows. Segments are the
computed groups plus two zero segments (rows before a group offset and rows
past the last group), so every output row is written exactly once and empty
groups produce no work item at all. The work list, and the order in which the
CTAs take its (item, N tile) pairs (`schedule`), are computed by a few tiny XLA
ops before the kernel.

Each CTA runs three warpgroups: one issues TMA loads into a ring of shared
memory stages, two compute (wgmma) on 64-row halves of the row block. A half
with no row of the item's segment skips its wgmmas, so a block that straddles
a group boundary costs only the halves it needs. The epilogue stores the rows
of the segment with a ladder of power-of-two TMA stores.
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicRaggedDotFwdConfig:
  """Tiling of the grouped matmul kernel.

  Attributes:
    block_n: Output columns per work item.
    block_k: Contraction depth per pipeline stage.
    num_stages: Shared-memory stages of the load pipeline.
    epi_n: Output columns per epilogue store.
    cluster: CTAs per cluster (1 or 2). With 2, the two CTAs of a cluster take
      two row blocks of the same group and share each rhs tile through a TMA
      multicast, which halves the rhs traffic from L2.
    balance: Deal the cheap work items of each round to the CTAs in turn (see
      `schedule`) instead of by their place in the work list.
  """

  block_n: int = 256
  block_k: int = 64
  num_stages: int = 4
  epi_n: int = 128
  cluster: int = 1
  balance: bool = True

  @property
  def block_m(self) -> int:
    return WG_ROWS * NUM_COMPUTE_WGS


def smem_bytes(config: MosaicRaggedDotFwdConfig, in_itemsize: int, out_itemsize: int) -> int:
  """Shared memory the kernel allocates for `config`."""
  stage = (config.block_m + config.block_n) * config.block_k * in_itemsize
  epilogue = NUM_COMPUTE_WGS * WG_ROWS * config.epi_n * out_itemsize
  return config.num_stages * stage + epilogue


def config_reason(
  config: MosaicRaggedDotFwdConfig, m: int, k: int, n: int, in_itemsize: int, out_itemsize: int
):
  """Why `config` cannot run this shape, or None."""
  del m
  if (reason := gemm.columns_reason(config, n)) is not None:
    return reason
  if k % config.block_k:
    return f"K={k} must be a multiple of block_k={config.block_k}"
  if k // config.block_k < config.num_stages:
    return (
      f"K={k} gives fewer than num_stages={config.num_stages} steps of block_k={config.block_k}"
    )
  return (
    gemm.tile_reason(config, "block_k", in_itemsize)
    or gemm.smem_reason(config, smem_bytes(config, in_itemsize, out_itemsize))
    or gemm.cluster_reason(config)
  )


def work_items(
  sizes: jax.Array, before: jax.Array | None, m: int, block_m: int, cluster: int = 1
) -> tuple[jax.Array, int]:
  """The work list: row blocks of each segment, `cluster` blocks per item.

  Blocks start at their segment's first row (rounded down to a multiple of
  ROW_ALIGN), not at multiples of `block_m`: a segment of s rows needs
  ceil(s / block_m) blocks, or one more when unaligned. A block that would run
  past the last row is moved back to end there; it then holds rows of the
  previous segment too, which the kernel computes but never stores. An item
  holds `cluster` consecutive blocks of one segment (one per CTA of a
  cluster); a missing last one repeats the first block and stores nothing.

  Args:
    sizes: [G] rows of each computed group, in row order.
    before: Rows before the first computed group (None: zero).
    m: Rows of lhs (at least `block_m`, a multiple of ROW_ALIGN).
    block_m: Rows per block.
    cluster: Blocks per item.

  Returns:
    int32 [1 + T, 1 + 3 * cluster]: row 0 holds the number of items; row 1 + t
    holds item t as (rhs index or -1 for zeros, then per block: first row of
    the block, first row to store, end of the rows to store); and T.
  """
  g = sizes.shape[0]
  starts, ends = spec.group_row_bounds(sizes, before, m)
  seg_start = jnp.concatenate([jnp.zeros(1, jnp.int32), starts, ends[-1:]])
  seg_end = jnp.concatenate([starts[:1], ends, jnp.full((1,), m, jnp.int32)])
  seg_end = jnp.maximum(seg_end, seg_start)
  seg_rhs = jnp.concatenate([jnp.full((1,), -1), jnp.arange(g), jnp.full((1,), -1)]).astype(
    jnp.int32
  )
  # TMA needs block rows at multiples of ROW_ALIGN: a block may begin up to
  # ROW_ALIGN - 1 rows before its segment.
  aligned_start = seg_start // ROW_ALIGN * ROW_ALIGN
  blocks = jnp.where(seg_end > seg_start, (seg_end - aligned_start + block_m - 1) // block_m, 0)
  count = (blocks + cluster - 1) // cluster
  offsets = jnp.cumsum(count)
  total = offsets[-1]
  # Each segment adds at most one partial block and one partial item.
  num_items = (pl.cdiv(m, block_m) + g + 2) // cluster + g + 2
  t = jnp.arange(num_items, dtype=jnp.int32)
  seg = jnp.minimum(jnp.sum(offsets[None, :] <= t[:, None], axis=1), g + 1)
  first_block = (t - (offsets[seg] - count[seg])) * cluster
  valid = t < total
  fields = [jnp.where(valid, seg_rhs[seg], -1)]
  for c in range(cluster):
    j = first_block + c
    present = valid & (j < blocks[seg])
    block_start = aligned_start[seg] + jnp.where(present, j, first_block) * block_m
    lo = jnp.maximum(seg_start[seg], block_start)
    hi = jnp.minimum(seg_end[seg], block_start + block_m)
    row0 = jnp.minimum(block_start, m - block_m)
    fields += [jnp.where(valid, row0, 0), jnp.where(present, lo, 0), jnp.where(present, hi, 0)]
  items = jnp.stack(fields, axis=1).astype(jnp.int32)
  header = jnp.zeros((1, items.shape[1]), jnp.int32).at[0, 0].set(total)
  return jnp.concatenate([header, items]), num_items


def _full_items(items: jax.Array, cluster: int) -> jax.Array:
  """bool [T]: items with a block whose two 64-row halves both hold rows to compute."""
  full = jnp.zeros(items.shape[0], bool)
  for c in range(cluster):
    row0, lo, hi = (items[:, 1 + 3 * c + i] for i in range(3))
    halves = [
      jnp.minimum(hi, row0 + (j + 1) * WG_ROWS) > jnp.maximum(lo, row0 + j * WG_ROWS)
      for j in range(NUM_COMPUTE_WGS)
    ]
    full |= functools.reduce(jnp.logical_and, halves)
  return full & (items[:, 0] >= 0)


def schedule(
  items: jax.Array, num_items: int, n_tiles: int, lanes: int, cluster: int, balance: bool
) -> jax.Array:
  """The kernel's positions: each (item, N tile) pair of `items`, in the order CTAs take them.

  CTA c runs positions c, c + lanes, c + 2 * lanes, ... (`plgpu.nd_loop`), so each round of
  `lanes` positions runs at about the same time. In the work list's order a CTA may collect
  only full blocks while another gets the blocks of one 64-row half (at group boundaries)
  and the zero blocks. With `balance`, every whole round keeps its pairs (and so what the
  L2 holds) but deals its cheap ones to the CTAs in turn, from where the previous round's
  turn stopped. The whole rounds so leave one cheap pair more on the first CTAs (those the
  turn reached once more) than on the others; the last, partial round, which runs on the
  first CTAs, puts its full pairs first (then its cheap ones, each in the list's order), so
  that every CTA ends up with the same number of full pairs, give or take one.

  Args:
    items: `work_items`' table.
    num_items: Its static number of item rows.
    n_tiles: N tiles per item.
    lanes: CTAs (clusters with `cluster` > 1) of the persistent grid.
    cluster: Blocks per item.
    balance: Whether to deal the cheap pairs in turn.

  Returns:
    int32 [1 + P, F + 1], P = num_items * n_tiles: row 0 holds the number of positions;
    row 1 + p the F fields of position p's item and its N tile.
  """
  rows = items[1:]
  total = items[0, 0] * n_tiles
  pairs = num_items * n_tiles
  rounds = -(-pairs // lanes)
  # [rounds, lanes] grids of positions (padded past `pairs`); each pair's source position.
  p = jnp.arange(rounds * lanes, dtype=jnp.int32).reshape(rounds, lanes)
  source = p
  if balance:
    whole = (p // lanes < total // lanes) & (p < pairs)
    full = _full_items(rows, cluster)[jnp.minimum(p, pairs - 1) // n_tiles]
    cheap = ~full & whole
    cheap_rank = jnp.cumsum(cheap, axis=1) - cheap
    per_round = cheap_rank[:, -1] + cheap[:, -1]
    turn = (jnp.cumsum(per_round) - per_round) % lanes  # Where each round's turn starts.
    lane = jnp.arange(lanes, dtype=jnp.int32)
    rank = jnp.where(cheap, cheap_rank, per_round[:, None] + lane - cheap_rank)
    # The partial round's full pairs first (every other row: no lead, each position stays).
    lead = full & (p // lanes == total // lanes) & (p < total)
    lead_rank = jnp.cumsum(lead, axis=1) - lead
    last_rank = jnp.where(lead, lead_rank, lead_rank[:, -1:] + lead[:, -1:] + lane - lead_rank)
    dest = jnp.where(whole, p - lane + (turn[:, None] + rank) % lanes, p - lane + last_rank)
    # One int32 scatter of the permutation; the table's rows are then gathered.
    source = (
      jnp.zeros(rounds * lanes, jnp.int32).at[dest.ravel()].set(p.ravel(), unique_indices=True)
    )
  source = source.ravel()[:pairs]
  records = jnp.concatenate([rows[source // n_tiles], (source % n_tiles)[:, None]], axis=1)
  header = jnp.zeros((1, records.shape[1]), jnp.int32).at[0, 0].set(total)
  return jnp.concatenate([header, records]).astype(jnp.int32)


def ragged_dot_fwd(
  lhs: jax.Array,
  rhs: jax.Array,
  sizes: jax.Array,
  before: jax.Array | None,
  *,
  transpose_rhs: bool,
  out_dtype,
  config: MosaicRaggedDotFwdConfig,
  num_sms: int,
  interpret=None,
) -> jax.Array:
  """`lhs [M,K]` times `rhs [G,K,N]` (or `[G,N,K]` transposed) by row groups.

  Args:
    lhs: [M, K].
    rhs: [G, K, N], or [G, N, K] with `transpose_rhs`.
    sizes: [G] rows per group.
    before: Rows before the first group, or None.
    transpose_rhs: Whether rhs holds each group's matrix transposed.
    out_dtype: Output dtype.
    config: Tiling.
    num_sms: Persistent CTAs.
    interpret: Pallas interpret parameters, or None.

  Returns:
    [M, N]; rows outside every group are zero.
  """
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  epi_n = config.epi_n
  n_tiles = n // bn
  k_steps = k // bk
  cluster = config.cluster
  items, num_items = work_items(sizes, before, m, bm, cluster)
  table = schedule(items, num_items, n_tiles, num_sms // cluster, cluster, config.balance)
  collective = ("cluster",) if cluster > 1 else None
  in_tf = gemm.transforms(lhs.dtype)
  out_dtype = jnp.dtype(out_dtype)

  def make_pipeline(body, compute_context, steps, ni):
    in_specs = [
      plgpu.BlockSpec((bm, bk), lambda s: (0, s), transforms=in_tf, delay_release=0),
      plgpu.BlockSpec(
        (bn, bk) if transpose_rhs else (bk, bn),
        (lambda s: (ni, s)) if transpose_rhs else (lambda s: (s, ni)),
        transforms=in_tf,
        delay_release=0,
        collective_axes=collective,
      ),
    ]
    return gemm.pipeline(body, compute_context, steps, in_specs, config.num_stages)

  def kernel(table_ref, lhs_ref, rhs_ref, out_ref):
    nothing = lambda *_, **__: None
    rhs_block = (bn, k) if transpose_rhs else (k, bn)

    @functools.partial(
      pl.run_scoped,
      allocs=make_pipeline(nothing, nothing, k_steps, 0).get_allocations(
        lhs_ref.at[pl.ds(0, bm)],
        rhs_ref.at[0, pl.ds(0, rhs_block[0]), pl.ds(0, rhs_block[1])],
      ),
      o_smem=plgpu.SMEM((NUM_COMPUTE_WGS, WG_ROWS, epi_n), out_dtype),
      collective_axes="wg",
    )
    def scope(allocs, o_smem):
      wg = lax.axis_index("wg")
      total = table_ref[0, 0]

      @plgpu.nd_loop((total,), collective_axes="sm")
      def _item_loop(info):
        (idx,) = info.index
        position = idx + 1
        g = table_ref[position, 0]
        ni = table_ref[position, 1 + 3 * cluster]
        base = 1 + 3 * (lax.axis_index("cluster") if cluster > 1 else 0)
        block_row0 = pl.multiple_of(table_ref[position, base], ROW_ALIGN)
        lo = table_ref[position, base + 1]
        hi = table_ref[position, base + 2]
        row0 = block_row0 + wg * WG_ROWS
        first = jnp.clip(lo - row0, 0, WG_ROWS)
        size = jnp.clip(hi - row0, 0, WG_ROWS) - first
        steps = jnp.where(g >= 0, k_steps, 0)

        def mma(_, a_smem, b_smem, acc):
          @pl.when(size > 0)
          def _():
            b = b_smem.T if transpose_rhs else b_smem
            plgpu.wgmma(acc, a_smem.at[pl.ds(wg * WG_ROWS, WG_ROWS)], b)

          plgpu.wgmma_wait(0)
          return acc

        o_wg = o_smem.at[wg]

        def store(c):
          cols = pl.ds(ni * bn + c * epi_n, epi_n)
          gemm.store_rows(o_wg, out_ref.at[:, cols], row0, first, size, WG_ROWS)

        compute_context = gemm.stored_accumulator(bn, epi_n, o_wg, out_dtype, store)
        pipeline = make_pipeline(mma, compute_context, steps, ni)
        pipeline(
          lhs_ref.at[pl.ds(block_row0, bm)], rhs_ref.at[jnp.maximum(g, 0)], allocations=allocs
        )

      plgpu.wait_smem_to_gmem(0)

  call = gemm.kernel(
    kernel,
    jax.ShapeDtypeStruct((m, n), out_dtype),
    num_sms=num_sms,
    cluster=cluster,
    interpret=interpret,
  )
  return call(table, lhs, rhs)
