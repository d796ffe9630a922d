"""linear_softmax_cross_entropy_loss with a fused Pallas Mosaic TPU kernel.

The design of the Mosaic GPU implementation (`mosaic`), on a TPU: the forward
pass never writes the [B, V] logits; `mosaic_tpu_kernel.logsumexp` folds each
(row tile, vocabulary tile) of x @ weights into a per-row online log-sum-exp
in VMEM. The vocabulary columns past the last whole tile and the label's logit
(a gather of B weight columns) are small XLA computations. The backward pass
(`mosaic_tpu_kernel.backward`) recomputes the logits tiles from the log-sum-exp
in two kernels, dx and dweights, with the whole H in VMEM, and the tail's share
in XLA; where its blocks do not fit in VMEM (very large H) it recomputes
vocabulary chunks in XLA (`chunked_xla`'s backward).
`implementation="mosaic"` keeps naming the Mosaic GPU kernel; this is
"mosaic_tpu".

Block sizes come from a cost model: among the blocks that Mosaic's tiling
allows (rows a multiple of 8 sublanes, 16 for bfloat16; vocabulary columns a
multiple of 128 lanes; the contraction a multiple of 128 dividing H, or H) and
whose VMEM footprint (`vmem_bytes`) fits the target chip's limit (`tpu.Chip`,
v5e or v5p), the one with the least roofline time: the weights streamed once
per row tile, x once (or once per vocabulary tile when H takes several steps),
the tail's logits in XLA, against MXU work, plus a fixed cost per grid step.
The backward's blocks are ranked the same way (the weights streamed once per
row tile by the dx kernel, x once per vocabulary tile by the dweights kernel,
two matmuls each). It ranks blocks; it claims no timing.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from tokamax._src import tpu
from tokamax._src.ops import kernel_ops
from tokamax._src.ops.linear_softmax_cross_entropy_loss import chunked_xla, spec
from tokamax._src.ops.linear_softmax_cross_entropy_loss import mosaic_tpu_kernel as kernel

_DTYPES = ("bfloat16", "float32")
_LANES = kernel.LANES
_BLOCKS = (128, 256, 512, 1024, 2048)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicTpuLossConfig:
  """Tiling of the forward and backward kernels (and of the XLA backward's chunks).

  Attributes:
    block_b: Rows per tile.
    block_v: Vocabulary columns per tile; V % block_v columns go to XLA.
    block_k: Contraction (of H) per step, dividing H.
    bwd_block_b: Rows per tile of the backward kernels.
    bwd_block_v: Vocabulary columns per tile of the backward kernels.
    vocab_chunk_size: Vocabulary columns per step of the XLA backward, used
      where the backward kernels' blocks do not fit.
  """

  block_b: int = 256
  block_v: int = 512
  block_k: int = 512
  bwd_block_b: int = 256
  bwd_block_v: int = 512
  vocab_chunk_size: int = 8192

  # The fields the forward kernel ignores (see `Op._forward_config`).
  BACKWARD_FIELDS: ClassVar[tuple[str, ...]] = ("bwd_block_b", "bwd_block_v", "vocab_chunk_size")


def vmem_bytes(args: spec.LossArgs, config: MosaicTpuLossConfig) -> int:
  """VMEM of a call: double-buffered blocks, the float32 accumulator and temporaries.

  The maximum, sum and output blocks are [block_b, 128] (lane-replicated).
  """
  bb, bv, bk = config.block_b, config.block_v, config.block_k
  in_size = np.dtype(args.x.dtype).itemsize
  inputs = 2 * (bb * bk + bk * bv) * in_size
  tiles = 2 * 4 * bb * bv  # The accumulator and the epilogue's exponentials.
  columns = 4 * 4 * bb * _LANES  # Maximum, sum, two output buffers.
  return inputs + tiles + columns


def bwd_vmem_bytes(args: spec.LossArgs, config: MosaicTpuLossConfig) -> int:
  """VMEM of the larger backward kernel: double-buffered x and weights blocks with
  the whole H, three [block_b, 128] row blocks, three tile temporaries, and the dx
  (float32 accumulator and output) or dweights (float32 accumulator) blocks."""
  bb, bv = config.bwd_block_b, config.bwd_block_v
  h = args.x.shape[1]
  in_size = np.dtype(args.x.dtype).itemsize
  inputs = 2 * (bb * h + h * bv) * in_size + 3 * 2 * 4 * bb * _LANES
  temps = 3 * 4 * bb * bv
  return inputs + temps + max(3 * 4 * bb * h, (4 + 2 * in_size) * h * bv)


def _tile_reason(args: spec.LossArgs, bb: int, bv: int, prefix: str) -> str | None:
  v = args.weights.shape[1]
  sublanes = 32 // np.dtype(args.x.dtype).itemsize
  if bb % sublanes:
    return (
      f"{prefix}block_b={bb} must be a multiple of {sublanes} for {np.dtype(args.x.dtype).name}"
    )
  if bv % _LANES:
    return f"{prefix}block_v={bv} must be a multiple of {_LANES}"
  if v < bv:
    return f"V={v} is below one vocabulary tile ({prefix}block_v={bv})"
  return None


def _vmem_reason(need: int) -> str | None:
  chip = tpu.chip()
  if need > chip.vmem_limit_bytes:
    return f"blocks need {need} bytes of VMEM, over the {chip.vmem_limit_bytes} used on {chip.name}"
  return None


def config_reason(args: spec.LossArgs, config: MosaicTpuLossConfig) -> str | None:
  """Why `config` cannot compute `args` on the target chip, or None."""
  h = args.weights.shape[0]
  bk = config.block_k
  reason = _tile_reason(args, config.block_b, config.block_v, "")
  if reason is not None:
    return reason
  if h % bk or (bk != h and bk % _LANES):
    return f"block_k={bk} must divide H={h} and be a multiple of {_LANES} or H"
  return _vmem_reason(vmem_bytes(args, config))


def bwd_config_reason(args: spec.LossArgs, config: MosaicTpuLossConfig) -> str | None:
  """Why the backward kernels cannot take `config` (then XLA computes the backward), or None."""
  reason = _tile_reason(args, config.bwd_block_b, config.bwd_block_v, "bwd_")
  return reason if reason is not None else _vmem_reason(bwd_vmem_bytes(args, config))


def _candidates(args: spec.LossArgs) -> list[MosaicTpuLossConfig]:
  """The block sizes the cost model ranks (before the checks of `config_reason`)."""
  b = args.x.shape[0]
  h, v = args.weights.shape
  sublanes = 32 // np.dtype(args.x.dtype).itemsize
  rows = [r for r in _BLOCKS if r < b] + [min(-(-b // sublanes) * sublanes, _BLOCKS[-1])]
  cols = [c for c in _BLOCKS if c <= v] or [_LANES]
  ks = [k for k in _BLOCKS if h % k == 0 and k < h] + [h]
  return [
    MosaicTpuLossConfig(block_b=bb, block_v=bv, block_k=bk)
    for bb, bv, bk in itertools.product(sorted(set(rows)), cols, ks)
  ]


def estimated_seconds(args: spec.LossArgs, config: MosaicTpuLossConfig) -> float:
  """The cost model's time for `config` on the target chip (for ranking blocks only)."""
  b = args.x.shape[0]
  h, v = args.weights.shape
  bb, bv, bk = config.block_b, config.block_v, config.block_k
  in_size = np.dtype(args.x.dtype).itemsize
  tiles_b, tiles_v, steps_k = -(-b // bb), v // bv, h // bk
  kernel_v = tiles_v * bv
  # With one contraction step the x block stays in VMEM across the vocabulary tiles.
  x_reads = 1 if steps_k == 1 else tiles_v
  hbm = (tiles_b * h * kernel_v + x_reads * tiles_b * bb * h) * in_size
  hbm += (h * (v - kernel_v) + b * h) * in_size  # The tail's weights and the label gather.
  flops = 2 * h * (tiles_b * bb * kernel_v + b * (v - kernel_v))
  return tpu.chip().seconds(flops, hbm, tiles_b * tiles_v * steps_k, in_size)


def bwd_estimated_seconds(args: spec.LossArgs, config: MosaicTpuLossConfig) -> float:
  """The cost model's time for the backward blocks of `config` (for ranking only)."""
  b = args.x.shape[0]
  h, v = args.weights.shape
  bb, bv = config.bwd_block_b, config.bwd_block_v
  in_size = np.dtype(args.x.dtype).itemsize
  tiles_b, tiles_v = -(-b // bb), v // bv
  kernel_v = tiles_v * bv
  dx_hbm = (tiles_b * h * kernel_v + b * h) * in_size + 4 * b * h
  dw_hbm = (tiles_v * tiles_b * bb * h + 2 * h * kernel_v) * in_size
  tail_hbm = (3 * h * (v - kernel_v) + 2 * b * h) * in_size
  # Each kernel: the logits and one gradient matmul; the tail: the logits and both.
  flops = 8 * tiles_b * bb * h * kernel_v + 6 * b * h * (v - kernel_v)
  steps = 2 * tiles_b * tiles_v
  return tpu.chip().seconds(flops, dx_hbm + dw_hbm + tail_hbm, steps, in_size)


def _ranked(args: spec.LossArgs) -> list[MosaicTpuLossConfig]:
  fitting = [c for c in _candidates(args) if config_reason(args, c) is None]
  ranked = sorted(fitting, key=lambda c: (estimated_seconds(args, c), dataclasses.astuple(c)))
  bwd = [
    dataclasses.replace(MosaicTpuLossConfig(), bwd_block_b=c.block_b, bwd_block_v=c.block_v)
    for c in _candidates(args)
    if c.block_k == args.x.shape[1]  # One per (block_b, block_v).
  ]
  bwd = [c for c in bwd if bwd_config_reason(args, c) is None]
  if not bwd:  # Then the backward runs in XLA.
    return ranked
  best = min(bwd, key=lambda c: (bwd_estimated_seconds(args, c), dataclasses.astuple(c)))
  fields = dict(bwd_block_b=best.bwd_block_b, bwd_block_v=best.bwd_block_v)
  return [dataclasses.replace(c, **fields) for c in ranked]


def logsumexp(
  args: spec.LossArgs, config: MosaicTpuLossConfig, interpret: pltpu.InterpretParams | None = None
) -> jax.Array:
  """float32 [B]: log-sum-exp of each row of x @ weights, without the [B, V] logits."""
  x, w = args.x, args.weights
  n_tiles = w.shape[1] // config.block_v
  lse = kernel.logsumexp(
    x,
    w,
    n_tiles=n_tiles,
    precision=args.precision,
    block_b=config.block_b,
    block_v=config.block_v,
    block_k=config.block_k,
    vmem_limit_bytes=tpu.chip().vmem_limit_bytes,
    interpret=interpret,
  )
  return spec.with_tail_columns(args, lse, n_tiles * config.block_v)[0]


def backward(
  args: spec.LossArgs,
  config: MosaicTpuLossConfig,
  lse: jax.Array,
  dout: jax.Array,
  interpret: pltpu.InterpretParams | None = None,
) -> dict[str, jax.Array]:
  """Cotangents of x and weights: the backward kernels, the tail's columns in XLA."""
  x, w = args.x, args.weights
  v = w.shape[1]
  g = chunked_xla.row_cotangents(args, dout)
  n_tiles = v // config.bwd_block_v
  dx, dw = kernel.backward(
    x,
    w,
    args.labels,
    lse,
    g,
    n_tiles=n_tiles,
    precision=args.precision,
    block_b=config.bwd_block_b,
    block_v=config.bwd_block_v,
    vmem_limit_bytes=tpu.chip().vmem_limit_bytes,
    interpret=interpret,
  )
  start = n_tiles * config.bwd_block_v
  if start < v:  # The columns past the last whole tile.
    tail = w[:, start:]
    logits = jnp.matmul(x, tail, precision=args.precision, preferred_element_type=jnp.float32)
    dlogits = chunked_xla.logit_cotangents(args, logits, start, lse, g)
    dx += jnp.matmul(dlogits, tail.T, precision=args.precision, preferred_element_type=jnp.float32)
    dw_tail = jnp.matmul(x.T, dlogits, precision=args.precision, preferred_element_type=jnp.float32)
    dw = jnp.concatenate([dw, dw_tail.astype(w.dtype)], axis=1)
  return {"x": dx.astype(x.dtype), "weights": dw}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicTpuLoss(kernel_ops.MosaicTpuOp):
  """Fused matmul + online log-sum-exp forward kernel; backward kernels recomputing the logits."""

  name = "mosaic_tpu"
  spec = spec.SPEC
  config_cls = MosaicTpuLossConfig

  def _unsupported_reason(self, args: spec.LossArgs) -> str | None:
    dtype = np.dtype(args.x.dtype).name
    if dtype not in _DTYPES:
      return f"input dtype {dtype} (supported: {', '.join(_DTYPES)})"
    if (reason := spec.empty_reason(args)) is not None:
      return reason
    config = self.config if self.config is not None else self._get_heuristics_config(args)
    return config_reason(args, config)

  def _get_heuristics_config(self, args: spec.LossArgs) -> MosaicTpuLossConfig:
    ranked = _ranked(args)
    return ranked[0] if ranked else MosaicTpuLossConfig()

  def _get_autotuning_configs(self, args: spec.LossArgs) -> set[MosaicTpuLossConfig]:
    return set(_ranked(args)[:8]) or {self._get_heuristics_config(args)}

  def _fwd(self, args: spec.LossArgs, config: MosaicTpuLossConfig):
    lse = logsumexp(args, config, self.interpret_params)
    return spec.loss(args, lse, spec.label_logits(args))

  def _bwd(self, args, config, out, residuals, dout):
    del out
    if bwd_config_reason(args, config) is not None:
      chunks = chunked_xla.ChunkedLossConfig(min(config.vocab_chunk_size, args.weights.shape[1]))
      return chunked_xla.backward(args, chunks, residuals, dout)
    return backward(args, config, residuals, dout, self.interpret_params)
