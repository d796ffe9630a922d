"""The loss with the full [B, V] logits in memory."""

import dataclasses

import jax
import jax.numpy as jnp

from tokamax._src import numerics
from tokamax._src.ops import op
from tokamax._src.ops.linear_softmax_cross_entropy_loss import chunked_xla, spec


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaLoss(op.Op):
  """One matmul, log-softmax in float32 (or wider), and the label's term."""

  name = "xla"
  spec = spec.SPEC

  def _fwd(self, args, config):
    logits = _matmul(args, args.x, args.weights)
    row_max, total = numerics.row_max_and_sum(logits)
    out, lse = spec.loss(args, row_max + jnp.log(total), spec.picked_logits(args, logits))
    return out, (logits, lse)

  def _bwd(self, args, config, out, residuals, dout):
    # The logits' cotangent in x's dtype feeds both GEMMs (JAX's own derivative multiplies
    # the float32 one: twice the time on the H200).
    logits, lse = residuals
    g = chunked_xla.row_cotangents(args, dout)
    dlogits = chunked_xla.logit_cotangents(args, logits, 0, lse, g)
    return {
      "x": _matmul(args, dlogits, args.weights.T).astype(args.x.dtype),
      "weights": _matmul(args, args.x.T, dlogits).astype(args.weights.dtype),
    }


def _matmul(args: spec.LossArgs, a: jax.Array, b: jax.Array) -> jax.Array:
  """`a @ b` at the call's precision, accumulated in float32 or wider."""
  return jnp.matmul(
    a, b, precision=args.precision, preferred_element_type=numerics.accumulation_dtype(a.dtype)
  )
