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
    columns, held = spec.label_columns(args)
    picked = jnp.take_along_axis(logits, columns[:, None], axis=-1)[:, 0]
    out, _ = spec.loss(args, jax.nn.logsumexp(logits, axis=-1), jnp.where(held, picked, 0.0))
    return out, None
