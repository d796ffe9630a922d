"""gated_linear_unit as one fused Triton matmul; the backward pass in XLA matmuls.

The forward kernel reads each x tile once for both projections and applies the
gate in its epilogue. Under differentiation it also writes the pre-activation
projections; the backward pass forms d(gate), d(up) from them and runs one
XLA matmul for dx and one for the (fused) weight gradient.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from tokamax._src import numerics, triton_call
from tokamax._src.ops import kernel_ops
from tokamax._src.ops.gated_linear_unit import spec
from tokamax._src.ops.gated_linear_unit import triton_glu as kernels

_DTYPES = ("float32", "bfloat16", "float16")


def _activation_name(activation) -> str | None:
  """The kernel's name for `activation`, or None if the kernel lacks it."""
  known = {
    None: "none",
    jax.nn.silu: "silu",
    jax.nn.sigmoid: "sigmoid",
    jax.nn.relu: "relu",
    jax.nn.leaky_relu: "leaky_relu",
    jax.nn.gelu: "gelu_tanh",  # jax.nn.gelu defaults to the tanh approximation.
    jnp.tanh: "tanh",
  }
  try:
    return known.get(activation)
  except TypeError:  # Unhashable callables.
    return None


@dataclasses.dataclass(frozen=True)
class TritonGluConfig:
  """Tile shape of the fused forward kernel (each projection is block_m x block_n;
  the dot is block_m x 2*block_n)."""

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  group_m: int = 8
  num_warps: int = 8
  num_stages: int = 4


def _weights(args: spec.GluArgs) -> tuple[jax.Array, jax.Array, int, int]:
  """Gate and up weight arrays, the weights' row stride and the up offset."""
  k, n = args.x.shape[-1], args.n
  if isinstance(args.weights, tuple):
    return (*args.weights, n, 0)
  fused = args.weights.reshape(k, 2 * n)  # Free: [K, 2, N] is row-major.
  return fused, fused, 2 * n, n


def forward(args: spec.GluArgs, config: TritonGluConfig, save: bool) -> tuple[jax.Array, ...]:
  """Returns out [M, N] and, with `save`, gate and up [M, N] (before activation)."""
  x = args.x.reshape(-1, args.x.shape[-1])
  (m, k), n = x.shape, args.n
  wg, wu, stride, up_offset = _weights(args)
  res_shape = (m, n) if save else (1,)
  tiles = math.ceil(m / config.block_m) * math.ceil(n / config.block_n)
  outs = triton_call.call(
    kernels.glu_fwd,
    x,
    wg,
    wu,
    out_shape=[
      jax.ShapeDtypeStruct((m, n), args.x.dtype),
      jax.ShapeDtypeStruct(res_shape, args.x.dtype),
      jax.ShapeDtypeStruct(res_shape, args.x.dtype),
    ],
    grid=(tiles,),
    M=m,
    K=k,
    N=n,
    W_STRIDE=stride,
    UP_OFFSET=up_offset,
    ACTIVATION=_activation_name(args.activation),
    SAVE=save,
    BLOCK_M=config.block_m,
    BLOCK_N=config.block_n,
    BLOCK_K=config.block_k,
    GROUP_M=config.group_m,
    INPUT_PRECISION=numerics.triton_input_precision(args.x.dtype, args.precision),
    num_warps=config.num_warps,
    num_stages=config.num_stages,
  )
  return tuple(outs) if save else (outs[0],)


def backward(args: spec.GluArgs, gate: jax.Array, up: jax.Array, dout: jax.Array) -> dict:
  """Cotangents of x and the weights from the saved projections."""
  x = args.x.reshape(-1, args.x.shape[-1])
  dout = dout.reshape(gate.shape).astype(jnp.float32)
  gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
  act = args.activation or (lambda g: g)
  activated, act_vjp = jax.vjp(act, gate)
  (dgate,) = act_vjp(dout * up)
  dup = dout * activated
  d = jnp.stack([dgate, dup], axis=1).astype(args.x.dtype)  # [M, 2, N]
  wg, wu = args.gate_and_up_weights()
  w = jnp.stack([wg, wu], axis=1) if isinstance(args.weights, tuple) else args.weights  # [K, 2, N]
  prec = args.precision
  dx = jnp.einsum("mjn,kjn->mk", d, w, precision=prec, preferred_element_type=jnp.float32)
  dw = jnp.einsum("mk,mjn->kjn", x, d, precision=prec, preferred_element_type=jnp.float32)
  if isinstance(args.weights, tuple):
    dweights = (dw[:, 0].astype(wg.dtype), dw[:, 1].astype(wu.dtype))
  else:
    dweights = dw.astype(args.weights.dtype)
  return {"x": dx.astype(args.x.dtype).reshape(args.x.shape), "weights": dweights}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonGatedLinearUnit(kernel_ops.TritonOp):
  """Fused GLU matmul in Triton (gate applied in the epilogue)."""

  name = "triton"
  spec = spec.SPEC
  config_cls = TritonGluConfig

  def _unsupported_reason(self, args: spec.GluArgs) -> str | None:
    dtype = np.dtype(args.x.dtype).name
    if isinstance(args.weights, tuple):
      named = (("weights[0] (gate)", args.weights[0]), ("weights[1] (up)", args.weights[1]))
    else:
      named = (("weights", args.weights),)
    for name, w in named:
      if np.dtype(w.dtype).name != dtype:
        # XLA would promote; the kernel's tl.dot takes one dtype.
        return f"mixed dtypes: {name} is {np.dtype(w.dtype).name}, x is {dtype}"
    if dtype not in _DTYPES:
      return f"dtype {dtype} (supported: {', '.join(_DTYPES)})"
    if _activation_name(args.activation) is None:
      return (
        f"activation {args.activation!r} "
        "(supported: None, silu/swish, sigmoid, relu, leaky_relu, gelu, tanh)"
      )
    if args.x.size == 0 or args.n == 0:
      return "empty input"
    if args.x.shape[-1] * 2 * args.n >= 2**31:
      return "weights of 2**31 elements or more (32-bit weight offsets)"
    return None

  def _get_heuristics_config(self, args: spec.GluArgs) -> TritonGluConfig:
    m = spec.num_rows(args)
    wide = np.dtype(args.x.dtype).itemsize == 4
    block_m = 128 if m >= 128 else 64
    # One 128 x (2 x 128) dot per K step: wgmma m64n256 on Hopper, no spills;
    # three stages fit the shared memory of sm_80 and sm_90.
    return TritonGluConfig(
      block_m=block_m,
      block_n=128 if args.n >= 128 else 64,
      block_k=32 if wide else 64,
      group_m=8,
      num_warps=8 if block_m == 128 else 4,
      num_stages=3,
    )

  def _get_autotuning_configs(self, args: spec.GluArgs) -> set[TritonGluConfig]:
    configs = {self._get_heuristics_config(args)}
    itemsize = np.dtype(args.x.dtype).itemsize
    for bm, bn in ((64, 64), (64, 128), (128, 64), (128, 128)):
      for bk in (32, 64):
        for stages in (2, 3, 4):
          if not triton_call.pipeline_fits((bm * bk + 2 * bk * bn) * itemsize, stages):
            continue
          warps = 8 if bm * bn >= 128 * 128 else 4
          configs.add(TritonGluConfig(bm, bn, bk, group_m=8, num_warps=warps, num_stages=stages))
    return configs

  def _fwd(self, args: spec.GluArgs, config: TritonGluConfig):
    out, gate, up = forward(args, config, save=True)
    return out.reshape(*args.x.shape[:-1], args.n), (gate, up)

  def _fwd_primal(self, args: spec.GluArgs, config: TritonGluConfig) -> jax.Array:
    (out,) = forward(args, config, save=False)
    return out.reshape(*args.x.shape[:-1], args.n)

  def _bwd(self, args, config, out, residuals, dout) -> dict:
    del config, out
    gate, up = residuals
    return backward(args, gate, up, dout)
