"""Shared pieces of the library-core tests (issue 2): inputs and float64 comparisons."""

import jax
import numpy as np
import pytest

from tokamax_harness import compare, plugin, references, tolerance

# A float32 computation against the float64 reference, for O(1) random inputs: the
# harness policy's float32 row widened for unknown reduction lengths (and for
# quantities that are zero in exact arithmetic, e.g. the gradient of a bias that
# is constant along the softmax axis), with every element inside the bound.
F32_VS_F64 = tolerance.Tolerance(atol=1e-5, rtol=2e-4, fraction=1.0, outlier_factor=1.0)


def assert_matches(actual, expected, *, tol=F32_VS_F64, what="output"):
  """Fails with the harness's report when `actual` strays from the float64 `expected`."""
  compare.assert_close(actual, expected, tol=tol, name=what)


class Inputs:
  """Random float32 inputs from a per-test key."""

  def __init__(self, key: jax.Array):
    self.key = key

  def normal(self, shape, scale=1.0):
    self.key, sub = jax.random.split(self.key)
    return scale * jax.random.normal(sub, shape, np.float32)

  def bools(self, shape, p=0.7):
    self.key, sub = jax.random.split(self.key)
    return jax.random.bernoulli(sub, p, shape)

  def ints(self, shape, low, high):
    self.key, sub = jax.random.split(self.key)
    return jax.random.randint(sub, shape, low, high)


@pytest.fixture(autouse=True)
def _float32_matmuls_at_full_precision():
  """These tests check the ops' semantics against float64, so float32 matmuls run in float32.

  Accelerators lower float32 matmuls at DEFAULT precision to TF32 (GPU) or bfloat16 passes
  (TPU); the hardware matrices (suites/test_matrix.py) test that default with the harness's
  accelerator tolerances.
  """
  if jax.default_backend() == "cpu":
    yield
    return
  with jax.default_matmul_precision("highest"):
    yield


@pytest.fixture
def inputs(request) -> Inputs:
  return Inputs(plugin.key_for(request.node.nodeid))


__all__ = ["Inputs", "assert_matches", "references"]
