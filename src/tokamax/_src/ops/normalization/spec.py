"""The layer_norm op: LayerNorm and RMSNorm over one axis."""

import jax
import numpy as np
from jaxtyping import Array, Float

from tokamax._src import arguments, validation
from tokamax._src.ops import op
from tokamax._src.ops import partitioning as partitioning_lib


@arguments.op_arguments
class NormArgs:
  """Canonical arguments of `layer_norm`; `axis` is non-negative."""

  x: Float[Array, "..."]
  scale: Float[Array, " D"] | None
  offset: Float[Array, " D"] | None
  axis: int = arguments.static()
  epsilon: float = arguments.static()
  scale_offset: float = arguments.static()
  subtract_mean: bool = arguments.static()


def canonicalize(
  x, scale, offset, *, axis=-1, epsilon=1e-6, scale_offset=0.0, subtract_mean=True
) -> NormArgs:
  x = validation.floating("x", x)
  if not isinstance(axis, int | np.integer) or not -x.ndim <= axis < x.ndim:
    raise ValueError(f"`axis` must be an int in [{-x.ndim}, {x.ndim}), got {axis!r}.")
  axis = int(axis) % x.ndim
  for name, value in (("scale", scale), ("offset", offset)):
    if value is not None:
      value = validation.floating(name, value)
      if value.shape != (x.shape[axis],):
        raise ValueError(
          f"`{name}` must have shape ({x.shape[axis]},) to match `x.shape[{axis}]`, "
          f"got {value.shape}."
        )
  epsilon = validation.finite("epsilon", epsilon)
  if not epsilon >= 0:
    raise ValueError(f"`epsilon` must be >= 0, got {epsilon!r}.")
  return NormArgs(
    x=x,
    scale=None if scale is None else validation.floating("scale", scale),
    offset=None if offset is None else validation.floating("offset", offset),
    axis=axis,
    epsilon=epsilon,
    scale_offset=validation.finite("scale_offset", scale_offset),
    subtract_mean=validation.flag("subtract_mean", subtract_mean),
  )


def cost(args: NormArgs) -> op.Cost:
  size = args.x.size
  itemsize = np.dtype(args.x.dtype).itemsize
  return op.Cost(flops=8.0 * size, bytes=2.0 * size * itemsize)


def partitioning(args: NormArgs) -> partitioning_lib.Rule:
  """Every axis but the normalized one splits (rows)."""
  rows = tuple(None if i == args.axis else f"r{i}" for i in range(args.x.ndim))
  x = tuple("d" if label is None else label for label in rows)
  return partitioning_lib.Rule(
    inputs={"x": x, "scale": ("d",), "offset": ("d",)},
    output=x,
    split=frozenset(label for label in rows if label),
  )


SPEC = op.OpSpec(
  name="layer_norm",
  canonicalize=canonicalize,
  implementations={
    "xla": "tokamax._src.ops.normalization.xla:XlaLayerNorm",
    "triton": "tokamax._src.ops.normalization.triton:TritonLayerNorm",
  },
  preference={"gpu": ("triton",)},
  cost=cost,
  partitioning=partitioning,
)


def reference(args: NormArgs) -> jax.Array:
  """Plain jnp LayerNorm/RMSNorm with statistics in at least float32."""
  xf = args.x.astype(stat_dtype(args))
  if args.subtract_mean:
    xf = xf - xf.mean(axis=args.axis, keepdims=True)
  var = (xf * xf).mean(axis=args.axis, keepdims=True)
  return affine(args, xf * jax.lax.rsqrt(var + args.epsilon))


def stat_dtype(args: NormArgs) -> np.dtype:
  """The dtype of the statistics: x's, at least float32."""
  return np.promote_types(args.x.dtype, np.float32)


def _along_axis(args: NormArgs, v: jax.Array) -> jax.Array:
  shape = [1] * args.x.ndim
  shape[args.axis] = args.x.shape[args.axis]
  return v.astype(stat_dtype(args)).reshape(shape)


def effective_scale(args: NormArgs) -> jax.Array | float:
  """What the normalized x is multiplied by: scale + scale_offset, broadcast along the axis."""
  if args.scale is None:
    return 1.0 + args.scale_offset
  return _along_axis(args, args.scale) + args.scale_offset


def affine(args: NormArgs, normalized: jax.Array) -> jax.Array:
  """The output from the normalized x (in the statistics' dtype): scaled, offset, cast."""
  y = normalized * effective_scale(args)
  if args.offset is not None:
    y = y + _along_axis(args, args.offset)
  return y.astype(args.x.dtype)
