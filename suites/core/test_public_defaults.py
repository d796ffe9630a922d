"""The public functions called with their documented defaults, against the harness's
high-precision references given those defaults explicitly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax_harness import references


def _normal(seed, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.parametrize("impl", ("xla", None))
def test_layer_norm_defaults(impl):
  """epsilon=1e-6, subtract_mean=True, the last axis, scale_offset=0: on rows whose variance
  (1e-6) is of the order of epsilon, so that another epsilon shows, of a 3-D input (whose
  last axis is not axis 1)."""
  x = _normal(0, (2, 4, 32), 1e-3) + 0.25
  scale, offset = _normal(1, (32,)), _normal(2, (32,))
  out = tokamax.layer_norm(x, scale, offset, implementation=impl)
  expected = references.high_precision(references.layer_norm)(
    x, scale, offset, axis=-1, epsilon=1e-6, scale_offset=0.0, subtract_mean=True
  )
  np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("impl", ("xla", "chunked_xla", None))
def test_loss_default_reduction_is_the_sum(impl):
  x, w = _normal(0, (6, 8)), _normal(1, (8, 11), 0.5)
  labels = jnp.array([0, 10, 3, 3, 7, 1])
  out = tokamax.linear_softmax_cross_entropy_loss(x, labels, w, implementation=impl)
  expected = references.high_precision(references.linear_softmax_cross_entropy_loss)(
    x, labels, w, reduction="sum"
  )
  assert out.shape == () and out.dtype == jnp.float32
  np.testing.assert_allclose(float(out), expected, rtol=1e-5)


@pytest.mark.parametrize("impl", ("xla", "xla_chunked", None))
def test_attention_defaults(impl):
  """scale 1/sqrt(H), no causal mask, no window, no soft cap; K/V heads shared by N/K
  consecutive query heads."""
  b, t, s, n, k, h, hv = 2, 5, 7, 4, 2, 8, 3
  q, kk, v = _normal(0, (b, t, n, h)), _normal(1, (b, s, k, h)), _normal(2, (b, s, k, hv))
  out = tokamax.dot_product_attention(q, kk, v, implementation=impl)
  expected = references.high_precision(references.attention)(
    q, kk, v, scale=1.0 / np.sqrt(h), is_causal=False, local_window_size=None
  )
  assert out.shape == (b, t, n, hv)
  np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ("xla", None))
def test_gated_linear_unit_default_is_the_bilinear_unit(impl):
  x, w = _normal(0, (3, 6, 8)), _normal(1, (8, 2, 5))
  out = tokamax.gated_linear_unit(x, w, implementation=impl)
  expected = references.high_precision(references.gated_linear_unit)(x, w, activation=None)
  assert out.shape == (3, 6, 5) and out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=1e-5, atol=1e-5)
