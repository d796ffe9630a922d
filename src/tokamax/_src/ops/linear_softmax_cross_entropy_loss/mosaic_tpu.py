"""linear_softmax_cross_entropy_loss with a fused Pallas Mosaic TPU kernel.

The design of the Mosaic GPU implementation (`mosaic`), on a TPU: the forward
pass never writes the [B, V] logits; `mosaic_tpu_kernel.logsumexp` folds each
(row tile, vocabulary tile) of x @ weights into a per-row online log-sum-exp
in VMEM. The vocabulary columns past the last whole tile and the label's logit
(a gather of B weight columns) are small XLA computations. The backward pass
recomputes the logits a vocabulary chunk at a time (`chunked_xla`'s backward).
`implementation="mosaic"` keeps naming the Mosaic GPU kernel; this is
"mosaic_tpu".

Block sizes come from a cost model: among the blocks that Mosaic's tiling
allows (rows a multiple of 8 sublanes, 16 for bfloat16; vocabulary columns a
multiple of 128 lanes; the contraction a multiple of 128 dividing H, or H) and
whose VMEM footprint (`vmem_bytes`) fits the target chip's limit (`tpu.Chip`,
v5e or v5p), the one with the least roofline time: the weights streamed once
per row tile, x once (or once per vocabulary tile when H takes several steps),
the tail's logits in XLA, against MXU work, plus a fixed cost per grid step.
It ranks blocks; it claims no timing.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from tokamax._src import tpu
from tokamax._src.ops import kernel_ops
from tokamax._src.ops.linear_softmax_cross_entropy_loss import chunked_xla, mosaic, spec
from tokamax._src.ops.linear_softmax_cross_entropy_loss import mosaic_tpu_kernel as kernel

_DTYPES = ("bfloat16", "float32")
_LANES = kernel.LANES
_BLOCKS = (128, 256, 512, 1024, 2048)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicTpuLossConfig:
  """Tiling of the forward kernel and the backward pass's vocabulary chunks.

  Attributes:
    block_b: Rows per tile.
    block_v: Vocabulary columns per tile; V % block_v columns go to XLA.
    block_k: Contraction (of H) per step, dividing H.
    vocab_chunk_size: Vocabulary columns per step of the backward pass.
  """

  block_b: int = 256
  block_v: int = 512
  block_k: int = 512
  vocab_chunk_size: int = 8192


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


def config_reason(args: spec.LossArgs, config: MosaicTpuLossConfig) -> str | None:
  """Why `config` cannot compute `args` on the target chip, or None."""
  h, v = args.weights.shape
  bb, bv, bk = config.block_b, config.block_v, config.block_k
  sublanes = 32 // np.dtype(args.x.dtype).itemsize
  if bb % sublanes:
    return f"block_b={bb} must be a multiple of {sublanes} for {np.dtype(args.x.dtype).name}"
  if bv % _LANES:
    return f"block_v={bv} must be a multiple of {_LANES}"
  if v < bv:
    return f"V={v} is below one vocabulary tile (block_v={bv})"
  if h % bk or (bk != h and bk % _LANES):
    return f"block_k={bk} must divide H={h} and be a multiple of {_LANES} or H"
  chip = tpu.chip()
  need = vmem_bytes(args, config)
  if need > chip.vmem_limit_bytes:
    return f"blocks need {need} bytes of VMEM, over the {chip.vmem_limit_bytes} used on {chip.name}"
  return None


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


def _ranked(args: spec.LossArgs) -> list[MosaicTpuLossConfig]:
  fitting = [c for c in _candidates(args) if config_reason(args, c) is None]
  return sorted(fitting, key=lambda c: (estimated_seconds(args, c), dataclasses.astuple(c)))


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
  start = n_tiles * config.block_v
  if start < w.shape[1]:  # The columns past the last whole tile.
    tail = jnp.matmul(x, w[:, start:], precision=args.precision, preferred_element_type=jnp.float32)
    lse = jnp.logaddexp(lse, jax.nn.logsumexp(tail, axis=1))
  return lse


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicTpuLoss(kernel_ops.MosaicTpuOp):
  """Fused matmul + online log-sum-exp kernel forward; chunked recomputation backward."""

  name = "mosaic_tpu"
  spec = spec.SPEC
  config_cls = MosaicTpuLossConfig

  def _unsupported_reason(self, args: spec.LossArgs) -> str | None:
    dtype = np.dtype(args.x.dtype).name
    if dtype not in _DTYPES:
      return f"input dtype {dtype} (supported: {', '.join(_DTYPES)})"
    config = self.config if self.config is not None else self._get_heuristics_config(args)
    return config_reason(args, config)

  def _get_heuristics_config(self, args: spec.LossArgs) -> MosaicTpuLossConfig:
    ranked = _ranked(args)
    return ranked[0] if ranked else MosaicTpuLossConfig()

  def _get_autotuning_configs(self, args: spec.LossArgs) -> set[MosaicTpuLossConfig]:
    return set(_ranked(args)[:8]) or {self._get_heuristics_config(args)}

  def _fwd(self, args: spec.LossArgs, config: MosaicTpuLossConfig):
    lse = logsumexp(args, config, self.interpret_params)
    return spec.reduce(args, lse - mosaic.label_logits(args)), lse

  def _bwd(self, args, config, out, residuals, dout):
    del out
    chunks = chunked_xla.ChunkedLossConfig(min(config.vocab_chunk_size, args.weights.shape[1]))
    return chunked_xla.backward(args, chunks, residuals, dout)
