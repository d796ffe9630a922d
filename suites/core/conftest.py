"""Shared pieces of the library-core tests (issue 2): inputs and float64 comparisons."""

import zlib

import jax
import numpy as np
import pytest

from harness import references

# Error allowed for a float32 computation against the float64 reference: relative
# to the reference's norm, and elementwise relative to its largest magnitude.
F32_NORM_RTOL = 2e-5
F32_MAX_RTOL = 2e-4
# Absolute floor for quantities that are zero in exact arithmetic (e.g. the gradient
# of a bias that is constant along the softmax axis), for O(1) random inputs.
F32_ATOL = 1e-5


def assert_matches(
  actual, expected, *, norm_rtol=F32_NORM_RTOL, max_rtol=F32_MAX_RTOL, atol=F32_ATOL, what=""
):
  """Fails with a readable summary when `actual` strays from the float64 `expected`."""
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
  bad = ~np.isfinite(actual)
  assert not bad.any(), f"{what}: {bad.sum()} non-finite values at {np.argwhere(bad)[:5].tolist()}"
  err = np.abs(actual - expected)
  scale = max(np.abs(expected).max(), 1e-30)
  norm = max(np.linalg.norm(err) - atol * np.sqrt(err.size), 0.0) / max(
    np.linalg.norm(expected), 1e-30
  )
  worst = np.unravel_index(np.argmax(err), err.shape) if err.size else ()
  assert norm <= norm_rtol and err.max(initial=0) <= max_rtol * scale + atol, (
    f"{what}: relative norm error {norm:.3g} (limit {norm_rtol}), max error {err.max(initial=0):.3g} "
    f"(limit {max_rtol * scale + atol:.3g}) at {tuple(int(i) for i in worst)}"
  )


class Inputs:
  """Random float32 inputs from a per-test key."""

  def __init__(self, seed: int):
    self.key = jax.random.key(seed)

  def normal(self, shape, scale=1.0):
    self.key, sub = jax.random.split(self.key)
    return scale * jax.random.normal(sub, shape, np.float32)

  def bools(self, shape, p=0.7):
    self.key, sub = jax.random.split(self.key)
    return jax.random.bernoulli(sub, p, shape)

  def ints(self, shape, low, high):
    self.key, sub = jax.random.split(self.key)
    return jax.random.randint(sub, shape, low, high)


@pytest.fixture
def inputs(request) -> Inputs:
  return Inputs(zlib.crc32(request.node.nodeid.encode()))


__all__ = ["Inputs", "assert_matches", "references"]
