"""ragged_dot with Pallas Mosaic GPU kernels for Hopper (sm_90), all three layouts.

"default" and "rhs_transposed" run `mosaic_fwd` (a persistent, warp-specialised
TMA + wgmma grouped matmul); "ragged_contracting" runs `mosaic_drhs`. The
backward pass of each layout is made of the other two.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from tokamax._src.ops import kernel_ops
from tokamax._src.ops import mosaic_gemm as gemm
from tokamax._src.ops.ragged_dot import mosaic_drhs, mosaic_fwd, spec

_DTYPES = ("bfloat16", "float16")
_OUT_DTYPES = ("float32", "bfloat16", "float16")
# CTAs per cluster that the heuristics choose for the row-ragged layouts.
HEURISTIC_CLUSTER = 1
_ROW_ALIGN = gemm.ROW_ALIGN  # TMA tiling of the row dimension.


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicRaggedDotConfig:
  """Tiling shared by the kernels of the three layouts.

  Attributes:
    block_n: Output columns per work item.
    num_stages: Shared-memory stages of the load pipeline.
    epi_n: Output columns per epilogue store.
    cluster: CTAs per cluster of the "default"/"rhs_transposed" kernel; 2
      shares rhs tiles between two row blocks through TMA multicast.
    balance: Whether that kernel deals each round's cheap work items to its
      CTAs in turn (`mosaic_fwd.schedule`).
  """

  block_n: int = 256
  num_stages: int = 4
  epi_n: int = 128
  cluster: int = 1
  balance: bool = True


def _kernel_config(args: spec.RaggedDotArgs, config: MosaicRaggedDotConfig):
  block = gemm.swizzle_elems(args.lhs.dtype)
  if args.layout == spec.RAGGED_CONTRACTING:
    return mosaic_drhs.MosaicRaggedDotDrhsConfig(
      block_n=config.block_n, block_m=block, num_stages=config.num_stages, epi_n=config.epi_n
    )
  return mosaic_fwd.MosaicRaggedDotFwdConfig(
    block_n=config.block_n,
    block_k=block,
    num_stages=config.num_stages,
    epi_n=config.epi_n,
    cluster=config.cluster,
    balance=config.balance,
  )


def _config_reason(args: spec.RaggedDotArgs, config: MosaicRaggedDotConfig) -> str | None:
  m, k, n = spec.dims(args)
  module = mosaic_drhs if args.layout == spec.RAGGED_CONTRACTING else mosaic_fwd
  return module.config_reason(
    _kernel_config(args, config),
    m,
    k,
    n,
    np.dtype(args.lhs.dtype).itemsize,
    np.dtype(args.out_dtype).itemsize,
  )


def _with(args: spec.RaggedDotArgs, lhs, rhs, layout: str, out_dtype) -> spec.RaggedDotArgs:
  return dataclasses.replace(args, lhs=lhs, rhs=rhs, layout=layout, out_dtype=jnp.dtype(out_dtype))


def gradient_records(args: spec.RaggedDotArgs, dout: jax.Array) -> dict[str, spec.RaggedDotArgs]:
  """The records whose outputs are the gradients of lhs and rhs: the other two layouts."""
  lhs, rhs = args.lhs, args.rhs
  dt = lhs.dtype
  if isinstance(dout, jax.Array):
    dout = dout.astype(dt)
  if args.layout == spec.DEFAULT:
    return {
      "lhs": _with(args, dout, rhs, spec.RHS_TRANSPOSED, dt),
      "rhs": _with(args, lhs, dout, spec.RAGGED_CONTRACTING, dt),
    }
  if args.layout == spec.RHS_TRANSPOSED:
    return {
      "lhs": _with(args, dout, rhs, spec.DEFAULT, dt),
      "rhs": _with(args, dout, lhs, spec.RAGGED_CONTRACTING, dt),
    }
  return {
    "lhs": _with(args, rhs, dout, spec.RHS_TRANSPOSED, dt),
    "rhs": _with(args, lhs, dout, spec.DEFAULT, dt),
  }


def _abstract_dout(args: spec.RaggedDotArgs) -> jax.ShapeDtypeStruct:
  """A stand-in for the output cotangent, for support checks."""
  return jax.ShapeDtypeStruct(args.out_shape, args.lhs.dtype)


def _balance(args: spec.RaggedDotArgs, block_n: int) -> bool:
  """Whether to deal cheap work items in turn: where group boundaries can give every CTA one.

  Dealing them cost 10-11 us of XLA kernels on the H200 and took the skewed G64 forward
  kernel from 1.852 to 1.667 ms; the G8 forward (0.37 ms, with no cheap items) lost 3%
  (bench/results/h200/ragged_balance_6d2aa61.json).
  """
  if args.layout == spec.RAGGED_CONTRACTING:
    return False
  _, _, n = spec.dims(args)
  return args.num_groups * max(n // block_n, 1) >= gemm.num_sms()


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicRaggedDot(kernel_ops.MosaicGpuOp):
  """Grouped matmul in Pallas Mosaic GPU (Hopper); gradients use the other layouts."""

  name = "mosaic"
  spec = spec.SPEC
  config_cls = MosaicRaggedDotConfig

  def _unsupported_reason(self, args: spec.RaggedDotArgs) -> str | None:
    reason = spec.kernel_unsupported_reason(args, _DTYPES, _OUT_DTYPES)
    if reason is not None:
      return reason
    config = self.config if self.config is not None else self._get_heuristics_config(args)
    return _config_reason(args, config)

  @property
  def _gradient_op(self) -> "MosaicRaggedDot":
    """This op without a given config: the gradients take their own (tuned or heuristic)."""
    return dataclasses.replace(self, config=None)

  def _bwd_unsupported_reason(self, args: spec.RaggedDotArgs) -> str | None:
    for name, record in gradient_records(args, _abstract_dout(args)).items():
      reason = self._gradient_op._unsupported_reason(record)
      if reason is not None:
        return f"gradient of {name}: {reason}"
    return None

  def _get_heuristics_config(self, args: spec.RaggedDotArgs) -> MosaicRaggedDotConfig:
    _, _, n = spec.dims(args)
    block_n = next((b for b in (256, 128, 64) if n % b == 0), 64)
    epi_n = min(128, block_n)
    cluster = 1 if args.layout == spec.RAGGED_CONTRACTING else HEURISTIC_CLUSTER
    balance = _balance(args, block_n)
    for stages in (4, 3, 2):
      config = MosaicRaggedDotConfig(
        block_n=block_n, num_stages=stages, epi_n=epi_n, cluster=cluster, balance=balance
      )
      if _config_reason(args, config) is None:
        return config
    return MosaicRaggedDotConfig(
      block_n=block_n, num_stages=2, epi_n=min(64, block_n), balance=balance
    )

  def _get_autotuning_configs(self, args: spec.RaggedDotArgs) -> set[MosaicRaggedDotConfig]:
    clusters = (1,) if args.layout == spec.RAGGED_CONTRACTING else (1, 2)
    configs = {
      MosaicRaggedDotConfig(block_n=b, num_stages=s, epi_n=e, cluster=c, balance=_balance(args, b))
      for b, s, e, c in itertools.product((64, 128, 256), (2, 3, 4, 5), (64, 128), clusters)
      if e <= b
    }
    return {c for c in configs if _config_reason(args, c) is None} or {
      self._get_heuristics_config(args)
    }

  def _fwd(self, args: spec.RaggedDotArgs, config: MosaicRaggedDotConfig):
    return self._compute(args, config), None

  def _compute(self, args: spec.RaggedDotArgs, config: MosaicRaggedDotConfig) -> jax.Array:
    sizes, before = spec.local_group_sizes(args)
    lhs, rhs = args.lhs, args.rhs
    m = lhs.shape[0]
    pad = -m % _ROW_ALIGN
    if args.layout != spec.RAGGED_CONTRACTING:  # A row block must fit in lhs.
      pad = max(pad, gemm.WG_ROWS * gemm.NUM_COMPUTE_WGS - m)
    if pad:  # Padded rows fall outside every group.
      lhs = jnp.pad(lhs, ((0, pad), (0, 0)))
      if args.layout == spec.RAGGED_CONTRACTING:
        rhs = jnp.pad(rhs, ((0, pad), (0, 0)))
    kernel_config = _kernel_config(args, config)
    common = dict(
      out_dtype=args.out_dtype,
      config=kernel_config,
      num_sms=gemm.num_sms(self.interpret),
      interpret=self.interpret_params,
    )
    if args.layout == spec.RAGGED_CONTRACTING:
      return mosaic_drhs.ragged_contracting_dot(lhs, rhs, sizes, before, **common)
    out = mosaic_fwd.ragged_dot_fwd(
      lhs, rhs, sizes, before, transpose_rhs=args.layout == spec.RHS_TRANSPOSED, **common
    )
    return out[:m] if pad else out

  def _bwd(self, args, config, out, residuals, dout):
    del config, out, residuals
    grads = {}
    for name, record in gradient_records(args, dout).items():
      grads[name] = self._compute(record, self._gradient_op.resolve_config(record)).astype(
        getattr(args, name).dtype
      )
    return grads
