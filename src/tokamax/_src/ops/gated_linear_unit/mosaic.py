"""gated_linear_unit with a fused Pallas Mosaic GPU kernel for Hopper (sm_90).

The forward pass is one kernel (`mosaic_kernel`): both projections from one
read of x, the gate applied in the epilogue. Under differentiation the same
kernel also writes the two projections (the residuals); the backward pass is
XLA: the gradients of both projections in one fusion, then the four matmuls
of the projections' transpose.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax._src.ops import kernel_ops
from tokamax._src.ops.gated_linear_unit import mosaic_kernel, spec
from tokamax._src.ops.ragged_dot import mosaic as ragged_mosaic
from tokamax._src.ops.ragged_dot import mosaic_fwd

_DTYPES = ("bfloat16", "float16")
_ROW_ALIGN = mosaic_fwd.ROW_ALIGN


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Tiling of the fused kernel.

  Attributes:
    block_n: Columns of each projection per work item.
    num_stages: Shared-memory stages of the load pipeline.
    epi_n: Output columns per epilogue store.
    grid_tile_m: Row tiles visited together before moving along N.
  """

  block_n: int = 128
  num_stages: int = 4
  epi_n: int = 128
  grid_tile_m: int = 16


def _kernel_config(x_dtype, config: Config) -> mosaic_kernel.Config:
  return mosaic_kernel.Config(
    block_n=config.block_n,
    block_k=128 // np.dtype(x_dtype).itemsize,
    num_stages=config.num_stages,
    epi_n=config.epi_n,
    grid_tile_m=config.grid_tile_m,
  )


def _dims(args: spec.GluArgs) -> tuple[int, int, int]:
  k = args.x.shape[-1]
  return args.x.size // max(k, 1), k, args.n


def _config_reason(args: spec.GluArgs, config: Config, num_outputs: int) -> str | None:
  m, k, n = _dims(args)
  return mosaic_kernel.config_reason(
    _kernel_config(args.x.dtype, config), m, k, n, np.dtype(args.x.dtype).itemsize, num_outputs
  )


def _primitives(jaxpr) -> set:
  """Every primitive of a jaxpr, nested jaxprs included."""
  prims = set()
  for eqn in jaxpr.eqns:
    prims.add(eqn.primitive)
    for param in eqn.params.values():
      for sub in param if isinstance(param, tuple | list) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          prims |= _primitives(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          prims |= _primitives(sub)
  return prims


@functools.lru_cache(maxsize=64)
def _activation_reason(activation) -> str | None:
  """Why the kernel cannot apply `activation` in its epilogue, or None."""
  if activation is None:
    return None
  from jax._src.pallas.mosaic_gpu import core as gpu_core
  from jax._src.pallas.mosaic_gpu import lowering

  try:
    jaxpr = jax.make_jaxpr(activation)(jax.ShapeDtypeStruct((64, 64), jnp.float32))
  except Exception as e:
    return f"activation {activation!r} cannot be traced ({e})"
  rules = lowering.mosaic_lowering_rules[gpu_core.WGxWG_SEMANTICS]
  missing = sorted(p.name for p in _primitives(jaxpr.jaxpr) if p not in rules)
  if missing:
    return f"activation {activation!r} uses {', '.join(missing)}, which Mosaic GPU cannot lower"
  return None


def _flat_weights(args: spec.GluArgs):
  """(w_gate ref, w_up ref, up_block_offset in units of block_n) for the kernel."""
  if isinstance(args.weights, tuple):
    return args.weights[0], args.weights[1], None
  k, _, n = args.weights.shape
  fused = args.weights.reshape(k, 2 * n)
  return fused, fused, n


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicGatedLinearUnit(kernel_ops.MosaicGpuOp):
  """Fused gated linear unit in Pallas Mosaic GPU (Hopper)."""

  name = "mosaic"
  spec = spec.SPEC
  config_cls = Config

  def _unsupported_reason(self, args: spec.GluArgs) -> str | None:
    dtype = np.dtype(args.x.dtype).name
    if dtype not in _DTYPES:
      return f"input dtype {dtype} (supported: {', '.join(_DTYPES)})"
    for w in jax.tree.leaves(args.weights):
      if np.dtype(w.dtype) != np.dtype(args.x.dtype):
        return f"weights dtype {np.dtype(w.dtype).name} differs from x dtype {dtype}"
    m, k, n = _dims(args)
    if min(m, k, n) == 0:
      return f"empty dimension (M={m}, K={k}, N={n})"
    reason = _activation_reason(args.activation)
    if reason is not None:
      return reason
    config = self.config if self.config is not None else self._get_heuristics_config(args)
    return _config_reason(args, config, 1)

  def _bwd_unsupported_reason(self, args: spec.GluArgs) -> str | None:
    config = self.config if self.config is not None else self._get_heuristics_config(args)
    return self._unsupported_reason(args) or _config_reason(args, self._residual_config(config), 3)

  def _get_heuristics_config(self, args: spec.GluArgs) -> Config:
    m, _, n = _dims(args)
    block_n = next((b for b in (128, 64) if n % b == 0), 64)
    tile_m = 8  # Measured on the H200 at 8192x4096x14336: 2.68 ms, against 3.07 ms with 16.
    if m <= mosaic_kernel.WG_ROWS * mosaic_kernel.NUM_COMPUTE_WGS:
      # One row tile: more, narrower items and a deeper pipeline. Measured on the
      # H200 at 128x4096x14336: 0.146 ms, against 0.389 ms with (128, 4, 128).
      config = Config(block_n=64, num_stages=6, epi_n=64, grid_tile_m=tile_m)
      if _config_reason(args, config, 1) is None:
        return config
    for stages in (4, 3, 2):
      config = Config(
        block_n=block_n, num_stages=stages, epi_n=min(128, block_n), grid_tile_m=tile_m
      )
      if _config_reason(args, config, 1) is None:
        return config
    return Config(block_n=block_n, num_stages=2, epi_n=64, grid_tile_m=tile_m)

  def _get_autotuning_configs(self, args: spec.GluArgs) -> set[Config]:
    configs = {
      Config(block_n=b, num_stages=s, epi_n=e, grid_tile_m=t)
      for b, s, e, t in itertools.product((64, 128), (2, 3, 4, 6), (64, 128), (4, 8, 16))
      if e <= b
    }
    return {c for c in configs if _config_reason(args, c, 1) is None} or {
      self._get_heuristics_config(args)
    }

  def _residual_config(self, config: Config) -> Config:
    """The config of the kernel that also writes both projections (3 outputs)."""
    return dataclasses.replace(config, epi_n=64, num_stages=min(config.num_stages, 3))

  def _run(self, args: spec.GluArgs, config: Config, save_gate_up: bool):
    x = args.x
    batch, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    pad = -m % _ROW_ALIGN
    if pad:
      x2 = jnp.pad(x2, ((0, pad), (0, 0)))
    w_gate, w_up, n_offset = _flat_weights(args)
    kcfg = _kernel_config(x.dtype, config)
    outs = mosaic_kernel.gated_linear_unit(
      x2,
      w_gate,
      w_up,
      up_block_offset=0 if n_offset is None else n_offset // kcfg.block_n,
      n=args.n,
      activation=args.activation,
      config=kcfg,
      num_sms=ragged_mosaic.INTERPRET_NUM_SMS if self.interpret else ragged_mosaic.num_sms(),
      save_gate_up=save_gate_up,
      interpret=plgpu.InterpretGPUParams(detect_races=True) if self.interpret else None,
    )
    outs = outs if save_gate_up else (outs,)
    outs = tuple(o[:m].reshape(*batch, args.n) for o in outs)
    return outs if save_gate_up else outs[0]

  def _fwd_primal(self, args: spec.GluArgs, config: Config) -> jax.Array:
    return self._run(args, config, save_gate_up=False)

  def _fwd(self, args: spec.GluArgs, config: Config):
    out, gate, up = self._run(args, self._residual_config(config), save_gate_up=True)
    return out, (gate, up)

  def _bwd(self, args, config, out, residuals, dout):
    del config, out
    gate, up = residuals
    dtype = args.x.dtype
    g32, u32, d32 = (a.astype(jnp.float32) for a in (gate, up, dout))
    if args.activation is None:
      act, dgate = g32, d32 * u32
    else:
      act, act_vjp = jax.vjp(args.activation, g32)
      (dgate,) = act_vjp(d32 * u32)
    dup = d32 * act

    def projections(x, weights):
      w_gate, w_up = dataclasses.replace(args, x=x, weights=weights).gate_and_up_weights()
      dot = lambda w: jnp.einsum("...k,kn->...n", x, w, precision=args.precision)
      return dot(w_gate), dot(w_up)

    # The matmuls of the gradient as XLA differentiates the two projections
    # (the forward matmuls of this vjp are dead code).
    _, vjp = jax.vjp(projections, args.x, args.weights)
    dx, dweights = vjp((dgate.astype(dtype), dup.astype(dtype)))
    return {"x": dx, "weights": dweights}
