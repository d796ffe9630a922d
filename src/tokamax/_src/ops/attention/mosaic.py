"""dot_product_attention through Pallas Mosaic GPU kernels (Hopper, sm_90)."""

import dataclasses
import functools
import itertools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from tokamax._src.ops import kernel_ops
from tokamax._src.ops.attention import mosaic_bwd, mosaic_fwd, xla
from tokamax._src.ops.attention import mosaic_common as common
from tokamax._src.ops.attention import spec as attention_spec

# Shared memory a CTA may use on Hopper (227 KiB), less room for barriers and alignment.
_SMEM_BYTES = 227 * 1024 - 4096
_HEAD_DIMS = (64, 128, 256)
# Backward block fields: rows a consumer warpgroup holds, and rows per streamed block.
_BWD_HELD = ("dq_block_q", "bwd_block_kv")
_BWD_STREAMED = ("dq_block_kv", "bwd_block_q")
_BWD_HELD_BLOCKS = (64, 128)
_BWD_STREAMED_BLOCKS = (32, 64, 128)

# Query rows per consumer warpgroup of the forward kernel: one wgmma M tile.
BLOCK_Q = 64


@dataclasses.dataclass(frozen=True)
class MosaicAttentionConfig:
  """Tuning parameters of the Mosaic attention kernels.

  The backward runs two kernels: the dq kernel (`dq_*` fields), which holds
  query rows and streams key/value blocks, and the dk/dv kernel (`bwd_*`
  fields), which holds keys and streams query blocks.

  The forward kernel holds `BLOCK_Q` query rows per consumer warpgroup.

  Attributes:
    block_kv: keys per pipeline step.
    num_stages: shared-memory slots of the key/value pipeline.
    schedule_barrier: whether the two consumers take turns on the tensor cores.
    fwd_consumers: consumer warpgroups of the forward kernel, `BLOCK_Q` query rows
      each: 2, or 3 without the schedule barrier and `overlap_qk` (its registers
      hold 128-key blocks at head dims up to 128).
    overlap_qk: whether each consumer issues the next step's Q.K^T before its
      softmax, so that its own matmuls overlap it (see `mosaic_fwd`).
    bwd_block_q: query rows per streamed block of the dk/dv kernel (32, 64 or
      128: 32 halves the score tiles, see `bwd_registers`).
    bwd_block_kv: keys per consumer warpgroup of the dk/dv kernel.
    bwd_num_stages: pipeline slots of the dk/dv kernel; each pass takes fewer
      (at least one) where they do not fit in shared memory.
    dq_block_q: query rows per consumer warpgroup of the dq kernel.
    dq_block_kv: keys per streamed block of the dq kernel (32, 64 or 128).
    dq_num_stages: pipeline slots of the dq kernel (fewer where they do not fit).
    deterministic_bwd: False allows a backward whose dq is not bitwise
      reproducible: at head dims 64 and 128 the dk/dv kernel also forms dq,
      adding each step's share into a float32 buffer by TMA reduce-add, and the
      dq kernel does not run (five matmuls per block pair instead of seven). At
      head dim 256 and under a causal mask the deterministic kernels run
      (`forms_dq_in_dkv`: there the one kernel measured slower). On the H200 it
      gained 7% at head dim 64 (docs/perf.md and docs/perf_decisions.md,
      Attention).
  """

  block_kv: int = 128
  num_stages: int = 2
  schedule_barrier: bool = True
  overlap_qk: bool = False
  fwd_consumers: int = 2
  bwd_block_q: int = 64
  bwd_block_kv: int = 64
  bwd_num_stages: int = 2
  dq_block_q: int = 64
  dq_block_kv: int = 64
  dq_num_stages: int = 2
  deterministic_bwd: bool = True

  # The fields the forward kernel ignores (see `Op._forward_config`).
  BACKWARD_FIELDS: ClassVar[tuple[str, ...]] = (
    "bwd_block_q",
    "bwd_block_kv",
    "bwd_num_stages",
    "dq_block_q",
    "dq_block_kv",
    "dq_num_stages",
    "deterministic_bwd",
  )

  def __post_init__(self):
    if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
      raise ValueError(f"`block_kv` must be 64, 128 or 256, got {self.block_kv}.")
    if self.num_stages < 2:
      raise ValueError(f"`num_stages` must be at least 2, got {self.num_stages}.")
    if self.fwd_consumers not in (2, 3):
      raise ValueError(f"`fwd_consumers` must be 2 or 3, got {self.fwd_consumers}.")
    if self.fwd_consumers == 3 and (self.schedule_barrier or self.overlap_qk):
      raise ValueError(
        "`fwd_consumers=3` needs `schedule_barrier=False` and `overlap_qk=False` (their turns"
        " are for two consumers)."
      )
    # Rows held per consumer: whole wgmma M tiles. Streamed blocks: the N of the
    # score products and the K of the products that contract them (dS.K, P^T.dO,
    # dS^T.Q), which a 32-wide block takes with a 64-byte swizzle (`mosaic_bwd`).
    # Past 128 the score tiles alone exceed the registers (`bwd_registers`).
    for names, allowed in ((_BWD_HELD, _BWD_HELD_BLOCKS), (_BWD_STREAMED, _BWD_STREAMED_BLOCKS)):
      for name in names:
        if getattr(self, name) not in allowed:
          raise ValueError(f"`{name}` must be one of {allowed}, got {getattr(self, name)}.")
    for name in ("bwd_num_stages", "dq_num_stages"):
      if getattr(self, name) < 1:
        raise ValueError(f"`{name}` must be at least 1, got {getattr(self, name)}.")


def smem_bytes(
  config: MosaicAttentionConfig, head_dim: int, itemsize: int = 2, staged: tuple[int, ...] = ()
) -> int:
  """Shared memory of the forward kernel for `config`.

  `staged` holds the itemsizes of the bias and mask planes the kernel streams
  through shared memory (`_staged_itemsizes`).
  """
  rows = config.fwd_consumers * BLOCK_Q
  q = rows * head_dim * itemsize
  kv = 2 * config.num_stages * config.block_kv * head_dim * itemsize
  extras = config.num_stages * rows * config.block_kv * sum(staged)
  return q + kv + extras + rows * 4


def _staged_itemsizes(args: attention_spec.AttentionArgs) -> tuple[int, ...]:
  """Itemsizes of the bias and mask planes the forward kernel may stage in shared memory."""
  staged = []
  if common.is_full_plane(args.bias):
    staged.append(args.bias.dtype.itemsize)
  if common.is_full_plane(args.mask):
    staged.append(1)  # The kernel takes the mask as int8.
  return tuple(staged)


def forms_dq_in_dkv(config: MosaicAttentionConfig, head_dim: int, causal: bool = False) -> bool:
  """Whether the dk/dv kernel forms dq (`deterministic_bwd=False`) in place of the dq kernel.

  Not at head dim 256: there the dk pass would form it, and on the H200 that took 1.9x the
  deterministic kernels' time (h200/attention_fused_dq_1a0b065.json). Not with a causal
  mask either: there the one kernel took 1.23x the deterministic kernels' time
  (h200/attention_fused_dq_6eac6db.json). Checks of a config take `causal` False, the
  kernels it may run.
  """
  return not config.deterministic_bwd and head_dim <= 128 and not causal


def _bwd_passes(head_dim: int, with_dq: bool = False) -> tuple[tuple[str, ...], ...]:
  """The outputs of each dk/dv kernel launch ("dq" too where it forms dq).

  A consumer's float32 dk and dv accumulators take head_dim registers per
  thread together: past 128 they leave too few of the 232 for the rest, so
  each output gets its own pass.
  """
  if head_dim > 128:
    return (("dv",), ("dk",))
  return (("dk", "dv", *(("dq",) if with_dq else ())),)


def _bwd_kernel_params(
  config: MosaicAttentionConfig, head_dim: int, scale=1.0, soft_cap=None, masking=None
):
  """(dq params, [(outputs, dk/dv params) per pass]), each with the stages that fit."""
  masking = masking or common.Masking()
  common_kw = dict(scale=scale, soft_cap=soft_cap, masking=masking)
  p_dq = mosaic_bwd.BwdParams(
    block_q=config.dq_block_q,
    block_kv=config.dq_block_kv,
    num_stages=config.dq_num_stages,
    **common_kw,
  )
  p_dkv = mosaic_bwd.BwdParams(
    block_q=config.bwd_block_q,
    block_kv=config.bwd_block_kv,
    num_stages=config.bwd_num_stages,
    **common_kw,
  )

  def fit(p, smem_bytes):
    stages = p.num_stages
    while stages > 1 and smem_bytes(dataclasses.replace(p, num_stages=stages)) > _SMEM_BYTES:
      stages -= 1
    return dataclasses.replace(p, num_stages=stages)

  p_dq = fit(p_dq, lambda x: mosaic_bwd.dq_smem_bytes(x, head_dim))
  passes = [
    (o, fit(p_dkv, lambda x, o=o: mosaic_bwd.dkv_smem_bytes(x, head_dim, o)))
    for o in _bwd_passes(head_dim, forms_dq_in_dkv(config, head_dim, masking.causal))
  ]
  return p_dq, passes


def bwd_smem_bytes(config: MosaicAttentionConfig, head_dim: int) -> int:
  """Shared memory of the largest backward kernel `config` may run (after fitting its stages).

  The dq kernel counts even where the dk/dv kernel forms dq: a causal mask runs it.
  """
  p_dq, passes = _bwd_kernel_params(config, head_dim)
  _, causal_passes = _bwd_kernel_params(config, head_dim, masking=common.Masking(causal=True))
  dkv = [mosaic_bwd.dkv_smem_bytes(p, head_dim, o) for o, p in passes + causal_passes]
  return max(mosaic_bwd.dq_smem_bytes(p_dq, head_dim), *dkv)


# Float32 registers per consumer thread that the backward kernels' live tiles
# may take (`bwd_registers`) out of the 232 a consumer gets: what the 64/64
# blocks take at head dims 128 (dk/dv) and 256 (dq, each dk/dv pass), the
# configs measured on the H200; more leaves too few for operands and addresses.
_BWD_REGISTERS = 192


def bwd_registers(config: MosaicAttentionConfig, head_dim: int) -> tuple[int, int]:
  """Float32 registers per consumer thread of the (dq, dk/dv) kernels' live tiles.

  A warpgroup's 128 threads share its float32 tiles: the accumulators (dq
  [dq_block_q, H]; dk and dv [bwd_block_kv, H] each, one per pass where
  `_bwd_passes` splits them) and the two score tiles (S and dP). At head dim
  256 the 64-row blocks take 192 in each kernel, and streamed 32-row blocks
  (`dq_block_kv`, `bwd_block_q`) 160, halving the score tiles. The dq kernel
  counts whatever `deterministic_bwd` (a causal mask runs it); where the dk/dv
  kernel forms dq, its share [bwd_block_q, H] is live only once the score tiles
  are dead, and no larger than them while H <= 2 * bwd_block_kv.
  """
  dq = config.dq_block_q * (head_dim + 2 * config.dq_block_kv)
  outputs = max(len(o) for o in _bwd_passes(head_dim))
  dkv = config.bwd_block_kv * (outputs * head_dim + 2 * config.bwd_block_q)
  return dq // 128, dkv // 128


def bwd_config_reason(config: MosaicAttentionConfig, head_dim: int) -> str | None:
  """Why the backward kernels cannot take `config` at `head_dim` (None if they can)."""
  if forms_dq_in_dkv(config, head_dim) and config.bwd_block_q < 64:
    return (
      f"deterministic_bwd=False with bwd_block_q {config.bwd_block_q} at head dim {head_dim}"
      " (dq's share is whole 64-row wgmma tiles)"
    )
  regs = bwd_registers(config, head_dim)
  if max(regs) > _BWD_REGISTERS:
    return (
      f"config {config} needs (dq, dk/dv) {regs} float32 registers per thread at head dim"
      f" {head_dim} (at most {_BWD_REGISTERS} leave room for the rest)"
    )
  needed = bwd_smem_bytes(config, head_dim)
  if needed > _SMEM_BYTES:
    return f"config {config} needs {needed} bytes of shared memory backward"
  return None


def bwd_padding(config: MosaicAttentionConfig) -> tuple[int, int]:
  """(T, S) multiples the backward kernels need: whole CTA tiles and streamed blocks."""
  nc = mosaic_bwd.NUM_CONSUMERS
  return (
    math.lcm(nc * config.dq_block_q, config.bwd_block_q),
    math.lcm(nc * config.bwd_block_kv, config.dq_block_kv),
  )


@dataclasses.dataclass(frozen=True, kw_only=True)
class BwdBlocks:
  """The backward fields of `MosaicAttentionConfig`: blocks and slots of both kernels."""

  dq_block_q: int
  dq_block_kv: int
  dq_num_stages: int
  bwd_block_q: int
  bwd_block_kv: int
  bwd_num_stages: int

  def apply(self, config: MosaicAttentionConfig) -> MosaicAttentionConfig:
    """`config` with these backward fields."""
    return dataclasses.replace(config, **dataclasses.asdict(self))


# The backward blocks the heuristic picks per head dim. H64 and H128 stream 128
# keys per dq step (and H64 128-query blocks in dk/dv): fewer, larger steps.
# H256 streams 32-row blocks in both kernels, the largest whose score tiles fit
# the registers without spills; at H64 and H128 32-row blocks are slower.
# Timings: docs/perf_decisions.md (Attention, Backward blocks).
_H128_BWD = BwdBlocks(
  dq_block_q=64, dq_block_kv=128, dq_num_stages=2, bwd_block_q=64, bwd_block_kv=64, bwd_num_stages=2
)
_BWD_HEURISTICS: dict[int, BwdBlocks] = {
  64: dataclasses.replace(_H128_BWD, bwd_block_q=128),
  128: _H128_BWD,
  256: dataclasses.replace(
    _H128_BWD, dq_block_kv=32, dq_num_stages=3, bwd_block_q=32, bwd_num_stages=3
  ),
}


def bwd_variants(base: MosaicAttentionConfig, head_dim: int) -> list[MosaicAttentionConfig]:
  """`base` with the valid backward configs (`bwd_config_reason`) of both kernels.

  Every valid pair of blocks of the dq and the dk/dv kernel (held and streamed
  blocks, `_BWD_HELD` and `_BWD_STREAMED`), each with two or three slots (one
  to three at head dim 256, where a third fits only the dv pass of 32-row
  blocks); configs whose kernels come out the same after fitting the slots
  count once (`base` first).
  """
  stages = (1, 2, 3) if head_dim > 128 else (2, 3)
  held, streamed = _BWD_HELD_BLOCKS, _BWD_STREAMED_BLOCKS
  seen = {}
  candidates = (
    BwdBlocks(
      dq_block_q=dq_q,
      dq_block_kv=dq_kv,
      dq_num_stages=dq_s,
      bwd_block_q=kv_q,
      bwd_block_kv=kv_kv,
      bwd_num_stages=kv_s,
    ).apply(base)
    for dq_q, dq_kv, dq_s, kv_q, kv_kv, kv_s in itertools.product(
      held, streamed, stages, streamed, held, stages
    )
  )
  for config in [base, *candidates]:
    if bwd_config_reason(config, head_dim) is None:
      p_dq, passes = _bwd_kernel_params(config, head_dim)
      seen.setdefault((p_dq, tuple(passes)), config)
  return list(seen.values())


def _masking(args: attention_spec.AttentionArgs, padded_s: bool) -> common.Masking:
  return common.Masking(
    causal=args.is_causal,
    window=args.local_window,
    q_len=args.q_seq_lengths is not None,
    kv_len=args.kv_seq_lengths is not None or padded_s,
  )


def _extra(x: jax.Array | None, t_pad: int, s_pad: int, dtype=None) -> jax.Array | None:
  """A bias or mask [B|1, N|1, T|1, S|1] padded (with zeros) as the kernel wants it.

  Padded rows are dropped and padded keys hidden by the kernel, so the value
  there does not matter. T and S both broadcast become [B|1, N|1, 1, S_pad].
  """
  if x is None:
    return None
  if dtype is not None:
    x = x.astype(dtype)
  bb, nb, tb, sb = x.shape
  if tb == sb == 1:
    x = jnp.broadcast_to(x, (bb, nb, 1, s_pad))
  if tb > 1:
    x = _pad(x, 2, t_pad)
  if x.shape[3] > 1:
    x = _pad(x, 3, s_pad)
  return x


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _pad(x: jax.Array, axis: int, length: int, value: float = 0.0) -> jax.Array:
  if x.shape[axis] == length:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def _stages_extras(config: MosaicAttentionConfig, args: attention_spec.AttentionArgs) -> bool:
  """Whether the forward streams full bias and mask planes through shared memory.

  Where their slots do not fit beside the key/value pipeline, or with three
  consumers (whose last tile may be partial), the consumers load them from global
  memory instead.
  """
  if config.fwd_consumers != 2:
    return False
  staged = _staged_itemsizes(args)
  return smem_bytes(config, args.query.shape[-1], staged=staged) <= _SMEM_BYTES


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicAttention(kernel_ops.MosaicGpuOp):
  """Warp-specialised flash attention in Pallas Mosaic GPU."""

  name = "mosaic"
  spec = attention_spec.SPEC
  config_cls = MosaicAttentionConfig

  def _unsupported_reason(self, args: attention_spec.AttentionArgs) -> str | None:
    if (reason := attention_spec.empty_reason(args)) is not None:
      return reason
    h, hv = args.query.shape[-1], args.value.shape[-1]
    if args.query.dtype not in (jnp.bfloat16, jnp.float16):
      return f"dtype {args.query.dtype} (the Mosaic kernel takes bfloat16 and float16)"
    if h != hv:
      return f"value head dim {hv} differs from query head dim {h}"
    if h not in _HEAD_DIMS:
      return f"head dim {h} (the Mosaic kernel takes {', '.join(map(str, _HEAD_DIMS))})"
    config = self.config
    if config is not None and smem_bytes(config, h) > _SMEM_BYTES:
      return f"config {config} needs {smem_bytes(config, h)} bytes of shared memory"
    if config is not None and config.fwd_consumers == 3 and config.block_kv * h > 128 * 64:
      return (
        f"fwd_consumers=3 with block_kv {config.block_kv} at head dim {h} (three consumers'"
        " registers hold block_kv * head_dim <= 8192)"
      )
    return None

  def _get_heuristics_config(self, args: attention_spec.AttentionArgs) -> MosaicAttentionConfig:
    # H64 with long keys runs three consumers on 128-key blocks (kernel 0.96x the
    # two consumers' 256-key blocks at B32 T2048 N16, 0.87x causal,
    # h200/attention_fwd_consumers_863e239.json) unless a bias or mask plane would
    # stream through shared memory; unmasked H128 overlaps each consumer's next
    # Q.K^T with its softmax, without the schedule barrier; causal shapes and H256
    # stay serial, where the overlap was slower (docs/perf_decisions.md, Attention). Staged
    # bias and mask tiles take smaller key blocks where two slots of them do not fit.
    h = args.query.shape[-1]
    s = args.key.shape[1]
    if h > 128 or s <= 64:
      block_kv = 64
    elif h == 64 and s >= 512:
      block_kv = 256
    else:
      block_kv = 128
    unmasked = not args.is_causal and args.local_window is None
    overlap = h == 128 and block_kv == 128 and unmasked and args.bias is None and args.mask is None
    if block_kv == 256 and not _staged_itemsizes(args):
      config = MosaicAttentionConfig(
        block_kv=128, num_stages=2, schedule_barrier=False, fwd_consumers=3
      )
    else:
      config = MosaicAttentionConfig(
        block_kv=block_kv, num_stages=2, schedule_barrier=not overlap, overlap_qk=overlap
      )
    while config.block_kv > 64 and _staged_itemsizes(args) and not _stages_extras(config, args):
      config = dataclasses.replace(config, block_kv=config.block_kv // 2)
    return _BWD_HEURISTICS[h].apply(config)

  def _get_autotuning_configs(
    self, args: attention_spec.AttentionArgs
  ) -> set[MosaicAttentionConfig]:
    """Forward variants around the heuristic's backward, and backward variants around its forward."""
    h = args.query.shape[-1]
    base = self._get_heuristics_config(args)
    configs = {base}
    shapes = itertools.product((64, 128, 256), (2, 3, 4), (True, False), (2, 3))
    for block_kv, stages, sched, consumers in shapes:
      if consumers == 3 and (sched or block_kv * h > 128 * 64):
        continue  # Three consumers take no turns, and their registers hold fewer keys.
      config = dataclasses.replace(
        base,
        block_kv=block_kv,
        num_stages=stages,
        schedule_barrier=sched,
        overlap_qk=base.overlap_qk and consumers == 2,
        fwd_consumers=consumers,
      )
      if smem_bytes(config, h) <= _SMEM_BYTES and block_kv * h <= 128 * 128:
        configs.add(config)
    configs.update(bwd_variants(base, h))
    return configs

  def _fwd(self, args: attention_spec.AttentionArgs, config: MosaicAttentionConfig):
    q, k, v = args.query, args.key, args.value
    b, t, _, _ = q.shape
    s = k.shape[1]
    # Two consumers take whole CTA tiles; three a partial last tile (whole 64-row blocks),
    # where padding to 192 rows would copy q.
    t_pad = _round_up(t, 2 * BLOCK_Q if config.fwd_consumers == 2 else BLOCK_Q)
    s_pad = _round_up(s, config.block_kv)
    masking = _masking(args, s_pad != s)
    q_len = args.q_seq_lengths if args.q_seq_lengths is not None else jnp.full((b,), t, jnp.int32)
    kv_len = (
      args.kv_seq_lengths if args.kv_seq_lengths is not None else jnp.full((b,), s, jnp.int32)
    )
    lengths = jnp.stack([jnp.minimum(q_len, t), jnp.minimum(kv_len, s)]).astype(jnp.int32)
    params = mosaic_fwd.FwdParams(
      block_q=BLOCK_Q,
      block_kv=config.block_kv,
      num_stages=min(config.num_stages, max(2, s_pad // config.block_kv)),
      scale=args.scale,
      soft_cap=args.soft_cap,
      masking=masking,
      schedule_barrier=config.schedule_barrier,
      overlap_qk=config.overlap_qk,
      stage_extras=_stages_extras(config, args),
      consumers=config.fwd_consumers,
      # Three consumers and the producer share the 512 registers per thread of four.
      **(dict(consumer_registers=160, producer_registers=32) if config.fwd_consumers == 3 else {}),
    )
    out, lse = mosaic_fwd.forward(
      params,
      _pad(q, 1, t_pad),
      _pad(k, 1, s_pad),
      _pad(v, 1, s_pad),
      lengths,
      _extra(args.bias, t_pad, s_pad),
      _extra(args.mask, t_pad, s_pad, jnp.int8),
      interpret=self.interpret_params,
    )
    return out[:, :t], (lse, lengths)

  def _bwd_unsupported_reason(self, args: attention_spec.AttentionArgs) -> str | None:
    if self.config is None:
      return None
    return bwd_config_reason(self.config, args.query.shape[-1])

  def _bwd(
    self, args: attention_spec.AttentionArgs, config: MosaicAttentionConfig, out, residuals, dout
  ):
    lse, lengths = residuals
    q, k, v = args.query, args.key, args.value
    t, s, h = q.shape[1], k.shape[1], q.shape[-1]
    t_mult, s_mult = bwd_padding(config)
    t_pad, s_pad = _round_up(t, t_mult), _round_up(s, s_mult)
    delta = attention_spec.output_delta(out, dout)
    lse = _pad(lse[:, :, :t], 2, t_pad, jnp.inf)  # Padded rows: zero probabilities.
    masking = _masking(args, s_pad != s)
    p_dq, passes = _bwd_kernel_params(config, h, args.scale, args.soft_cap, masking)
    qp, dop = _pad(q, 1, t_pad), _pad(dout.astype(q.dtype), 1, t_pad)
    kp, vp = _pad(k, 1, s_pad), _pad(v, 1, s_pad)
    operands = (qp, kp, vp, dop, lse, _pad(delta, 2, t_pad), lengths)
    extras = (_extra(args.bias, t_pad, s_pad), _extra(args.mask, t_pad, s_pad, jnp.int8))
    extras_t = tuple(None if x is None else jnp.swapaxes(x, 2, 3) for x in extras)
    interpret = self.interpret_params
    grads = {}
    if not forms_dq_in_dkv(config, h, masking.causal):
      grads["query"] = mosaic_bwd.dq(p_dq, *operands, *extras, interpret=interpret)[:, :t]
    names = {"dq": "query", "dk": "key", "dv": "value"}
    for outputs, p_dkv in passes:
      res = mosaic_bwd.dkv(p_dkv, *operands, *extras_t, outputs=outputs, interpret=interpret)
      for name, x in zip(outputs, res, strict=True):
        grads[names[name]] = x[:, : t if name == "dq" else s]
    if args.bias is not None:
      grads["bias"] = xla.bias_grad(args, out, dout)
    return grads


@functools.cache
def interpret_op() -> MosaicAttention:
  """The implementation in interpret mode (runs on the CPU)."""
  return MosaicAttention(interpret=True)
