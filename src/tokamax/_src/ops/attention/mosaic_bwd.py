"""Deterministic flash-attention backward kernels in Pallas Mosaic GPU (Hopper).

Two warp-specialised kernels, each with two consumer warpgroups and a TMA
producer warpgroup, and no atomics (so results are bitwise reproducible):

- dq: a CTA holds 2 * block_q query rows of one head and streams key/value
  blocks; per block it recomputes the probabilities from the saved
  log-sum-exp and accumulates dq = dS K.
- dk/dv: a CTA holds 2 * block_kv keys of one key/value head and streams,
  for every query head of its group in turn, the query, output-gradient,
  log-sum-exp and delta blocks; it accumulates dv = P^T dO and dk = dS^T Q, so
  GQA needs no reduction afterwards. Where both float32 accumulators do not
  fit the registers (head dim 256), it runs twice, once per output: the dv
  pass needs neither the value block nor delta.

The dk/dv kernel can also form dq (`outputs` with "dq"), in place of the dq
kernel: each consumer's step share dS K goes through shared memory into a
float32 buffer by TMA reduce-add. Five matmuls per block pair instead of seven,
but the order of the adds varies from run to run, so that dq is not bitwise
reproducible.

The masking and block ranges are the forward kernel's (`mosaic_common`). A bias
and a mask ([B|1, N|1, T|1, S|1], as the forward takes them) are read tile by
tile from global memory into registers, as in the forward; the dk/dv kernel,
whose tiles hold keys in rows, takes them transposed ([B|1, N|1, S|1, T|1]).
"""

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from tokamax._src.ops.attention import mosaic_common as common

NUM_CONSUMERS = 2
_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a WGMMA tile
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column
_DQ_COLS = 64  # columns of H per matmul of the dk/dv kernel's dq share


@dataclasses.dataclass(frozen=True)
class BwdParams:
  """Static description of the backward kernels."""

  block_q: int
  block_kv: int
  num_stages: int
  scale: float
  soft_cap: float | None
  masking: common.Masking
  consumer_registers: int = 232
  producer_registers: int = 40


def dq_smem_bytes(p: BwdParams, h: int, itemsize: int = 2) -> int:
  """Shared memory of the dq kernel (compiled, not interpreted)."""
  held = NUM_CONSUMERS * p.block_q * (2 * h * itemsize + 2 * 4)  # q, do, lse, delta
  return held + 2 * p.num_stages * p.block_kv * h * itemsize


def dkv_smem_bytes(p: BwdParams, h: int, outputs=("dk", "dv"), itemsize: int = 2) -> int:
  """Shared memory of the dk/dv kernel computing `outputs` (and dq), compiled."""
  dk = "dk" in outputs
  held = (2 if dk else 1) * NUM_CONSUMERS * p.block_kv * h * itemsize
  if "dq" in outputs:  # Each consumer's dS tile and float32 part of the dq share.
    held += NUM_CONSUMERS * p.block_q * (p.block_kv * itemsize + h * 4)
  return held + p.num_stages * p.block_q * (2 * h * itemsize + (8 if dk else 4))


def _log2_logits(p: BwdParams, s: jax.Array, bias: jax.Array | None):
  """(logits in log2 units, d logits / d s divided by scale, or None), as the forward's."""
  logits, t = common.log2_logits(s, bias, p.scale, p.soft_cap)
  if logits is None:
    logits = s * (p.scale * common.LOG2E)
  return logits, None if t is None else 1.0 - t * t


def _mm(acc, a, b_ref, interpret, stage_ref):
  """acc + a @ b_ref with `a` in registers (staged through SMEM when interpreting)."""
  if interpret:
    stage_ref[...] = a

    def f(acc_ref):
      plgpu.wgmma(acc_ref, stage_ref, b_ref)
      return acc_ref[...]

    return acc + pl.run_scoped(f, plgpu.ACC(acc.shape, jnp.float32))

  def g(acc_ref):
    plgpu.wgmma(acc_ref, a, b_ref)

  return pl.run_state(g)(plgpu.ACC.init(acc))


def _mm_refs(a_ref, b_ref, shape):
  """a_ref @ b_ref from shared memory (either may be transposed) into a fresh float32 tile."""

  def f(acc_ref):
    plgpu.wgmma(acc_ref, a_ref, b_ref)
    return acc_ref[...]

  return pl.run_scoped(f, plgpu.ACC(shape, jnp.float32))


def _mm_t(a_ref, b_ref, shape):
  """a_ref @ b_ref.T from shared memory into a fresh float32 tile."""
  return _mm_refs(a_ref, b_ref.T, shape)


def dq(p: BwdParams, q, k, v, do, lse, delta, lengths, bias=None, mask=None, *, interpret=None):
  """dq [B,T,N,H] (float32 accumulation, input dtype out); `bias`, `mask` as the forward's."""
  b, t, n, h = q.shape
  s_len, kh = k.shape[1], k.shape[2]
  groups = n // kh
  bq, bkv, stages = p.block_q, p.block_kv, p.num_stages
  rows_per_cta = NUM_CONSUMERS * bq
  num_tiles = t // rows_per_cta
  dtype = q.dtype
  m = p.masking
  any_mask = m != common.Masking()
  # With one slot per operand, the value block goes first (dP) and is released
  # early, so the producer refills it while the key block is still in use,
  # and the next key block loads during the next dP.
  v_first = stages == 1
  extras = tuple(x for x in (bias, mask) if x is not None)

  def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, len_ref, *refs):
    refs_bm = common.extra_refs(refs, bias, mask)
    dq_ref, smem, bars = refs[len(extras) :]
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem = smem
    q_bar, k_bar, v_bar, k_free, v_free = bars
    wg = lax.axis_index("wg")
    qt = common.query_tile(
      m, len_ref, t=t, s_len=s_len, groups=groups, block_q=bq, block_kv=bkv, consumers=NUM_CONSUMERS
    )
    head, batch, kv_head, q_len, kv_len = qt.head, qt.batch, qt.kv_head, qt.q_len, qt.kv_len
    tile_r0, ranges, tile_lo, tile_hi = qt.r0, qt.ranges, qt.lo, qt.hi

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(p.consumer_registers, action="increase")
      r0 = tile_r0 + wg * bq
      lo, full_lo, full_hi, hi = (jnp.where(wg == 0, x, y) for x, y in zip(*ranges, strict=True))
      rows = (batch, pl.ds(r0, bq), head)
      vec = (batch, head, pl.ds(r0, bq))
      plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[wg], q_bar.at[wg, 0])
      plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[wg], q_bar.at[wg, 1])
      plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_smem.at[wg], q_bar.at[wg, 2])
      plgpu.copy_gmem_to_smem(delta_ref.at[vec], delta_smem.at[wg], q_bar.at[wg, 3])
      for i in range(4):
        plgpu.barrier_wait(q_bar.at[wg, i])
      lse = plgpu.load(lse_smem.at[wg], layout=_ROW)
      delta = plgpu.load(delta_smem.at[wg], layout=_ROW)
      planes = common.extra_planes(refs_bm, batch, head, r0, bq)

      def step(kv_step, acc, *, masked: bool):
        masked = masked and any_mask
        slot = lax.rem(kv_step - tile_lo, jnp.int32(stages))
        # Issued before the matmuls, so that their latency hides behind them.
        bias_tile, mask_tile = common.extra_tiles(planes, r0, kv_step, bq, bkv)
        if v_first:
          plgpu.barrier_wait(v_bar.at[slot])
          dp = _mm_t(do_smem.at[wg], v_smem.at[slot], (bq, bkv))
          plgpu.barrier_arrive(v_free.at[slot])
          plgpu.barrier_wait(k_bar.at[slot])
          s = _mm_t(q_smem.at[wg], k_smem.at[slot], (bq, bkv))
        else:
          plgpu.barrier_wait(k_bar.at[slot])
          plgpu.barrier_wait(v_bar.at[slot])
          s = _mm_t(q_smem.at[wg], k_smem.at[slot], (bq, bkv))
          dp = _mm_t(do_smem.at[wg], v_smem.at[slot], (bq, bkv))
          plgpu.barrier_arrive(v_free.at[slot])
        logits, dcap = _log2_logits(p, s, bias_tile)
        ok = None
        if masked:
          q_ids = common.iota((bq, bkv), 0) + r0
          k_ids = common.iota((bq, bkv), 1) + kv_step * bkv
          ok = common.visible(m, q_ids, k_ids, q_len, kv_len)
        logits = common.hide(logits, ok, mask_tile)
        probs = jnp.exp2(logits - lax.broadcast_in_dim(lse, (bq, bkv), [0]))
        ds = probs * (dp - lax.broadcast_in_dim(delta, (bq, bkv), [0]))
        if dcap is not None:
          ds = ds * dcap
        acc = _mm(
          acc, ds.astype(dtype), k_smem.at[slot], interpret, ds_smem.at[wg] if interpret else None
        )
        plgpu.barrier_arrive(k_free.at[slot])
        return acc

      def skip(kv_step, acc):
        slot = lax.rem(kv_step - tile_lo, jnp.int32(stages))
        plgpu.barrier_wait(k_bar.at[slot])
        plgpu.barrier_wait(v_bar.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])
        plgpu.barrier_arrive(k_free.at[slot])
        return acc

      acc = common.tile((bq, h), 0.0)
      masked_step = functools.partial(step, masked=True)
      plain_step = functools.partial(step, masked=False)
      acc = lax.fori_loop(tile_lo, lo, skip, acc)
      acc = lax.fori_loop(lo, full_lo, masked_step, acc)
      acc = lax.fori_loop(full_lo, full_hi, plain_step, acc)
      acc = lax.fori_loop(full_hi, hi, masked_step, acc)
      acc = lax.fori_loop(hi, tile_hi, skip, acc)
      q_smem.at[wg][...] = (acc * p.scale).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem.at[wg], dq_ref.at[rows])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
      plgpu.set_max_registers(p.producer_registers, action="decrease")
      streams = [
        (lambda _, j: k_ref.at[batch, pl.ds(j * bkv, bkv), kv_head], k_smem, k_bar, k_free),
        (lambda _, j: v_ref.at[batch, pl.ds(j * bkv, bkv), kv_head], v_smem, v_bar, v_free),
      ]
      _stream(tile_lo, tile_hi, stages, streams[::-1] if v_first else streams)

  # dS.K contracts over the streamed key block: the key tile takes the swizzle
  # of its width, and so do the others (Q.K^T pairs the query tile with it).
  tr = common.smem_transforms(dtype, h, contracted=bkv)
  smem = (
    plgpu.SMEM((NUM_CONSUMERS, bq, h), dtype, transforms=tr),
    plgpu.SMEM((NUM_CONSUMERS, bq, h), dtype, transforms=tr),
    plgpu.SMEM((NUM_CONSUMERS, bq), jnp.float32),
    plgpu.SMEM((NUM_CONSUMERS, bq), jnp.float32),
    plgpu.SMEM((stages, bkv, h), dtype, transforms=tr),
    plgpu.SMEM((stages, bkv, h), dtype, transforms=tr),
    plgpu.SMEM((NUM_CONSUMERS, bq, bkv), dtype, transforms=common.smem_transforms(dtype, bkv))
    if interpret
    else None,
  )
  bars = (
    plgpu.Barrier(num_barriers=(NUM_CONSUMERS, 4)),
    plgpu.Barrier(num_barriers=stages),
    plgpu.Barrier(num_barriers=stages),
    plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),
    plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),
  )
  return plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct(q.shape, dtype),
    scratch_types=(smem, bars),
    grid=(n, num_tiles, b),
    grid_names=("heads", "q_tiles", "batch"),
    num_threads=NUM_CONSUMERS + 1,
    thread_name="wg",
    kernel_name="attention_dq",
    compiler_params=plgpu.CompilerParams(approx_math=True),
    interpret=interpret,
  )(q, k, v, do, lse, delta, lengths, *extras)


def _stream(lo, hi, stages, streams, *, repeat: int = 1):
  """Producer loop: TMA-loads blocks lo..hi (`repeat` times) into rotating slots.

  Each stream is (block index -> (group, block) source ref, smem slots,
  full barriers, free barriers); a slot is refilled once its free barrier
  says every consumer released it.
  """
  span = hi - lo

  @pl.loop(0, span * repeat)
  def _(i):
    slot = lax.rem(i, jnp.int32(stages))
    g = lax.div(i, jnp.maximum(span, 1))
    j = lo + lax.rem(i, jnp.maximum(span, 1))
    for src, dst, full, free in streams:

      @pl.when(i >= stages)
      def _():
        plgpu.barrier_wait(free.at[slot])

      plgpu.copy_gmem_to_smem(src(g, j), dst.at[slot], full.at[slot])

  @pl.loop(jnp.maximum(span * repeat - stages, 0), span * repeat)
  def _(i):
    slot = lax.rem(i, jnp.int32(stages))
    for _, _, _, free in streams:
      plgpu.barrier_wait(free.at[slot])


def dkv(
  p: BwdParams,
  q,
  k,
  v,
  do,
  lse,
  delta,
  lengths,
  bias_t=None,
  mask_t=None,
  *,
  outputs=("dk", "dv"),
  interpret=None,
):
  """The `outputs` ("dk", "dv" or both, then "dq" with "dk"), in that order.

  dk and dv are [B,S,K,H]; dq is [B,T,N,H], summed by reduce-adds (module doc).
  `bias_t` and `mask_t` are the forward's bias and mask with T and S swapped.
  """
  b, t, n, h = q.shape
  s_len, kh = k.shape[1], k.shape[2]
  groups = n // kh
  bq, bkv, stages = p.block_q, p.block_kv, p.num_stages
  cols_per_cta = NUM_CONSUMERS * bkv
  num_tiles = s_len // cols_per_cta
  num_q = t // bq
  dtype = q.dtype
  m = p.masking
  any_mask = m != common.Masking()
  want_dk, want_dv, want_dq = ("dk" in outputs, "dv" in outputs, "dq" in outputs)
  names = [x for x in ("dk", "dv") if x in outputs]
  assert names and len(names) + want_dq == len(outputs) and want_dk >= want_dq, outputs
  assert not want_dq or bq >= 64, "dq's share takes whole wgmma M tiles"
  # As in `dq`: with one slot per operand the dk pass uses dO first (dP) and
  # releases it early, and the query block last.
  do_first = want_dk and not want_dv and stages == 1
  extras = tuple(x for x in (bias_t, mask_t) if x is not None)
  # Interpreted, TMA has no reduce-add: each consumer writes its dq shares to a
  # buffer of its own, summed afterwards.
  dq_parts = num_tiles * NUM_CONSUMERS if interpret else 1

  def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, len_ref, *refs):
    refs_bm = common.extra_refs(refs, bias_t, mask_t)
    refs = refs[len(extras) :]
    if want_dq:
      dq_ref, *refs = refs
    out_refs = dict(zip(names, refs[: len(names)], strict=True))
    smem, bars = refs[len(names) :]
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem = smem
    kv_bar, q_bar, do_bar, lse_bar, delta_bar, q_free, do_free, lse_free, delta_free = bars
    kv_head = lax.axis_index("heads")
    tile = lax.axis_index("kv_tiles")
    batch = lax.axis_index("batch")
    wg = lax.axis_index("wg")
    q_len = len_ref[0, batch] if m.q_len else t
    kv_len = len_ref[1, batch] if m.kv_len else s_len
    tile_c0 = tile * cols_per_cta
    ranges = [
      common.q_blocks(m, tile_c0 + i * bkv, bkv, bq, num_q, q_len, kv_len)
      for i in range(NUM_CONSUMERS)
    ]
    tile_lo = jnp.minimum(ranges[0][0], ranges[1][0])
    tile_hi = jnp.maximum(ranges[0][3], ranges[1][3])
    span = tile_hi - tile_lo
    # (full barrier, free barrier) of each streamed operand; the producer refills
    # them in `order`, the order the consumers release them.
    streamed = [(q_bar, q_free), (lse_bar, lse_free), (do_bar, do_free)]
    if want_dk:
      streamed.append((delta_bar, delta_free))
    order = [2, 1, 3, 0] if do_first else list(range(len(streamed)))

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(p.consumer_registers, action="increase")
      c0 = tile_c0 + wg * bkv
      lo, full_lo, full_hi, hi = (jnp.where(wg == 0, x, y) for x, y in zip(*ranges, strict=True))
      cols = (batch, pl.ds(c0, bkv), kv_head)
      plgpu.copy_gmem_to_smem(k_ref.at[cols], k_smem.at[wg], kv_bar.at[wg, 0])
      if want_dk:
        plgpu.copy_gmem_to_smem(v_ref.at[cols], v_smem.at[wg], kv_bar.at[wg, 1])
      plgpu.barrier_wait(kv_bar.at[wg, 0])
      if want_dk:
        plgpu.barrier_wait(kv_bar.at[wg, 1])

      def step(q_step, acc, *, g, planes, masked: bool):
        masked = masked and any_mask
        acc = dict(acc)
        slot = lax.rem(g * span + q_step - tile_lo, jnp.int32(stages))
        bias_tile, mask_tile = common.extra_tiles(planes, c0, q_step, bkv, bq)
        if do_first:
          plgpu.barrier_wait(do_bar.at[slot])
          dp_t = _mm_t(v_smem.at[wg], do_smem.at[slot], (bkv, bq))
          plgpu.barrier_arrive(do_free.at[slot])
        plgpu.barrier_wait(q_bar.at[slot])
        plgpu.barrier_wait(lse_bar.at[slot])
        s_t = _mm_t(k_smem.at[wg], q_smem.at[slot], (bkv, bq))
        if not want_dk:
          plgpu.barrier_arrive(q_free.at[slot])
        lse = plgpu.load(lse_smem.at[slot], layout=_COL)
        plgpu.barrier_arrive(lse_free.at[slot])
        logits, dcap = _log2_logits(p, s_t, bias_tile)
        ok = None
        if masked:
          k_ids = common.iota((bkv, bq), 0) + c0
          q_ids = common.iota((bkv, bq), 1) + q_step * bq
          ok = common.visible(m, q_ids, k_ids, q_len, kv_len)
        logits = common.hide(logits, ok, mask_tile)
        p_t = jnp.exp2(logits - lax.broadcast_in_dim(lse, (bkv, bq), [1]))
        if not do_first:
          plgpu.barrier_wait(do_bar.at[slot])
        if want_dk:
          plgpu.barrier_wait(delta_bar.at[slot])
        stage = ds_smem.at[wg] if interpret else None
        if want_dv:
          acc["dv"] = _mm(acc["dv"], p_t.astype(dtype), do_smem.at[slot], interpret, stage)
        if not want_dk:
          plgpu.barrier_arrive(do_free.at[slot])
          return acc
        if not do_first:
          dp_t = _mm_t(v_smem.at[wg], do_smem.at[slot], (bkv, bq))
          plgpu.barrier_arrive(do_free.at[slot])
        delta = plgpu.load(delta_smem.at[slot], layout=_COL)
        plgpu.barrier_arrive(delta_free.at[slot])
        ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, (bkv, bq), [1]))
        if dcap is not None:
          ds_t = ds_t * dcap
        ds_t = ds_t.astype(dtype)
        acc["dk"] = _mm(acc["dk"], ds_t, q_smem.at[slot], interpret, stage)
        plgpu.barrier_arrive(q_free.at[slot])
        if want_dq:
          _add_dq(ds_t, q_step, g)
        return acc

      def _add_dq(ds_t, q_step, g):
        """Adds this consumer's share of the query block's dq, dS K, to the buffer."""
        ds_smem.at[wg][...] = ds_t
        plgpu.commit_smem()
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # The previous share's store.
        # 64 columns of H at a time: fewer live registers beside the dk and dv accumulators.
        for c in range(0, h, _DQ_COLS):
          cols = pl.ds(c, _DQ_COLS)
          part = _mm_refs(ds_smem.at[wg].T, k_smem.at[wg].at[:, cols], (bq, _DQ_COLS))
          dq_smem.at[wg].at[:, cols][...] = part
        plgpu.commit_smem()
        buffer = tile * NUM_CONSUMERS + wg if interpret else 0
        dst = dq_ref.at[buffer, batch, pl.ds(q_step * bq, bq), kv_head * groups + g]
        plgpu.copy_smem_to_gmem(dq_smem.at[wg], dst, reduction_op=None if interpret else "add")

      def skip(q_step, carry, *, g):
        slot = lax.rem(g * span + q_step - tile_lo, jnp.int32(stages))
        for full, free in streamed:
          plgpu.barrier_wait(full.at[slot])
          plgpu.barrier_arrive(free.at[slot])
        return carry

      def group(g, carry):
        planes = common.extra_planes(refs_bm, batch, kv_head * groups + g, c0, bkv)
        masked_step = functools.partial(step, g=g, planes=planes, masked=True)
        plain_step = functools.partial(step, g=g, planes=planes, masked=False)
        skip_g = functools.partial(skip, g=g)
        carry = lax.fori_loop(tile_lo, lo, skip_g, carry)
        carry = lax.fori_loop(lo, full_lo, masked_step, carry)
        carry = lax.fori_loop(full_lo, full_hi, plain_step, carry)
        carry = lax.fori_loop(full_hi, hi, masked_step, carry)
        return lax.fori_loop(hi, tile_hi, skip_g, carry)

      acc = lax.fori_loop(0, groups, group, {x: common.tile((bkv, h), 0.0) for x in names})
      # The held key (and value) slots stage the results.
      staging = dict(zip(names, (k_smem, v_smem)[: len(names)], strict=True))
      for x in names:
        staging[x].at[wg][...] = (acc[x] * p.scale if x == "dk" else acc[x]).astype(dtype)
      plgpu.commit_smem()
      for x in names:
        plgpu.copy_smem_to_gmem(staging[x].at[wg], out_refs[x].at[cols])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
      plgpu.set_max_registers(p.producer_registers, action="decrease")
      head0 = kv_head * groups

      def rows(ref):
        return lambda g, j: ref.at[batch, pl.ds(j * bq, bq), head0 + g]

      def vec(ref):
        return lambda g, j: ref.at[batch, head0 + g, pl.ds(j * bq, bq)]

      sources = [(rows(q_ref), q_smem), (vec(lse_ref), lse_smem), (rows(do_ref), do_smem)]
      if want_dk:
        sources.append((vec(delta_ref), delta_smem))
      streams = [(*a, *b_) for a, b_ in zip(sources, streamed, strict=True)]
      _stream(tile_lo, tile_hi, stages, [streams[i] for i in order], repeat=groups)

  # P^T.dO and dS^T.Q contract over the streamed query block (see `dq`).
  tr = common.smem_transforms(dtype, h, contracted=bq)
  smem = (
    plgpu.SMEM((NUM_CONSUMERS, bkv, h), dtype, transforms=tr),
    plgpu.SMEM((NUM_CONSUMERS, bkv, h), dtype, transforms=tr) if want_dk else None,
    plgpu.SMEM((stages, bq, h), dtype, transforms=tr),
    plgpu.SMEM((stages, bq, h), dtype, transforms=tr),
    plgpu.SMEM((stages, bq), jnp.float32),
    plgpu.SMEM((stages, bq), jnp.float32) if want_dk else None,
    plgpu.SMEM((NUM_CONSUMERS, bkv, bq), dtype, transforms=common.smem_transforms(dtype, bq))
    if interpret or want_dq
    else None,
    # Swizzled: the share's rows are 128 bytes apart or more, so a plain tile's stores from
    # the wgmma layout would hit the same banks.
    plgpu.SMEM(
      (NUM_CONSUMERS, bq, h),
      jnp.float32,
      transforms=common.smem_transforms(jnp.float32, 32),
    )
    if want_dq
    else None,
  )
  full = plgpu.Barrier(num_barriers=stages)
  free = plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages)
  bars = (
    plgpu.Barrier(num_barriers=(NUM_CONSUMERS, 2)),
    full,
    full,
    full,
    full if want_dk else None,
    free,
    free,
    free,
    free if want_dk else None,
  )
  kv_type = jax.ShapeDtypeStruct(k.shape, dtype)
  call = plgpu.kernel(
    body,
    out_type=tuple(kv_type for _ in names),
    scratch_types=(smem, bars),
    grid=(kh, num_tiles, b),
    grid_names=("heads", "kv_tiles", "batch"),
    num_threads=NUM_CONSUMERS + 1,
    thread_name="wg",
    kernel_name="attention_" + "_".join(outputs),  # attention_dk_dv, or one output's pass
    compiler_params=plgpu.CompilerParams(approx_math=True),
    interpret=interpret,
  )
  operands = (q, k, v, do, lse, delta, lengths, *extras)
  if not want_dq:
    return call(*operands)
  buffer = jax.new_ref(jnp.zeros((dq_parts, *q.shape), jnp.float32))  # Written in place.
  results = call(*operands, buffer)
  dq_sum = jnp.sum(jax.freeze(buffer), axis=0)
  return (*results, (dq_sum * p.scale).astype(dtype))
