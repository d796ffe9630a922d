"""Numeric conventions shared by the implementations."""

import jax
import jax.numpy as jnp
import numpy as np


def accumulation_dtype(dtype) -> np.dtype:
  """The dtype for sums and softmax statistics: at least float32, float64 for float64 inputs."""
  return jnp.promote_types(dtype, jnp.float32)


def triton_input_precision(dtype, precision) -> str:
  """Triton's `tl.dot` input precision for a float32 matmul at JAX `precision`.

  `precision=None` follows `jax.default_matmul_precision`, as JAX's own matmuls do.

  Args:
    dtype: The matmul's input dtype (only float32 has a choice).
    precision: None, a `jax.lax.Precision`, or a pair of them (the higher counts).

  Returns:
    "ieee", "tf32x3" or "tf32".
  """
  if np.dtype(dtype) != np.float32:
    return "ieee"  # Unused for 16-bit inputs.
  if isinstance(precision, tuple):
    precision = max((p for p in precision if p is not None), default=None, key=lambda p: p.value)
  if precision is None:
    precision = _configured_precision()
  if precision == jax.lax.Precision.HIGHEST:
    return "ieee"
  if precision == jax.lax.Precision.HIGH:
    return "tf32x3"
  return "tf32"


def _configured_precision() -> jax.lax.Precision:
  value = jax.config.jax_default_matmul_precision
  if value is None:
    return jax.lax.Precision.DEFAULT
  try:
    return jax.lax.Precision(value)
  except ValueError:  # A dot-algorithm preset name, e.g. "F32_F32_F32".
    return (
      jax.lax.Precision.HIGHEST
      if "F32_F32_F32" in str(value).upper()
      else (jax.lax.Precision.DEFAULT)
    )
