"""layer_norm in plain XLA."""

import dataclasses

import jax
import jax.numpy as jnp

from tokamax._src.ops import op
from tokamax._src.ops.normalization import spec


def _one_pass(args: spec.NormArgs, center: jax.Array | float) -> jax.Array:
  """`spec.reference` with the variance as E[x^2] - E[x]^2 of x - `center` (a constant)."""
  xf = args.x.astype(jnp.promote_types(args.x.dtype, jnp.float32)) - center
  square = (xf * xf).mean(axis=args.axis, keepdims=True)
  if args.subtract_mean:
    mean = xf.mean(axis=args.axis, keepdims=True)
    xf, square = xf - mean, square - mean * mean
  return spec.reference(dataclasses.replace(args, x=xf, subtract_mean=False), variance=square)


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaLayerNorm(op.Op):
  """LayerNorm/RMSNorm as jnp operations; XLA fuses them."""

  name = "xla"
  spec = spec.SPEC

  def _fwd(self, args, config):
    return spec.reference(args), None

  def _bwd(self, args, config, out, residuals, dout):
    # JAX's derivative of the one-pass statistics fuses into fewer kernels than that of the
    # two-pass ones (LayerNorm 16384x4096 forward+backward 0.26 against 0.55 ms on the H200).
    # Centring x by its mean first keeps E[x^2] - E[x]^2 from cancelling.
    center = 0.0
    if args.subtract_mean:
      center = args.x.astype(jnp.promote_types(args.x.dtype, jnp.float32)).mean(
        axis=args.axis, keepdims=True
      )

    def normalized(x, scale, offset):
      record = dataclasses.replace(args, x=x, scale=scale, offset=offset)
      return _one_pass(record, center).astype(args.x.dtype)

    _, vjp = jax.vjp(normalized, args.x, args.scale, args.offset)
    dx, dscale, doffset = vjp(dout)
    return {"x": dx, "scale": dscale, "offset": doffset}
