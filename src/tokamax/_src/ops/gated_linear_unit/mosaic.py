"""gated_linear_unit with a fused Pallas Mosaic GPU kernel for Hopper (sm_90).

The forward pass is one kernel (`mosaic_kernel`): both projections from one
read of x, the gate applied in the epilogue. Under differentiation the same
kernel also writes the two factors of the projections' cotangents. The
backward pass multiplies them by the output cotangent (one fusion, giving the
[M, 2, N] cotangent of both projections) and, for fused [K, 2, N] weights,
runs two matmuls over the fused 2N columns: dx = d @ W^T and dW = x^T @ d,
either in XLA or with the Mosaic ragged_dot kernels (one group).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from tokamax._src import jaxprs
from tokamax._src.ops import kernel_ops
from tokamax._src.ops import mosaic_gemm as gemm
from tokamax._src.ops.gated_linear_unit import mosaic_kernel, spec
from tokamax._src.ops.ragged_dot import api as ragged_api
from tokamax._src.ops.ragged_dot import mosaic as ragged_mosaic
from tokamax._src.ops.ragged_dot import spec as ragged_spec

_DTYPES = ("bfloat16", "float16")
_ROW_ALIGN = gemm.ROW_ALIGN
BACKWARDS = ("xla", "mosaic")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicGluConfig:
  """Tiling of the fused kernel.

  Attributes:
    block_n: Columns of each projection per work item.
    num_stages: Shared-memory stages of the load pipeline.
    epi_n: Output columns per epilogue store.
    grid_tile_m: Row tiles visited together before moving along N.
    cluster: CTAs per cluster: 2 shares each x tile between two column tiles
      through TMA multicast.
  """

  block_n: int = 128
  num_stages: int = 4
  epi_n: int = 128
  grid_tile_m: int = 16
  cluster: int = 1


def _kernel_config(x_dtype, config: MosaicGluConfig) -> mosaic_kernel.MosaicGluKernelConfig:
  return mosaic_kernel.MosaicGluKernelConfig(
    block_n=config.block_n,
    block_k=gemm.swizzle_elems(x_dtype),
    num_stages=config.num_stages,
    epi_n=config.epi_n,
    grid_tile_m=config.grid_tile_m,
    cluster=config.cluster,
  )


def _dims(args: spec.GluArgs) -> tuple[int, int, int]:
  return spec.num_rows(args), args.x.shape[-1], args.n


def _config_reason(args: spec.GluArgs, config: MosaicGluConfig, save_residuals: bool) -> str | None:
  m, k, n = _dims(args)
  return mosaic_kernel.config_reason(
    _kernel_config(args.x.dtype, config), m, k, n, np.dtype(args.x.dtype).itemsize, save_residuals
  )


def _primitives(jaxpr) -> set:
  """Every primitive of a jaxpr, nested jaxprs included."""
  return {eqn.primitive for eqn in jaxprs.equations(jaxpr)}


def _activation_reason(activation, derivative: bool = False) -> str | None:
  """Why the kernel cannot apply `activation` (and its derivative) in its epilogue, or None."""
  try:
    hash(activation)
  except TypeError:  # An unhashable callable: traced on every call instead of cached.
    return _activation_reason_uncached(activation, derivative)
  return _activation_reason_cached(activation, derivative)


def _activation_reason_uncached(activation, derivative: bool) -> str | None:
  if activation is None:
    return None
  from jax._src.pallas.mosaic_gpu import core as gpu_core
  from jax._src.pallas.mosaic_gpu import lowering

  name = getattr(activation, "__name__", None) or repr(activation)
  what = f"the derivative of activation {name}" if derivative else f"activation {name}"
  fn = activation
  if derivative:
    fn = lambda g: mosaic_kernel.activation_and_derivative(activation, g, g)
  try:
    jaxpr = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((64, 64), jnp.float32))
  except Exception as e:
    return f"{what} cannot be traced ({e})"
  rules = lowering.mosaic_lowering_rules[gpu_core.WGxWG_SEMANTICS]
  inlined = mosaic_kernel.INLINED_PRIMITIVES
  used = _primitives(jaxpr.jaxpr)
  missing = sorted(p.name for p in used if p not in rules and p not in inlined)
  if missing:
    return f"{what} uses {', '.join(missing)}, which Mosaic GPU cannot lower"
  return None


_activation_reason_cached = functools.lru_cache(maxsize=64)(_activation_reason_uncached)


def _flat_weights(args: spec.GluArgs):
  """(w_gate ref, w_up ref, up_block_offset in units of block_n) for the kernel."""
  if isinstance(args.weights, tuple):
    return args.weights[0], args.weights[1], None
  k, _, n = args.weights.shape
  fused = args.weights.reshape(k, 2 * n)
  return fused, fused, n


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicGatedLinearUnit(kernel_ops.MosaicGpuOp):
  """Fused gated linear unit in Pallas Mosaic GPU (Hopper).

  Attributes:
    backward: Where the backward matmuls of fused weights run: "xla", "mosaic"
      (the ragged_dot kernels with one group), a pair of them for (dx, dW),
      or None: XLA for both (measured faster on the H200).
  """

  name = "mosaic"
  spec = spec.SPEC
  config_cls = MosaicGluConfig
  tuned_on_forward = True  # The VJP's forward runs `_residual_config`.
  backward: str | tuple[str, str] | None = None

  def __post_init__(self):
    choice = self.backward
    pair = choice if isinstance(choice, tuple) and len(choice) == 2 else (choice, choice)
    if choice is not None and not set(pair) <= set(BACKWARDS):
      raise ValueError(
        f"backward must be one of {BACKWARDS}, a pair of them or None, got {choice!r}"
      )

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
    return _config_reason(args, config, False)

  def _bwd_unsupported_reason(self, args: spec.GluArgs) -> str | None:
    config = self.config if self.config is not None else self._get_heuristics_config(args)
    return (
      self._unsupported_reason(args)
      or _activation_reason(args.activation, derivative=True)
      or _config_reason(args, self._residual_config(args, config), True)
    )

  def _get_heuristics_config(self, args: spec.GluArgs) -> MosaicGluConfig:
    m, _, n = _dims(args)
    block_n = next((b for b in (128, 64) if n % b == 0), 64)
    tile_m = 8  # Faster than 16 at large shapes (docs/perf_decisions.md, Gated linear unit).
    if m <= 4 * gemm.WG_ROWS * gemm.NUM_COMPUTE_WGS:
      # Few row tiles: more, narrower items and a deeper pipeline keep the SMs busy.
      config = MosaicGluConfig(block_n=64, num_stages=6, epi_n=64, grid_tile_m=tile_m)
      if _config_reason(args, config, False) is None:
        return config
    for stages in (4, 3, 2):
      config = MosaicGluConfig(
        block_n=block_n, num_stages=stages, epi_n=min(128, block_n), grid_tile_m=tile_m
      )
      if _config_reason(args, config, False) is None:
        return config
    return MosaicGluConfig(block_n=block_n, num_stages=2, epi_n=64, grid_tile_m=tile_m)

  def _get_autotuning_configs(self, args: spec.GluArgs) -> set[MosaicGluConfig]:
    configs = {
      MosaicGluConfig(block_n=b, num_stages=s, epi_n=e, grid_tile_m=t, cluster=c)
      for b, s, e, t, c in itertools.product((64, 128), (2, 3, 4, 6), (64, 128), (4, 8, 16), (1, 2))
      if e <= b
    }
    return {c for c in configs if _config_reason(args, c, False) is None} or {
      self._get_heuristics_config(args)
    }

  def _residual_config(self, args: spec.GluArgs, config: MosaicGluConfig) -> MosaicGluConfig:
    """The config of the kernel that also writes the residuals.

    Its epilogue rings two 64-column buffers per warpgroup (the output and two
    residual factors per column chunk): as much shared memory as one 128-column
    buffer, so that the forward pass keeps its pipeline depth.
    """
    narrow = dataclasses.replace(config, epi_n=min(config.epi_n, 64))
    for stages in range(config.num_stages, 1, -1):
      candidate = dataclasses.replace(narrow, num_stages=stages)
      if _config_reason(args, candidate, True) is None:
        return candidate
    return dataclasses.replace(narrow, num_stages=2)

  def _backward(self) -> tuple[str, str]:
    """Where dx and dW run (fused weights)."""
    if self.backward is not None:
      return self.backward if isinstance(self.backward, tuple) else (self.backward,) * 2
    # XLA's matmuls beat the one-group ragged_dot kernels for dx and dW on the
    # H200 (docs/perf_decisions.md, Gated linear unit).
    return ("xla", "xla")

  def _run(self, args: spec.GluArgs, config: MosaicGluConfig, save_residuals: bool):
    """The output [*B, N], and with `save_residuals` also the residuals [M, 2N]."""
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
      num_sms=gemm.num_sms(self.interpret),
      save_residuals=save_residuals,
      interpret=self.interpret_params,
    )
    out, residuals = outs if save_residuals else (outs, None)
    out = out[:m].reshape(*batch, args.n)
    return (out, residuals[:m]) if save_residuals else out

  def _fwd_primal(self, args: spec.GluArgs, config: MosaicGluConfig) -> jax.Array:
    return self._run(args, config, save_residuals=False)

  def _fwd(self, args: spec.GluArgs, config: MosaicGluConfig):
    return self._run(args, self._residual_config(args, config), save_residuals=True)

  def _bwd(self, args, config, out, residuals, dout):
    del config, out
    x = args.x.reshape(-1, args.x.shape[-1])
    m, n = x.shape[0], args.n
    # The cotangents of both projections, [M, 2, N]: one elementwise fusion.
    d = _projection_cotangents(dout, residuals, x.dtype)
    if isinstance(args.weights, tuple):
      dx, dweights = _separate_weight_matmuls(args, x, d)
    else:
      dx_how, dw_how = self._backward()
      d2 = d.reshape(m, 2 * n)
      w2 = args.weights.reshape(-1, 2 * n)
      dx = dx_matmul(d2, w2, dx_how, args.precision, self.interpret)
      dweights = dw_matmul(x, d2, dw_how, args.precision, self.interpret)
      dweights = dweights.reshape(args.weights.shape)
    return {"x": dx.reshape(args.x.shape), "weights": dweights}


def _projection_cotangents(dout: jax.Array, residuals: jax.Array, dtype) -> jax.Array:
  """[M, 2, N]: the output cotangent [.., N] times both residual factors [M, 2N]."""
  m = residuals.shape[0]
  factors = residuals.reshape(m, 2, -1).astype(jnp.float32)
  return (dout.reshape(m, 1, -1).astype(jnp.float32) * factors).astype(dtype)


def _ragged(lhs, rhs, layout: str, interpret: bool) -> jax.Array:
  """One-group ragged_dot in the Mosaic kernels (XLA where they cannot)."""
  sizes = jnp.array([lhs.shape[0]], jnp.int32)
  impl = [ragged_mosaic.MosaicRaggedDot(interpret=interpret), "xla"]
  dims = ragged_spec.dimension_numbers(layout)
  return ragged_api.ragged_dot_general(lhs, rhs, sizes, dims, implementation=impl)


def dx_matmul(d2: jax.Array, w2: jax.Array, how: str, precision=None, interpret=False):
  """dx [M, K] = d2 [M, 2N] @ w2 [K, 2N]^T, in "xla" or "mosaic"."""
  if how == "mosaic":
    return _ragged(d2, w2[None], ragged_spec.RHS_TRANSPOSED, interpret)
  return jnp.einsum("mc,kc->mk", d2, w2, precision=precision)


def dw_matmul(x: jax.Array, d2: jax.Array, how: str, precision=None, interpret=False):
  """dW [K, 2N] = x [M, K]^T @ d2 [M, 2N], in "xla" or "mosaic"."""
  if how == "mosaic":
    return _ragged(x, d2, ragged_spec.RAGGED_CONTRACTING, interpret)[0]
  return jnp.einsum("mk,mc->kc", x, d2, precision=precision)


def _separate_weight_matmuls(args: spec.GluArgs, x: jax.Array, d: jax.Array):
  """dx and (dw_gate, dw_up) of a pair of weights: four XLA matmuls."""
  prec = args.precision
  dx = sum(
    jnp.einsum("mn,kn->mk", d[:, j], w, precision=prec, preferred_element_type=jnp.float32)
    for j, w in enumerate(args.weights)
  )
  dws = tuple(jnp.einsum("mk,mn->kn", x, d[:, j], precision=prec) for j in range(2))
  return dx.astype(x.dtype), dws
