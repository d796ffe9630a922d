"""Warp-specialised flash-attention forward kernel in Pallas Mosaic GPU (Hopper).

One CTA holds `consumers` * block_q query rows of one head: two (or three)
consumer warpgroups own block_q rows each and run the wgmma matmuls and the
online softmax; one more, producer warpgroup streams key and value blocks by TMA
into `num_stages` shared-memory slots. With two consumers a schedule barrier
makes them take turns on the tensor cores, so one's softmax overlaps the other's
matmuls; three interleave without one. Where T is not a multiple of the CTA's
rows, the last tile's consumers past row T load and store nothing.

With `overlap_qk` each consumer also overlaps its own matmuls with its softmax:
step j issues Q.K_j^T and then P_{j-1}.V_{j-1} (the probabilities of the step
before, still in registers), waits for Q.K_j^T only, and computes the softmax
of step j while P_{j-1}.V_{j-1} runs; it then waits for that product and
rescales the output accumulator, which lives in wgmma registers across the
steps. The first step only issues its Q.K^T and the last P.V comes after the
loop. The schedule barrier then becomes a pair of turn barriers: a consumer
issues its two matmuls of a step only after the other issued its own.

Shapes: q [B,T,N,H], k and v [B,S,K,H] with T a multiple of block_q and S
of block_kv (the caller pads). Outputs o [B,T,N,H] and the log2-domain
log-sum-exp [B,N,T] of the scaled logits (+inf for rows that see nothing, so a
backward pass gets zero probabilities there).

An optional bias (any float dtype) and mask (int8, nonzero = visible) have the
layout [B|1, N|1, T|1, S|1] with T and S padded like q and k, and not both T
and S broadcast. With `stage_extras`, a plane that varies over both T and S is
streamed like the keys: the producer copies each consumer's [block_q, block_kv]
tile by TMA into the step's slot, and the consumer loads it from shared memory.
Otherwise consumers load their tiles from global memory into registers, a dim
of size 1 broadcast there, so nothing is materialised at [B,N,T,S].
"""

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from tokamax._src.ops.attention import mosaic_common as common

NUM_CONSUMERS = 2  # The default; `FwdParams.consumers` may take 3 (no schedule barrier).


@dataclasses.dataclass(frozen=True)
class FwdParams:
  """Static description of one forward kernel."""

  block_q: int
  block_kv: int
  num_stages: int
  scale: float
  soft_cap: float | None
  masking: common.Masking
  schedule_barrier: bool = True
  overlap_qk: bool = False
  stage_extras: bool = True
  consumers: int = NUM_CONSUMERS
  consumer_registers: int = 232
  producer_registers: int = 40


def forward(p: FwdParams, q, k, v, lengths, bias=None, mask=None, *, interpret=None):
  """Runs the kernel; `lengths` is int32 [2, B] (query, key lengths).

  `bias` (float) and `mask` (int8) are None or [B|1, N|1, T|1, S|1] as the module
  docstring says.
  """
  b, t, n, h = q.shape
  s_len, kh = k.shape[1], k.shape[2]
  groups = n // kh
  bq, bkv, stages, nc = p.block_q, p.block_kv, p.num_stages, p.consumers
  rows_per_cta = nc * bq
  num_tiles = pl.cdiv(t, rows_per_cta)
  # A partial last tile: its consumers past row t load and store nothing (`query_tile`).
  partial = t % rows_per_cta != 0
  assert nc == 2 or not (p.schedule_barrier or p.overlap_qk), "turns are for two consumers"
  dtype = q.dtype
  m = p.masking
  any_mask = m != common.Masking()
  c = p.scale * common.LOG2E

  extras = tuple(x for x in (bias, mask) if x is not None)
  staged = tuple(p.stage_extras and common.is_full_plane(x) for x in (bias, mask))
  assert not (partial and any(staged)), "staged planes need whole tiles"

  def staged_barrier(bar, slot, consumer):
    """The barrier of one consumer's staged tile in a pipeline slot."""
    return bar.at[slot * nc + consumer]

  def body(q_ref, k_ref, v_ref, len_ref, *refs):
    refs_bm = common.extra_refs(refs, bias, mask)
    o_ref, lse_ref, smem, bars = refs[len(extras) :]
    qo_smem, k_smem, v_smem, lse_smem, p_smem, x_smem = smem
    q_bar, k_bar, v_bar, k_free, v_free, sched, x_bars, *turn = bars
    turn = turn[0] if turn else None
    wg = lax.axis_index("wg")
    qt = common.query_tile(
      m, len_ref, t=t, s_len=s_len, groups=groups, block_q=bq, block_kv=bkv, consumers=nc
    )
    head, batch, kv_head, q_len, kv_len = qt.head, qt.batch, qt.kv_head, qt.q_len, qt.kv_len
    tile_r0, ranges, tile_lo, tile_hi = qt.r0, qt.ranges, qt.lo, qt.hi

    def rendezvous():
      if p.schedule_barrier:
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    @pl.when(wg < nc)
    def _consumer():
      plgpu.set_max_registers(p.consumer_registers, action="increase")
      r0 = tile_r0 + wg * bq
      lo, full_lo, full_hi, hi = (common.of_consumer(wg, x) for x in zip(*ranges, strict=True))
      q_smem = qo_smem.at[wg]
      in_rows = (lambda f: pl.when(r0 < t)(f)) if partial else (lambda f: f())

      @in_rows
      def _():
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(r0, bq), head], q_smem, q_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])

      planes = common.extra_planes(refs_bm, batch, head, r0, bq)

      def slot_of(kv_step):
        return lax.rem(kv_step - tile_lo, jnp.int32(stages))

      def x_bar(bar, kv_step):
        return staged_barrier(bar, slot_of(kv_step), wg)

      def tiles(kv_step):
        """(bias tile, mask tile), each None when absent; issued before the matmul."""
        out = []
        for (plane, values), smem_x, bar in zip(planes, x_smem, x_bars, strict=True):
          if smem_x is None:
            out.append(common.extra_tile(plane, values, r0, kv_step, bq, bkv))
          else:
            plgpu.barrier_wait(x_bar(bar, kv_step))
            tile = smem_x.at[slot_of(kv_step), wg]
            out.append(plgpu.load(tile, layout=plgpu.Layout.WGMMA))
        return tuple(out)

      def skip_tiles(kv_step):
        # A step this consumer skips still completes its staged tiles' barriers.
        for bar in x_bars:
          if bar is not None:
            plgpu.barrier_wait(x_bar(bar, kv_step))

      def softmax(kv_step, s, m_i, l_i, bias_tile, mask_tile, *, masked: bool):
        """(bf16 probabilities, new max, new sum, factor that rescales the output)."""
        masked = masked and any_mask
        capped, _ = common.log2_logits(s, bias_tile, p.scale, p.soft_cap)
        ok = None
        if masked:
          q_ids = common.iota((bq, bkv), 0) + r0
          k_ids = common.iota((bq, bkv), 1) + kv_step * bkv
          ok = common.visible(m, q_ids, k_ids, q_len, kv_len)
        if capped is None:
          s = common.hide(s, ok, mask_tile)
          m_new = jnp.maximum(m_i, s.max(axis=1) * c)
        else:
          capped = common.hide(capped, ok, mask_tile)
          m_new = jnp.maximum(m_i, capped.max(axis=1))
        # A row may still have seen nothing: its exponentials then subtract 0, not -inf
        # (exp2(-inf + inf) is NaN), but its max stays -inf. Carried on, a max of 0 would
        # bound the row's later maxima below by 0, and logits all far below 0 would
        # underflow to zero probabilities instead of the softmax of their differences.
        m_exp = m_new
        if ok is not None or mask_tile is not None or bias_tile is not None:
          m_exp = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        m_b = lax.broadcast_in_dim(m_exp, (bq, bkv), [0])
        probs = jnp.exp2(s * c - m_b) if capped is None else jnp.exp2(capped - m_b)
        alpha = jnp.exp2(m_i - m_exp)
        l_new = l_i * alpha + probs.sum(axis=1)
        return probs.astype(dtype), m_new, l_new, alpha

      def rescale(acc, alpha):
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

      def pv_interpret(acc, p16, slot):
        # The interpreter's wgmma takes A from shared memory only and has no
        # preloaded accumulators: stage P there and add a fresh product.
        p_smem.at[wg][...] = p16

        def product(acc_ref):
          plgpu.wgmma(acc_ref, p_smem.at[wg], v_smem.at[slot])
          return acc_ref[...]

        return acc + pl.run_scoped(product, plgpu.ACC((bq, h), jnp.float32))

      def finish(acc, m_i, l_i):
        seen = l_i > 0.0
        if m.q_len:
          row_ok = (common.iota((bq, h), 0) + r0 < q_len).astype(jnp.float32).max(axis=1)
          seen = seen & (row_ok > 0.0)
        inv = jnp.where(seen, 1.0 / jnp.where(seen, l_i, 1.0), 0.0)
        out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
        q_smem[...] = out.astype(dtype)
        lse_smem.at[wg][...] = jnp.where(seen, m_i + jnp.log2(jnp.where(seen, l_i, 1.0)), jnp.inf)
        plgpu.commit_smem()

        @in_rows
        def _():
          plgpu.copy_smem_to_gmem(q_smem, o_ref.at[batch, pl.ds(r0, bq), head])
          plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, pl.ds(r0, bq)])

        plgpu.wait_smem_to_gmem(0)

      rows0 = (common.rows((bq,), -jnp.inf), common.rows((bq,), 0.0))

      def step(kv_step, carry, *, masked: bool):
        acc, m_i, l_i = carry
        slot = slot_of(kv_step)
        bias_tile, mask_tile = tiles(kv_step)
        plgpu.barrier_wait(k_bar.at[slot])

        def qk(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
          rendezvous()
          return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
        p16, m_new, l_i, alpha = softmax(kv_step, s, m_i, l_i, bias_tile, mask_tile, masked=masked)
        acc = rescale(acc, alpha)
        if p.schedule_barrier:
          plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(v_bar.at[slot])
        if p.schedule_barrier:
          plgpu.barrier_wait(sched)
        if interpret:
          acc = pv_interpret(acc, p16, slot)
        else:

          def pv(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

          acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l_i

      def skip(kv_step, carry):
        # Steps the other consumer needs: keep the barriers' phases in step.
        slot = slot_of(kv_step)
        skip_tiles(kv_step)
        plgpu.barrier_wait(k_bar.at[slot])
        rendezvous()
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_wait(v_bar.at[slot])
        rendezvous()
        plgpu.barrier_arrive(v_free.at[slot])
        return carry

      def serial():
        carry = (common.tile((bq, h), 0.0), *rows0)
        pl.when(wg == 1)(rendezvous)
        masked_step = functools.partial(step, masked=True)
        plain_step = functools.partial(step, masked=False)
        carry = lax.fori_loop(tile_lo, lo, skip, carry)
        carry = lax.fori_loop(lo, full_lo, masked_step, carry)
        carry = lax.fori_loop(full_lo, full_hi, plain_step, carry)
        carry = lax.fori_loop(full_hi, hi, masked_step, carry)
        carry = lax.fori_loop(hi, tile_hi, skip, carry)
        pl.when(wg == 0)(rendezvous)
        finish(*carry)

      def overlapped(o_ref):
        """The `overlap_qk` schedule; `o_ref` is the output accumulator (None in interpret mode).

        The carry is (output or None, max, sum, probabilities of the step before):
        compiled, the output stays in `o_ref`'s wgmma registers and steps only
        issue products into it; interpreted, it is a value (see `pv_interpret`).
        """

        def turn_wait():
          if p.schedule_barrier:
            plgpu.barrier_wait(turn.at[wg])

        def turn_pass():
          if p.schedule_barrier:
            plgpu.barrier_arrive(turn.at[1 - wg])

        def issue_pv(acc, p16, slot):
          if o_ref is None:
            return pv_interpret(acc, p16, slot)
          plgpu.wgmma(o_ref, p16, v_smem.at[slot])
          return None

        def first(kv_step, carry):
          # Q.K^T of the first step, with nothing to overlap: the output is still zero.
          acc, m_i, l_i, _ = carry
          slot = slot_of(kv_step)
          bias_tile, mask_tile = tiles(kv_step)
          plgpu.barrier_wait(k_bar.at[slot])

          def qk(s_ref):
            turn_wait()
            plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].T)
            turn_pass()
            return s_ref[...]

          s = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))
          plgpu.barrier_arrive(k_free.at[slot])
          # Masked whatever the step: it runs once per consumer.
          p16, m_new, l_i, _ = softmax(kv_step, s, m_i, l_i, bias_tile, mask_tile, masked=True)
          return acc, m_new, l_i, p16

        def pipelined_step(kv_step, carry, *, masked: bool):
          acc, m_i, l_i, p_prev = carry
          slot, prev = slot_of(kv_step), slot_of(kv_step - 1)
          bias_tile, mask_tile = tiles(kv_step)
          plgpu.barrier_wait(k_bar.at[slot])

          def qk_pv(s_ref):
            turn_wait()
            plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].T)
            plgpu.barrier_wait(v_bar.at[prev])
            new_acc = issue_pv(acc, p_prev, prev)
            turn_pass()
            # Q.K^T is done once at most the later P.V group is in flight.
            return plgpu.wgmma_accumulator_load(s_ref, wait_n=1), new_acc

          s, acc = pl.run_scoped(qk_pv, plgpu.ACC((bq, bkv), jnp.float32))
          plgpu.barrier_arrive(k_free.at[slot])
          p16, m_new, l_i, alpha = softmax(
            kv_step, s, m_i, l_i, bias_tile, mask_tile, masked=masked
          )
          if o_ref is None:
            acc = rescale(acc, alpha)
          else:
            o_ref[...] = rescale(o_ref[...], alpha)  # The load waits for P.V.
          plgpu.barrier_arrive(v_free.at[prev])
          return acc, m_new, l_i, p16

        def last(kv_step, carry):
          # P.V of the last step (no turn: the consumers' turn counts stay equal).
          acc, m_i, l_i, p_prev = carry
          slot = slot_of(kv_step)
          plgpu.barrier_wait(v_bar.at[slot])
          acc = issue_pv(acc, p_prev, slot)
          if o_ref is not None:
            plgpu.wgmma_wait(0)
          plgpu.barrier_arrive(v_free.at[slot])
          return acc, m_i, l_i, p_prev

        def skip_turn(kv_step, carry):
          slot = slot_of(kv_step)
          skip_tiles(kv_step)
          plgpu.barrier_wait(k_bar.at[slot])
          turn_wait()
          plgpu.barrier_arrive(k_free.at[slot])
          plgpu.barrier_wait(v_bar.at[slot])
          turn_pass()
          plgpu.barrier_arrive(v_free.at[slot])
          return carry

        acc0 = common.tile((bq, h), 0.0) if o_ref is None else None
        carry = (acc0, *rows0, common.tile((bq, bkv), 0.0).astype(dtype))
        if p.schedule_barrier:
          pl.when(wg == 1)(lambda: plgpu.barrier_arrive(turn.at[0]))
        masked_step = functools.partial(pipelined_step, masked=True)
        plain_step = functools.partial(pipelined_step, masked=False)
        after_first = lo + 1
        carry = lax.fori_loop(tile_lo, lo, skip_turn, carry)
        carry = lax.fori_loop(lo, jnp.minimum(after_first, hi), first, carry)
        carry = lax.fori_loop(after_first, full_lo, masked_step, carry)
        carry = lax.fori_loop(jnp.maximum(after_first, full_lo), full_hi, plain_step, carry)
        carry = lax.fori_loop(jnp.maximum(after_first, full_hi), hi, masked_step, carry)
        carry = lax.fori_loop(jnp.maximum(hi - 1, lo), hi, last, carry)
        carry = lax.fori_loop(hi, tile_hi, skip_turn, carry)
        if p.schedule_barrier:
          pl.when(wg == 0)(lambda: plgpu.barrier_wait(turn.at[0]))
        acc, m_i, l_i, _ = carry
        finish(acc if o_ref is None else o_ref[...], m_i, l_i)

      if not p.overlap_qk:
        serial()
      elif interpret:
        overlapped(None)
      else:
        pl.run_scoped(overlapped, plgpu.ACC((bq, h), jnp.float32))

    @pl.when(wg == nc)
    def _producer():
      plgpu.set_max_registers(p.producer_registers, action="decrease")

      @pl.loop(tile_lo, tile_hi)
      def _(kv_step):
        i = kv_step - tile_lo
        slot = lax.rem(i, jnp.int32(stages))
        rows = (batch, pl.ds(kv_step * bkv, bkv), kv_head)

        @pl.when(i >= stages)
        def _():
          plgpu.barrier_wait(k_free.at[slot])

        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_bar.at[slot])
        # The staged tiles share the key slot's release: consumers load them first.
        for ref, smem_x, bar in zip(refs_bm, x_smem, x_bars, strict=True):
          if smem_x is None:
            continue
          plane = common.plane_of(ref, batch, head)
          for c in range(nc):
            src = plane.at[pl.ds(tile_r0 + c * bq, bq), pl.ds(kv_step * bkv, bkv)]
            plgpu.copy_gmem_to_smem(src, smem_x.at[slot, c], staged_barrier(bar, slot, c))

        @pl.when(i >= stages)
        def _():
          plgpu.barrier_wait(v_free.at[slot])

        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_bar.at[slot])

      # Observe the last releases too, so every barrier ends in a known phase.
      @pl.loop(jnp.maximum(tile_hi - stages, tile_lo), tile_hi)
      def _(kv_step):
        slot = lax.rem(kv_step - tile_lo, jnp.int32(stages))
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.barrier_wait(v_free.at[slot])

  transforms = common.smem_transforms(dtype, h)
  smem = (
    plgpu.SMEM((nc, bq, h), dtype, transforms=transforms),
    plgpu.SMEM((stages, bkv, h), dtype, transforms=transforms),
    plgpu.SMEM((stages, bkv, h), dtype, transforms=transforms),
    plgpu.SMEM((nc, bq), jnp.float32),
    plgpu.SMEM((nc, bq, bkv), dtype, transforms=common.smem_transforms(dtype, bkv))
    if interpret
    else None,
    tuple(
      plgpu.SMEM((stages, nc, bq, bkv), x.dtype, transforms=common.smem_transforms(x.dtype, bkv))
      if st
      else None
      for x, st in zip((bias, mask), staged, strict=True)
    ),
  )
  bars = (
    plgpu.Barrier(num_barriers=nc),
    plgpu.Barrier(num_barriers=stages),
    plgpu.Barrier(num_barriers=stages),
    plgpu.Barrier(num_arrivals=nc, num_barriers=stages),
    plgpu.Barrier(num_arrivals=nc, num_barriers=stages),
    plgpu.Barrier(num_arrivals=nc),
    tuple(plgpu.Barrier(num_barriers=stages * nc) if st else None for st in staged),
    # `overlap_qk`: consumer i may issue its matmuls of a step when turn[i] completes.
    *([plgpu.Barrier(num_barriers=nc)] if p.overlap_qk else []),
  )
  out_type = (
    jax.ShapeDtypeStruct(q.shape, dtype),
    jax.ShapeDtypeStruct((b, n, t), jnp.float32),
  )
  return plgpu.kernel(
    body,
    out_type=out_type,
    scratch_types=(smem, bars),
    grid=(n, num_tiles, b),
    grid_names=("heads", "q_tiles", "batch"),
    num_threads=nc + 1,
    thread_name="wg",
    compiler_params=plgpu.CompilerParams(approx_math=True),
    interpret=interpret,
  )(q, k, v, lengths, *extras)
