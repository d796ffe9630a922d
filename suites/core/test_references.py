"""The float64 references themselves."""

import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_harness import references


@pytest.mark.parametrize("dtype", (np.float16, jnp.bfloat16, np.float32))
def test_high_precision_upcasts_every_float_dtype(dtype):
  out = references.high_precision(lambda a: a * 3)(jnp.ones((2,), dtype))
  assert out.dtype == references.high_precision_dtype()


def test_reference_attention_matches_hand_computed_softmax():
  q = np.array([[[[1.0, 0.0]]]])  # [B=1, T=1, N=1, H=2]
  k = np.array([[[[1.0, 0.0]], [[0.0, 1.0]]]])  # S=2
  v = np.array([[[[2.0]], [[4.0]]]])
  out = references.high_precision(references.attention)(q, k, v, scale=1.0)
  w = np.exp([1.0, 0.0]) / np.exp([1.0, 0.0]).sum()
  np.testing.assert_allclose(out[0, 0, 0, 0], w @ [2.0, 4.0], rtol=1e-12)
