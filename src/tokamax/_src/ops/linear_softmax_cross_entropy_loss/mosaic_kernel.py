"""Mosaic GPU (Hopper) kernels of the fused linear + softmax cross-entropy loss.

The kernel is the persistent,
warp-specialised GEMM of `mosaic_gemm` over
(row tile, vocabulary tile) work items of `x @ weights`, with an epilogue in
place of the store of the logits tile, so that no [B, V] logits reach HBM:

- `tile_stats`: each tile's per-row log-sum-exp and the logit at each row's label
  where the tile holds it (float32 [tiles, B] each); the caller combines the tiles
  (a few MB), so the label's logit needs no gather of weight columns. Flags from
  XLA (`label_tiles`) tell each warpgroup which tiles hold a label of its rows, and
  the label search runs only there. For the gradient in the forward pass it also
  writes each tile's exponentials relative to the tile's row maxima (x's dtype,
  [B, V]) and those maxima.
- `cotangent_in_place`: turns those exponentials into the logits' cotangent for a
  unit output cotangent, in their own buffer (a streaming elementwise kernel).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax._src.ops import mosaic_gemm as gemm

WG_ROWS = gemm.WG_ROWS
NUM_COMPUTE_WGS = gemm.NUM_COMPUTE_WGS
_LOG2E = 1.4426950408889634
# Each compute warpgroup keeps one wgmma in flight and releases a stage one step late
# (h200/loss_delay_release_0396765.json: forward 0.92-0.99x of waiting for every wgmma).
_WGMMAS_IN_FLIGHT = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicLossKernelConfig:
  """Tiling of the loss kernels.

  Attributes:
    block_n: Vocabulary columns per work item.
    block_k: Contraction depth (of H) per pipeline stage.
    num_stages: Shared-memory stages of the load pipeline.
    grid_tile_m: Row tiles visited together before moving along the
      vocabulary (the x rows of a band stay in L2 while the weights stream).
  """

  block_n: int = 256
  block_k: int = 64
  num_stages: int = 4
  grid_tile_m: int = 32

  @property
  def block_m(self) -> int:
    return WG_ROWS * NUM_COMPUTE_WGS


# Columns of the exponentials per store (a [WG_ROWS, 128] shared-memory slot per warpgroup).
PROBS_STORE_COLUMNS = 128


def smem_bytes(config: MosaicLossKernelConfig, in_itemsize: int, epilogue_bytes: int) -> int:
  stage = (config.block_m + config.block_n) * config.block_k * in_itemsize
  return config.num_stages * stage + NUM_COMPUTE_WGS * epilogue_bytes


def epilogue_bytes(in_itemsize: int, probabilities: bool) -> int:
  """Shared memory of one compute warpgroup's epilogue."""
  # The slot, and 2 KiB of alignment the count does not see: four stages of 256 columns
  # came to 233536 bytes in Mosaic GPU's allocation, over the 232448 a CTA has.
  probs = WG_ROWS * PROBS_STORE_COLUMNS * in_itemsize + 2048 if probabilities else 0
  return _stats(probabilities) * WG_ROWS * 4 + probs


def _load_rows(ref) -> jax.Array:
  """A [WG_ROWS] vector from `ref`, laid out as the rows of a warpgroup's WGMMA tile."""
  return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)


def _stats(probabilities: bool) -> int:
  """float32 per row and tile: the log-sum-exp, the label logit (and the maximum)."""
  return 3 if probabilities else 2


def config_reason(
  config: MosaicLossKernelConfig, h: int, in_itemsize: int, probabilities: bool = False
) -> str | None:
  """Why `config` cannot contract H=`h` (writing the exponentials if `probabilities`), or
  None."""
  if h % config.block_k:
    return f"H={h} must be a multiple of block_k={config.block_k}"
  if config.num_stages <= _WGMMAS_IN_FLIGHT:
    return (
      f"num_stages={config.num_stages} must exceed the {_WGMMAS_IN_FLIGHT} stage held per wgmma"
    )
  if h // config.block_k < config.num_stages:
    return f"H={h} gives fewer than num_stages={config.num_stages} steps of {config.block_k}"
  if probabilities and config.block_n % PROBS_STORE_COLUMNS:
    # The exponentials leave a tile in stores of PROBS_STORE_COLUMNS columns.
    return (
      f"block_n={config.block_n} must be a multiple of {PROBS_STORE_COLUMNS} to write the"
      " exponentials (gradient_in_forward)"
    )
  epilogue = epilogue_bytes(in_itemsize, probabilities)
  return gemm.tile_reason(config, "block_k", in_itemsize) or gemm.smem_reason(
    config, smem_bytes(config, in_itemsize, epilogue)
  )


def _gemm_items(x, w, *, n_tiles, config, num_sms, out_type, scratch, epilogue, interpret):
  """The persistent GEMM over (row tile, column tile) items with `epilogue` per item.

  Args:
    x: [B, H].
    w: [H, V]; the items cover its first `n_tiles` column tiles.
    n_tiles: Column tiles of width block_n.
    config: Tiling.
    num_sms: Persistent CTAs.
    out_type: The kernel's outputs.
    scratch: Shared memory of each compute warpgroup's epilogue (a pytree of SMEM
      specs with a leading NUM_COMPUTE_WGS axis).
    epilogue: (logits [WG_ROWS, block_n] float32, row0, ni, scratch of
      this warpgroup, extra input refs, output refs) -> None.
    interpret: Pallas interpret parameters, or None.
  """
  b, h = x.shape
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  m_tiles, k_steps = pl.cdiv(b, bm), h // bk
  tile_m = min(config.grid_tile_m, m_tiles)
  tf = gemm.transforms(x.dtype)

  def make_pipeline(body, compute_context, mi, nj):
    in_specs = [
      plgpu.BlockSpec((bm, bk), lambda s: (mi, s), transforms=tf, delay_release=_WGMMAS_IN_FLIGHT),
      plgpu.BlockSpec((bk, bn), lambda s: (s, nj), transforms=tf, delay_release=_WGMMAS_IN_FLIGHT),
    ]
    return gemm.pipeline(body, compute_context, k_steps, in_specs, config.num_stages)

  def kernel(x_ref, w_ref, *refs):
    nothing = lambda *_, **__: None
    n_out = len(jax.tree.leaves(out_type))
    extra_refs, out_refs = refs[: len(refs) - n_out], refs[len(refs) - n_out :]

    @functools.partial(
      pl.run_scoped,
      allocs=make_pipeline(nothing, nothing, 0, 0).get_allocations(x_ref, w_ref),
      epi_smem=scratch,
      collective_axes="wg",
    )
    def scope(allocs, epi_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
      def _item_loop(info):
        (idx,) = info.index
        mi, ni = plgpu.planar_snake(idx, (m_tiles, n_tiles), 0, tile_m)
        row0 = mi * bm + wg * WG_ROWS

        def mma(_, x_smem, w_smem, acc):
          plgpu.wgmma(acc, x_smem.at[pl.ds(wg * WG_ROWS, WG_ROWS)], w_smem)
          plgpu.wgmma_wait(_WGMMAS_IN_FLIGHT)
          return acc

        def compute_context(run):
          @functools.partial(pl.run_scoped, acc=plgpu.ACC((WG_ROWS, bn), jnp.float32))
          def _acc_scope(acc):
            run(acc)
            wg_smem = jax.tree.map(lambda ref: ref.at[wg], epi_smem)
            epilogue(acc[...], row0, ni, wg_smem, extra_refs, out_refs)

        make_pipeline(mma, compute_context, mi, ni)(x_ref, w_ref, allocations=allocs)

      plgpu.wait_smem_to_gmem(0)

  return gemm.kernel(kernel, out_type, num_sms=num_sms, approx_math=True, interpret=interpret)


def tile_stats(
  x: jax.Array,
  w: jax.Array,
  labels: jax.Array,
  *,
  n_tiles: int,
  config: MosaicLossKernelConfig,
  num_sms: int,
  probabilities: bool = False,
  interpret=None,
) -> tuple[jax.Array, ...]:
  """Per-row log-sum-exp and label logit of each of the first `n_tiles` vocabulary tiles.

  Args:
    x: [B, H], B a multiple of block_m.
    w: [H, V], V >= n_tiles * block_n.
    labels: int32 [B]: each row's column of `w` (any other value matches no tile).
    n_tiles: Column tiles of width block_n.
    config: Tiling.
    num_sms: Persistent CTAs.
    probabilities: Whether to return each tile's row maxima and exponentials too.
    interpret: Pallas interpret parameters, or None.

  Returns:
    float32 [n_tiles, B] each: the tiles' log-sum-exps, and the logit at the row's label
    in the tile that holds it (0 in the others). With `probabilities`, also the tiles' row
    maxima (float32 [n_tiles, B]) and [B, V] in x's dtype: exp(logit - the tile's row
    maximum) in the tiles' columns (the columns past them are left unwritten).
  """
  b, v = x.shape[0], w.shape[1]
  bn = config.block_n
  row_layout = plgpu.Layout.WGMMA.reduce(1)

  def epilogue(logits, row0, ni, smem, extra_refs, out_refs):
    labels_ref, flags_ref = extra_refs
    stats_smem = smem[0]
    rows = lambda v: lax.broadcast_in_dim(v, logits.shape, [0])
    top = logits.max(axis=1)
    # exp2 and log are approximate instructions (approx_math); the shift is one FMA.
    exps = jnp.exp2(logits * _LOG2E - rows(top * _LOG2E))
    lse = top + jnp.log(exps.sum(axis=1))

    def picked():
      row_labels = _load_rows(labels_ref.at[pl.ds(row0, WG_ROWS)])
      cols = plgpu.broadcasted_iota(jnp.int32, logits.shape, 1, layout=plgpu.Layout.WGMMA)
      return jnp.where(cols == rows(row_labels - ni * bn), logits, 0.0).sum(axis=1)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # The previous item's stores.
    stats_smem[0] = lse
    # Most items hold none of their rows' labels: flags from XLA skip the search there.
    stats_smem[1] = plgpu.layout_cast(jnp.zeros((WG_ROWS,), jnp.float32), row_layout)
    if probabilities:
      stats_smem[2] = top

    @pl.when(flags_ref[lax.div(row0, WG_ROWS), ni] != 0)
    def _():
      stats_smem[1] = picked()

    plgpu.commit_smem()
    for i in range(_stats(probabilities)):
      plgpu.copy_smem_to_gmem(stats_smem.at[i], out_refs[i].at[ni, pl.ds(row0, WG_ROWS)])
    if probabilities:
      probs_smem, probs_ref = smem[1], out_refs[-1]
      for c in range(0, bn, PROBS_STORE_COLUMNS):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # The slot's previous store.
        probs_smem[...] = exps[:, c : c + PROBS_STORE_COLUMNS].astype(probs_smem.dtype)
        plgpu.commit_smem()
        cols = pl.ds(ni * bn + c, PROBS_STORE_COLUMNS)
        plgpu.copy_smem_to_gmem(probs_smem, probs_ref.at[pl.ds(row0, WG_ROWS), cols])

  stat = jax.ShapeDtypeStruct((n_tiles, b), jnp.float32)
  out_type = (stat, stat)
  scratch = [plgpu.SMEM((NUM_COMPUTE_WGS, _stats(probabilities), WG_ROWS), jnp.float32)]
  if probabilities:
    out_type += (stat, jax.ShapeDtypeStruct((b, v), x.dtype))
    scratch.append(plgpu.SMEM((NUM_COMPUTE_WGS, WG_ROWS, PROBS_STORE_COLUMNS), x.dtype))
  call = _gemm_items(
    x,
    w,
    n_tiles=n_tiles,
    config=config,
    num_sms=num_sms,
    out_type=out_type,
    scratch=tuple(scratch),
    epilogue=epilogue,
    interpret=interpret,
  )
  labels = labels.astype(jnp.int32)
  return call(x, w, labels, label_tiles(labels, n_tiles, bn))


def label_tiles(labels: jax.Array, n_tiles: int, block_n: int) -> jax.Array:
  """int32 [B / WG_ROWS, n_tiles]: 1 where a warpgroup's rows have a label in the tile."""
  b = labels.shape[0]
  tile = jnp.where((labels >= 0) & (labels < n_tiles * block_n), labels // block_n, n_tiles)
  flags = jnp.zeros((b // WG_ROWS, n_tiles + 1), jnp.int32)
  return flags.at[jnp.arange(b) // WG_ROWS, tile].set(1)[:, :n_tiles]


# Rows per CTA of `cotangent_in_place` (one warpgroup), and its target CTA count per SM.
_COTANGENT_ROWS = WG_ROWS
_COTANGENT_CTAS_PER_SM = 4
_COTANGENT_STAGES = 3


def cotangent_in_place(
  probs: jax.Array,
  scale: jax.Array,
  labels: jax.Array,
  hit_weights: jax.Array,
  *,
  block_n: int,
  num_sms: int,
  interpret=None,
) -> jax.Array:
  """The logits' cotangent, written over the exponentials that `tile_stats` wrote.

  Args:
    probs: [R, V] in x's dtype, R a multiple of 64 and V of 64: exponentials relative to
      each tile's row maxima.
    scale: float32 [ceil(V / block_n), R]: what turns each tile's exponentials into the
      cotangent's softmax term (exp(maximum - log-sum-exp) times the row's weight).
    labels: int32 [R]: each row's label column (any other value matches no column).
    hit_weights: float32 [R]: what each row's label column loses.
    block_n: Columns per tile of `scale`.
    num_sms: SMs of the GPU (the grid aims at a few CTAs per SM).
    interpret: Pallas interpret parameters, or None.

  Returns:
    [R, V] in `probs`' buffer: probs * scale[tile] - hit_weights at each row's label.
  """
  r, v = probs.shape
  cols = 128 if v % 128 == 0 else 64
  if r % _COTANGENT_ROWS or v % cols or block_n % cols:
    raise ValueError(f"probs {probs.shape} must tile by {_COTANGENT_ROWS}x64 within {block_n}")
  bands, col_blocks = r // _COTANGENT_ROWS, v // cols
  want = max(1, _COTANGENT_CTAS_PER_SM * num_sms // bands)
  groups = max(d for d in range(1, min(want, col_blocks) + 1) if col_blocks % d == 0)
  steps = col_blocks // groups
  stages = min(_COTANGENT_STAGES, steps)
  shape = (_COTANGENT_ROWS, cols)
  per_row = lambda u: lax.broadcast_in_dim(u, shape, [0])

  def kernel(p_gmem, s_gmem, l_gmem, w_gmem):
    band, group = lax.axis_index("band"), lax.axis_index("group")
    rows = pl.ds(band * _COTANGENT_ROWS, _COTANGENT_ROWS)
    col0 = lambda step: (group * steps + step) * cols
    block = lambda step: p_gmem.at[rows, pl.ds(col0(step), cols)]

    def body(smem, barriers):
      fetch = lambda step, slot: plgpu.copy_gmem_to_smem(
        block(step), smem.at[slot], barriers.at[slot]
      )
      for step in range(stages - 1):
        fetch(step, step)
      row_labels, hit = _load_rows(l_gmem.at[rows]), _load_rows(w_gmem.at[rows])

      @pl.loop(0, steps)
      def _step(step):
        slot, ahead = lax.rem(step, stages), step + stages - 1

        @pl.when(ahead < steps)
        def _():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # The slot's previous store.
          fetch(ahead, lax.rem(ahead, stages))

        c0 = col0(step)
        tile_scale = _load_rows(s_gmem.at[lax.div(c0, block_n), rows])
        plgpu.barrier_wait(barriers.at[slot])
        p = plgpu.load(smem.at[slot], layout=plgpu.Layout.WGMMA, optimized=False)
        columns = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
        at_label = columns == per_row(row_labels - c0)
        out = p.astype(jnp.float32) * per_row(tile_scale) - jnp.where(at_label, per_row(hit), 0.0)
        smem[slot] = out.astype(smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem.at[slot], block(step))

      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
      body,
      plgpu.SMEM((stages, _COTANGENT_ROWS, cols), probs.dtype),
      plgpu.Barrier(num_arrivals=1, num_barriers=stages),
    )

  call = plgpu.kernel(
    kernel,
    out_type=(),
    grid=(bands, groups),
    grid_names=("band", "group"),
    compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    interpret=interpret,
  )
  buffer = jax.new_ref(probs)  # The kernel writes through it: XLA aliases probs' buffer.
  call(buffer, scale, labels.astype(jnp.int32), hit_weights)
  return jax.freeze(buffer)
