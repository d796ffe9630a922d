"""Numeric conventions shared by the implementations."""

import jax.numpy as jnp
import numpy as np


def accumulation_dtype(dtype) -> np.dtype:
  """The dtype for sums and softmax statistics: at least float32, float64 for float64 inputs."""
  return jnp.promote_types(dtype, jnp.float32)
