"""The public functions called with their documented defaults, against float64 numpy formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax


def _f64(x) -> np.ndarray:
  return np.asarray(x, np.float64)


def _normal(seed, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.parametrize("impl", ("xla", None))
def test_layer_norm_defaults(impl):
  """epsilon=1e-6, subtract_mean=True, the last axis, scale_offset=0: on rows whose variance
  (1e-6) is of the order of epsilon, so that another epsilon shows."""
  x = _normal(0, (4, 32), 1e-3) + 0.25
  scale, offset = _normal(1, (32,)), _normal(2, (32,))
  out = tokamax.layer_norm(x, scale, offset, implementation=impl)
  xf = _f64(x)
  centred = xf - xf.mean(-1, keepdims=True)
  expected = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-6)
  expected = expected * _f64(scale) + _f64(offset)
  np.testing.assert_allclose(_f64(out), expected, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("impl", ("xla", "chunked_xla", None))
def test_loss_default_reduction_is_the_sum(impl):
  x, w = _normal(0, (6, 8)), _normal(1, (8, 11), 0.5)
  labels = jnp.array([0, 10, 3, 3, 7, 1])
  out = tokamax.linear_softmax_cross_entropy_loss(x, labels, w, implementation=impl)
  logits = _f64(x) @ _f64(w)
  top = logits.max(-1)
  lse = np.log(np.exp(logits - top[:, None]).sum(-1)) + top
  expected = (lse - logits[np.arange(6), np.asarray(labels)]).sum()
  assert out.shape == () and out.dtype == jnp.float32
  np.testing.assert_allclose(float(out), expected, rtol=1e-5)


@pytest.mark.parametrize("impl", ("xla", "xla_chunked", None))
def test_attention_defaults(impl):
  """scale 1/sqrt(H), no causal mask, no window, no soft cap; K/V heads shared by N/K
  consecutive query heads."""
  b, t, s, n, k, h, hv = 2, 5, 7, 4, 2, 8, 3
  q, kk, v = _normal(0, (b, t, n, h)), _normal(1, (b, s, k, h)), _normal(2, (b, s, k, hv))
  out = tokamax.dot_product_attention(q, kk, v, implementation=impl)
  kf = np.repeat(_f64(kk), n // k, axis=2)  # Query head i attends to K/V head i // (N/K).
  vf = np.repeat(_f64(v), n // k, axis=2)
  logits = np.einsum("btnh,bsnh->bnts", _f64(q), kf) / np.sqrt(h)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  expected = np.einsum("bnts,bsnh->btnh", p, vf)
  assert out.shape == (b, t, n, hv)
  np.testing.assert_allclose(_f64(out), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ("xla", None))
def test_gated_linear_unit_default_is_the_bilinear_unit(impl):
  x, w = _normal(0, (3, 6, 8)), _normal(1, (8, 2, 5))
  out = tokamax.gated_linear_unit(x, w, implementation=impl)
  xf, wf = _f64(x), _f64(w)
  expected = (xf @ wf[:, 0]) * (xf @ wf[:, 1])
  assert out.shape == (3, 6, 5) and out.dtype == jnp.float32
  np.testing.assert_allclose(_f64(out), expected, rtol=1e-5, atol=1e-5)
