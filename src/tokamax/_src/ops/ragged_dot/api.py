"""Public ragged_dot and ragged_dot_general."""

from collections.abc import Sequence
from typing import Literal

import jax
from jaxtyping import Array, Float, Int

from tokamax._src.ops.ragged_dot import spec

Implementation = Literal["xla", "triton", "mosaic", "mosaic_tpu"]
GroupSizes = Int[Array, " G"] | spec.RaggedDotGroupSizes


def ragged_dot(
  lhs: Float[Array, "M K"],
  rhs: Float[Array, "G K N"],
  group_sizes: GroupSizes,
  precision: jax.lax.PrecisionLike = None,
  preferred_element_type: jax.typing.DTypeLike | None = None,
  group_offset: Int[Array, "1"] | None = None,
  *,
  implementation: Implementation | Sequence | None = None,
) -> Float[Array, "M N"]:
  """Grouped matmul: the rows of group g of `lhs` times `rhs[g]`, as `jax.lax.ragged_dot`.

  Args:
    lhs: [M, K], rows sorted by group.
    rhs: [G, K, N].
    group_sizes: Rows per group [G], or `RaggedDotGroupSizes`.
    precision: Matmul precision.
    preferred_element_type: Output dtype; defaults to the input dtype.
    group_offset: [1]: the first group of `group_sizes` that `rhs` holds.
    implementation: A name, an Op, a sequence of them, or None for the best.
      "mosaic" is the Mosaic GPU kernel on a GPU and the Mosaic TPU one
      ("mosaic_tpu") on a TPU.

  Returns:
    [M, N]; rows past sum(group_sizes) are zero.
  """
  return ragged_dot_general(
    lhs,
    rhs,
    group_sizes,
    spec.dimension_numbers(spec.DEFAULT),
    precision=precision,
    preferred_element_type=preferred_element_type,
    group_offset=group_offset,
    implementation=implementation,
  )


def ragged_dot_general(
  lhs: Float[Array, "M K"],
  rhs: Float[Array, "..."],
  group_sizes: GroupSizes,
  ragged_dot_dimension_numbers: jax.lax.RaggedDotDimensionNumbers,
  precision: jax.lax.PrecisionLike = None,
  preferred_element_type: jax.typing.DTypeLike | None = None,
  group_offset: Int[Array, "1"] | None = None,
  *,
  implementation: Implementation | Sequence | None = None,
) -> Float[Array, "..."]:
  """Ragged dot with explicit dimension numbers, as `jax.lax.ragged_dot_general`.

  Args:
    lhs: [M, K].
    rhs: [G, K, N], [G, N, K] (transposed) or [M, N] (ragged contracting).
    group_sizes: Rows per group [G], or `RaggedDotGroupSizes`.
    ragged_dot_dimension_numbers: One of the three layouts in
      `tokamax._src.ops.ragged_dot.spec.LAYOUTS`.
    precision: Matmul precision.
    preferred_element_type: Output dtype; defaults to the input dtype.
    group_offset: [1]: the first group of `group_sizes` that is computed.
    implementation: A name, an Op, a sequence of them, or None for the best.

  Returns:
    [M, N], or [G, K, N] for a ragged contracting dimension.
  """
  return spec.SPEC(
    lhs,
    rhs,
    group_sizes,
    ragged_dot_dimension_numbers,
    precision=precision,
    preferred_element_type=preferred_element_type,
    group_offset=group_offset,
    implementation=implementation,
  )
