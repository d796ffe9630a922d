"""Public layer_norm."""

from collections.abc import Sequence
from typing import Literal

from jaxtyping import Array, Float

from tokamax._src.ops.normalization import spec

Implementation = Literal["xla", "triton"]


def layer_norm(
  x: Float[Array, "..."],
  scale: Float[Array, " D"] | None,
  offset: Float[Array, " D"] | None,
  *,
  axis: int = -1,
  epsilon: float = 1e-6,
  scale_offset: float = 0.0,
  subtract_mean: bool = True,
  implementation: Implementation | Sequence | None = None,
) -> Float[Array, "..."]:
  """Layer normalisation (RMS normalisation when `subtract_mean=False`).

  Args:
    x: The input.
    scale: Multiplies the normalised value, shape `(x.shape[axis],)`, or None.
    offset: Added after scaling, shape `(x.shape[axis],)`, or None.
    axis: The axis to normalise over.
    epsilon: Added to the variance.
    scale_offset: Added to `scale` (e.g. 1.0 for zero-centred scales).
    subtract_mean: False gives RMSNorm.
    implementation: A name, an Op, a sequence of them, or None for the best.

  Returns:
    The normalised array, shape and dtype of `x`.
  """
  return spec.SPEC(
    x,
    scale,
    offset,
    axis=axis,
    epsilon=epsilon,
    scale_offset=scale_offset,
    subtract_mean=subtract_mean,
    implementation=implementation,
  )
