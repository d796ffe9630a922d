"""Public linear_softmax_cross_entropy_loss."""

from collections.abc import Sequence
from typing import Literal

import jax
from jaxtyping import Array, Float, Int

from tokamax._src.ops.linear_softmax_cross_entropy_loss import spec

Implementation = Literal["xla", "chunked_xla", "mosaic", "mosaic_tpu"]


def linear_softmax_cross_entropy_loss(
  x: Float[Array, "B H"],
  labels: Int[Array, " B"],
  weights: Float[Array, "H V"],
  *,
  reduction: Literal["sum", "mean", "none"] = "sum",
  precision: jax.lax.PrecisionLike = None,
  implementation: Implementation | Sequence | None = None,
) -> Float[Array, "..."]:
  """Cross entropy of softmax(x @ weights) against integer labels.

  Args:
    x: Features [B, H].
    labels: Class ids [B] in [0, V). Concrete ones outside raise an error; traced ones
      outside give their rows a NaN loss (and NaN gradients).
    weights: Projection [H, V].
    reduction: "sum", "mean" or "none" (per-row losses [B]).
    precision: Matmul precision.
    implementation: A name, an Op, a sequence of them, or None for the best.
      "mosaic" is the Mosaic GPU kernel, "mosaic_tpu" the Mosaic TPU one.

  Returns:
    A float32 scalar, or [B] for reduction "none".
  """
  return spec.SPEC(
    x, labels, weights, reduction=reduction, precision=precision, implementation=implementation
  )
