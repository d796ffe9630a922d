"""Every op's declared forward cost (`OpSpec.cost`), from its definition.

Benchmarks divide by these (TFLOP/s, GB/s) and the history compares them across
runs: a cost that drifts misreports every measurement of the op. Each expected
value is counted here from the op's maths (multiply-adds of its matmuls over the
pairs that the masks leave, bytes of its operands and output), not from the spec.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from tokamax._src.ops import registry
from tokamax._src.ops.ragged_dot import spec as ragged_spec


def _cost(op: str, *args, **kwargs):
  spec = registry.spec(op)
  return spec.cost(spec.canonicalize(*args, **kwargs))


@pytest.mark.parametrize("window", (None, 2, (0, 3), (4, 1)))
@pytest.mark.parametrize("is_causal", (False, True))
@pytest.mark.parametrize(("t", "s"), ((7, 11), (11, 7)))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_attention_cost(t, s, is_causal, window, dtype):
  b, n, kh, h, hv = (2, 3), 6, 2, 8, 5
  q = jnp.ones((*b, t, n, h), dtype)
  k = jnp.ones((*b, s, kh, h), dtype)
  v = jnp.ones((*b, s, kh, hv), dtype)
  cost = _cost("dot_product_attention", q, k, v, is_causal=is_causal, local_window_size=window)
  # (query, key) pairs computed: all, or the causal lower-left triangle (j <= i), within
  # the band i - left <= j <= i + right of a window.
  visible = np.tril(np.ones((t, s))) if is_causal else np.ones((t, s))
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    visible = np.triu(np.tril(visible, right), -left)
  pairs = visible.sum()
  batch_heads = np.prod(b) * n
  # q.k over H and p.v over hv: one multiply-add (2 flops) each per pair, head and batch.
  assert cost.flops == pytest.approx(2 * batch_heads * pairs * (h + hv))
  size = jnp.dtype(dtype).itemsize
  out = np.prod(b) * t * n * hv
  assert cost.bytes == pytest.approx(size * (q.size + k.size + v.size + out))


def test_attention_cost_of_long_sequences_counts_the_diagonal():
  """At T = S = 16384 the causal triangle holds T (T + 1) / 2 pairs, a causal window of 1024
  keys left of the diagonal 1025 per query less the first queries' missing ones."""
  t, w = 16384, 1024
  q = jnp.ones((1, t, 1, 64), jnp.bfloat16)
  causal = _cost("dot_product_attention", q, q, q, is_causal=True)
  assert causal.flops == 2 * (t * (t + 1) / 2) * 128
  band = _cost("dot_product_attention", q, q, q, is_causal=True, local_window_size=(w, 0))
  assert band.flops == 2 * ((w + 1) * t - w * (w + 1) / 2) * 128


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_layer_norm_cost(dtype):
  x = jnp.ones((5, 7, 12), dtype)
  cost = _cost("layer_norm", x, jnp.ones((12,), dtype), None)
  assert cost.flops == 8 * x.size
  assert cost.bytes == 2 * x.size * jnp.dtype(dtype).itemsize  # x read, y written.


@pytest.mark.parametrize("fused", (True, False))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_gated_linear_unit_cost(fused, dtype):
  batch, m, k, n = 3, 5, 8, 6
  x = jnp.ones((batch, m, k), dtype)
  w = jnp.ones((k, 2, n), dtype) if fused else (jnp.ones((k, n), dtype),) * 2
  cost = _cost("gated_linear_unit", x, w)
  rows = batch * m
  assert cost.flops == 2 * rows * k * (2 * n)  # Two [rows, K] @ [K, N] matmuls.
  assert cost.bytes == jnp.dtype(dtype).itemsize * (rows * k + 2 * k * n + rows * n)


def test_gated_linear_unit_cost_of_an_empty_contraction():
  """K = 0: no multiply-adds; the bytes are the [3, 5, N] output's (x and the weights are
  empty), counted without dividing x.size by K."""
  x = jnp.ones((3, 5, 0), jnp.bfloat16)
  cost = _cost("gated_linear_unit", x, jnp.ones((0, 2, 6), jnp.bfloat16))
  assert cost.flops == 0
  assert cost.bytes == 2 * 3 * 5 * 6


@pytest.mark.parametrize("layout", ragged_spec.LAYOUTS)
@pytest.mark.parametrize("out_dtype", (None, jnp.float32))
def test_ragged_dot_cost(layout, out_dtype):
  m, k, n, g = 10, 6, 4, 3
  lhs = jnp.ones((m, k), jnp.bfloat16)
  rhs_shape = {
    ragged_spec.DEFAULT: (g, k, n),
    ragged_spec.RHS_TRANSPOSED: (g, n, k),
    ragged_spec.RAGGED_CONTRACTING: (m, n),
  }[layout]
  rhs = jnp.ones(rhs_shape, jnp.bfloat16)
  sizes = jnp.array([4, 0, 5], jnp.int32)
  cost = _cost(
    "ragged_dot",
    lhs,
    rhs,
    sizes,
    ragged_spec.dimension_numbers(layout),
    preferred_element_type=out_dtype,
  )
  # Each lhs row meets one group's [K, N] (or, contracting, one rhs row): M K N multiply-adds.
  assert cost.flops == 2 * m * k * n
  out = g * k * n if layout == ragged_spec.RAGGED_CONTRACTING else m * n
  out_size = jnp.dtype(out_dtype or jnp.bfloat16).itemsize
  assert cost.bytes == 2 * (lhs.size + rhs.size) + out_size * out


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_loss_cost(dtype):
  b, h, v = 6, 8, 20
  x, w = jnp.ones((b, h), dtype), jnp.ones((h, v), dtype)
  cost = _cost("linear_softmax_cross_entropy_loss", x, jnp.arange(b) % v, w)
  assert cost.flops == 2 * b * h * v  # The logits' matmul.
  assert cost.bytes == jnp.dtype(dtype).itemsize * (b * h + h * v)
