"""Public gated_linear_unit."""

from collections.abc import Callable, Sequence
from typing import Literal

import jax
from jaxtyping import Array, Float

from tokamax._src.ops.gated_linear_unit import spec

Implementation = Literal["xla", "triton", "mosaic"]


def gated_linear_unit(
  x: Float[Array, "*B M K"],
  weights: Float[Array, "K 2 N"] | tuple[Float[Array, "K N"], Float[Array, "K N"]],
  *,
  activation: Callable[[jax.Array], jax.Array] | None = None,
  precision: jax.lax.PrecisionLike = None,
  implementation: Implementation | Sequence | None = None,
) -> Float[Array, "*B M N"]:
  """Gated linear unit, `activation(x @ w_gate) * (x @ w_up)`.

  Args:
    x: The input [*B, M, K].
    weights: Fused [K, 2, N] (gate first) or a pair (w_gate [K, N], w_up [K, N]).
    activation: Applied to the gate projection; None is the bilinear unit.
    precision: Matmul precision.
    implementation: A name, an Op, a sequence of them, or None for the best.

  Returns:
    The gated projection [*B, M, N] in the dtype of `x`.
  """
  return spec.SPEC(
    x, weights, activation=activation, precision=precision, implementation=implementation
  )
