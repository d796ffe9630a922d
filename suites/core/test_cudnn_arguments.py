"""cuDNN attention's call of `jax.nn.dot_product_attention`, with XLA standing in for cuDNN
(which runs on NVIDIA GPUs only): every feature of the public call must reach jax.nn as the
same attention, checked against the harness's high-precision reference. The GPU matrix runs
cuDNN itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax._src.ops.attention import cudnn, spec
from tokamax_harness import references

B, T, S, N, K, H = 2, 6, 8, 4, 2, 8


@pytest.fixture
def calls(monkeypatch):
  """jax.nn's XLA attention in place of cuDNN; the keyword arguments of each call."""
  real = jax.nn.dot_product_attention
  seen = []

  def stand_in(*args, implementation=None, **kwargs):
    assert implementation == "cudnn", implementation
    seen.append(kwargs)
    return real(*args, implementation="xla", **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", stand_in)
  return seen


def _normal(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _mask():
  mask = np.random.default_rng(3).random((B, 1, T, S)) < 0.6
  mask[1, 0, 2] = False  # A row that sees no key.
  return jnp.asarray(mask)


CASES = {
  "plain": {},
  "scale": dict(scale=0.37),
  "causal": dict(is_causal=True),
  "causal_window": dict(is_causal=True, local_window_size=(2, 1)),
  "bias": dict(bias=_normal(4, (B, N, T, S))),
  "mask": dict(mask=_mask()),
  "bias_and_mask_causal": dict(bias=_normal(5, (1, N, T, S)), mask=_mask(), is_causal=True),
  "lengths": dict(query_seq_lengths=jnp.array([4, 6]), key_value_seq_lengths=jnp.array([8, 3])),
  "kv_lengths_only": dict(key_value_seq_lengths=jnp.array([0, 5])),
  "q_lengths_past_t": dict(query_seq_lengths=jnp.array([9, 2])),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cudnn_call_matches_the_reference(case, calls):
  kw = CASES[case]
  q, k, v = _normal(0, (B, T, N, H)), _normal(1, (B, S, K, H)), _normal(2, (B, S, K, H))
  args = spec.canonicalize(q, k, v, **kw)
  out, _ = cudnn.CudnnAttention()._fwd(args, None)
  expected = references.high_precision(references.attention)(q, k, v, **kw)
  assert len(calls) == 1
  np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("lengths", [False, True])
def test_causal_window_reaches_cudnn_as_its_left_bound(monkeypatch, lengths):
  """jax.nn's own cuDNN branch (only the cuDNN kernel stubbed): cuDNN's sliding window bounds
  keys on the left only, so a causal window (2, 3) reaches it as 3 keys, also with sequence
  lengths, where jax.nn refuses a right bound other than 0 ("cuDNN doesn't support right
  window")."""
  from jax._src.nn import functions

  seen = {}

  def fake_cudnn(query, *args, sliding_window_length=None, **kwargs):
    seen["window"] = sliding_window_length
    return jnp.zeros_like(query)

  monkeypatch.setattr(functions, "cudnn_dot_product_attention", fake_cudnn)
  q = jnp.zeros((B, T, N, H), jnp.bfloat16)
  kv = jnp.zeros((B, S, K, H), jnp.bfloat16)
  kw = dict(key_value_seq_lengths=jnp.array([8, 3])) if lengths else {}
  args = spec.canonicalize(q, kv, kv, is_causal=True, local_window_size=(2, 3), **kw)
  out, _ = cudnn.CudnnAttention()._fwd(args, None)
  assert seen["window"] == 3
  assert out.shape == (B, T, N, H)
