"""The loss with the full [B, V] logits in memory."""

import dataclasses

import jax
import jax.numpy as jnp

from tokamax._src import numerics
from tokamax._src.ops import op
from tokamax._src.ops.linear_softmax_cross_entropy_loss import spec


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaLoss(op.Op):
  """One matmul, log-softmax in float32 (or wider), and the label's term."""

  name = "xla"
  spec = spec.SPEC

  def _fwd(self, args, config):
    logits = jnp.matmul(
      args.x,
      args.weights,
      precision=args.precision,
      preferred_element_type=numerics.accumulation_dtype(args.x.dtype),
    )
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, args.labels[:, None], axis=-1)[:, 0]
    return spec.reduce(args, lse - picked), None
