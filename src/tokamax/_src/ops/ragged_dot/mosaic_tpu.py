"""ragged_dot with Pallas Mosaic TPU kernels, all three layouts.

"default" and "rhs_transposed" run `mosaic_tpu_kernel.grouped_matmul`;
"ragged_contracting" runs `mosaic_tpu_kernel.transposed_grouped_matmul`. The
gradients of each layout are the other two (`spec.gradients`).
`implementation="mosaic"` names this implementation on a TPU.

Block sizes come from a cost model: among the blocks that Mosaic's tiling
allows (rows a multiple of 8 sublanes, 16 for bfloat16; columns a multiple of
128 lanes or the whole dimension) and whose VMEM footprint (`vmem_bytes`) fits
the target chip's limit (`tpu.Chip`, v5e or v5p), the one with the least
roofline time: HBM traffic (operand blocks refetched whenever their block
index changes) against MXU work (tiles shared by two groups are multiplied
twice), plus a fixed cost per grid step. It ranks blocks; it claims no timing.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from tokamax._src import tpu
from tokamax._src.ops import kernel_ops
from tokamax._src.ops.ragged_dot import mosaic_tpu_kernel as kernel
from tokamax._src.ops.ragged_dot import spec

_DTYPES = ("bfloat16", "float32")
_OUT_DTYPES = ("float32", "bfloat16")
_LANES = 128
_BLOCKS = (128, 256, 512, 1024, 2048)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicTpuRaggedDotConfig:
  """Block sizes of one call.

  Attributes:
    block_m: Rows of lhs per tile ("ragged_contracting": contracted rows per
      step, a multiple of 128).
    block_k: Contraction per step, dividing K ("ragged_contracting": output
      rows per tile).
    block_n: Output columns per tile.
  """

  block_m: int = 128
  block_k: int = 128
  block_n: int = 128


def _contracting(args: spec.RaggedDotArgs) -> bool:
  return args.layout == spec.RAGGED_CONTRACTING


def vmem_bytes(args: spec.RaggedDotArgs, config: MosaicTpuRaggedDotConfig) -> int:
  """VMEM of a call: double-buffered blocks, the float32 accumulator, temporaries.

  The temporaries are the masked output values (float32) or, for
  "ragged_contracting", the masked operands and the transposed lhs (float32
  at most).
  """
  bm, bk, bn = config.block_m, config.block_k, config.block_n
  in_size = np.dtype(args.lhs.dtype).itemsize
  out_size = np.dtype(args.out_dtype).itemsize
  if _contracting(args):
    inputs, out, temps = bm * (bk + bn), bk * bn, 4 * bm * (2 * bk + bn)
  else:
    inputs, out, temps = bm * bk + bk * bn, bm * bn, 4 * bm * bn
  return 2 * inputs * in_size + 2 * out * out_size + 4 * out + temps


def config_reason(args: spec.RaggedDotArgs, config: MosaicTpuRaggedDotConfig) -> str | None:
  """Why `config` cannot compute `args` on the target chip, or None."""
  _, k, n = spec.dims(args)
  bm, bk, bn = config.block_m, config.block_k, config.block_n
  sublanes = 32 // np.dtype(args.lhs.dtype).itemsize
  if _contracting(args):
    if bm % _LANES:
      return f"block_m={bm} must be a multiple of {_LANES} (rows are lanes of the transposed lhs)"
  elif bm % sublanes:
    return f"block_m={bm} must be a multiple of {sublanes} for {np.dtype(args.lhs.dtype).name}"
  for name, block, dim in (("block_k", bk, k), ("block_n", bn, n)):
    if block != dim and block % _LANES:
      return f"{name}={block} must be a multiple of {_LANES} or {dim}"
  if not _contracting(args) and k % bk:
    return f"block_k={bk} must divide K={k}"
  chip = tpu.chip()
  need = vmem_bytes(args, config)
  if need > chip.vmem_limit_bytes:
    return f"blocks need {need} bytes of VMEM, over the {chip.vmem_limit_bytes} used on {chip.name}"
  return None


def _candidates(args: spec.RaggedDotArgs) -> list[MosaicTpuRaggedDotConfig]:
  """The block sizes the cost model ranks (before the checks of `config_reason`)."""
  m, k, n = spec.dims(args)
  if _contracting(args):
    rows = [b for b in _BLOCKS if b < m] + [-(-m // _LANES) * _LANES]
    ks = [b for b in _BLOCKS if b < k] + [k]
  else:
    sublanes = 32 // np.dtype(args.lhs.dtype).itemsize
    rows = [b for b in _BLOCKS[:4] if b < m] + [min(-(-m // sublanes) * sublanes, _BLOCKS[3])]
    ks = [b for b in _BLOCKS if k % b == 0 and b < k] + [k]
  ns = [b for b in _BLOCKS if b < n] + [n]
  return [
    MosaicTpuRaggedDotConfig(block_m=bm, block_k=bk, block_n=bn)
    for bm, bk, bn in itertools.product(sorted(set(rows)), ks, ns)
  ]


def estimated_seconds(args: spec.RaggedDotArgs, config: MosaicTpuRaggedDotConfig) -> float:
  """The cost model's time for `config` on the target chip (for ranking blocks only)."""
  m, k, n = spec.dims(args)
  bm, bk, bn = config.block_m, config.block_k, config.block_n
  in_size = np.dtype(args.lhs.dtype).itemsize
  out_size = np.dtype(args.out_dtype).itemsize
  g = args.num_groups
  tiles_m, tiles_k, tiles_n = -(-m // bm), -(-k // bk), -(-n // bn)
  if _contracting(args):
    items = tiles_m + g
    steps = tiles_k * tiles_n * items
    hbm = steps * bm * (bk + bn) * in_size + g * k * n * out_size
    flops = 2 * items * bm * (tiles_k * bk) * (tiles_n * bn)
  else:
    items = tiles_m + g + 1  # Two zero segments (rows outside the groups).
    steps = tiles_n * items * tiles_k
    # With one contraction step an operand block stays in VMEM while its index holds.
    lhs_fetches = tiles_m if tiles_k == 1 else items * tiles_k
    rhs_fetches = g if tiles_k == 1 else items * tiles_k
    hbm = tiles_n * (lhs_fetches * bm * bk + rhs_fetches * bk * bn) * in_size
    hbm += m * n * out_size
    flops = 2 * items * bm * k * (tiles_n * bn)
  return tpu.chip().seconds(flops, hbm, steps, in_size)


def _ranked(args: spec.RaggedDotArgs) -> list[MosaicTpuRaggedDotConfig]:
  fitting = [c for c in _candidates(args) if config_reason(args, c) is None]
  return sorted(fitting, key=lambda c: (estimated_seconds(args, c), dataclasses.astuple(c)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicTpuRaggedDot(kernel_ops.MosaicTpuOp):
  """Grouped matmul in Pallas Mosaic TPU; gradients use the other layouts.

  A fixed `config` applies to the forward call, and to each gradient's call
  that it fits; the others take the blocks of their own shapes.
  """

  name = "mosaic_tpu"
  spec = spec.SPEC
  config_cls = MosaicTpuRaggedDotConfig

  def _unsupported_reason(self, args: spec.RaggedDotArgs) -> str | None:
    reason = spec.kernel_unsupported_reason(args, _DTYPES, _OUT_DTYPES)
    if reason is not None:
      return reason
    config = self.config if self.config is not None else self._get_heuristics_config(args)
    return config_reason(args, config)

  def _gradient_config(self, args: spec.RaggedDotArgs) -> MosaicTpuRaggedDotConfig:
    """The fixed config where it fits a gradient's call, else its tuned or heuristic one."""
    if self.config is not None and config_reason(args, self.config) is None:
      return self.config
    return dataclasses.replace(self, config=None).resolve_config(args)

  def _bwd_unsupported_reason(self, args: spec.RaggedDotArgs) -> str | None:
    reasons = []

    def check(record):
      op = self.with_config(self._gradient_config(record))
      reasons.append((record.layout, op._unsupported_reason(record)))
      return jnp.zeros(record.out_shape, record.out_dtype)

    jax.eval_shape(
      lambda dout: spec.gradients(args, dout, check),
      jax.ShapeDtypeStruct(args.out_shape, args.lhs.dtype),
    )
    return next((f"gradient ({lay}): {r}" for lay, r in reasons if r is not None), None)

  def _get_heuristics_config(self, args: spec.RaggedDotArgs) -> MosaicTpuRaggedDotConfig:
    ranked = _ranked(args)
    return ranked[0] if ranked else MosaicTpuRaggedDotConfig()

  def _get_autotuning_configs(self, args: spec.RaggedDotArgs) -> set[MosaicTpuRaggedDotConfig]:
    return set(_ranked(args)[:8]) or {self._get_heuristics_config(args)}

  def _fwd(self, args: spec.RaggedDotArgs, config: MosaicTpuRaggedDotConfig):
    return self._compute(args, config), None

  def _compute(self, args: spec.RaggedDotArgs, config: MosaicTpuRaggedDotConfig) -> jax.Array:
    sizes, before = spec.local_group_sizes(args)
    starts, ends = spec.group_row_bounds(sizes, before, args.lhs.shape[0])
    common = dict(
      out_dtype=args.out_dtype,
      precision=args.precision,
      block_m=config.block_m,
      block_k=config.block_k,
      block_n=config.block_n,
      vmem_limit_bytes=tpu.chip().vmem_limit_bytes,
      interpret=self.interpret_params,
    )
    if _contracting(args):
      return kernel.transposed_grouped_matmul(args.lhs, args.rhs, starts, ends, **common)
    return kernel.grouped_matmul(
      args.lhs,
      args.rhs,
      starts,
      ends,
      transpose_rhs=args.layout == spec.RHS_TRANSPOSED,
      **common,
    )

  def _bwd(self, args, config, out, residuals, dout):
    del config, out, residuals
    return spec.gradients(args, dout, lambda r: self._compute(r, self._gradient_config(r)))
