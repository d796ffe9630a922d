"""float64 inputs stay float64 (no float32 accumulation) and pass finite-difference checks."""

import jax
import jax.numpy as jnp
import pytest
from jax.test_util import check_grads

import tokamax


def _calls():
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (6, 8), jnp.float64)
  w = jax.random.normal(keys[1], (8, 13), jnp.float64)
  q = jax.random.normal(keys[2], (1, 9, 2, 4), jnp.float64)
  labels = jnp.array([1, 2, 3, 0, 5, 12])
  return (
    {
      f"loss_{impl}": (
        lambda x, w, impl=impl: tokamax.linear_softmax_cross_entropy_loss(
          x, labels, w, implementation=impl
        ),
        (x, w),
      )
      for impl in ("xla", "chunked_xla")
    }
    | {
      f"attention_{impl}": (
        lambda q, impl=impl: tokamax.dot_product_attention(
          q, q, q, is_causal=True, logits_soft_cap=3.0, implementation=impl
        ),
        (q,),
      )
      for impl in ("xla", "xla_chunked")
    }
    | {
      "layer_norm": (lambda x: tokamax.layer_norm(x, None, None), (x,)),
      "ragged_dot": (
        lambda x, w: tokamax.ragged_dot(x, w[None].repeat(2, 0), jnp.array([2, 4])),
        (x, w),
      ),
    }
  )


NAMES = (
  "loss_xla",
  "loss_chunked_xla",
  "attention_xla",
  "attention_xla_chunked",
  "layer_norm",
  "ragged_dot",
)


@pytest.mark.parametrize("name", NAMES)
def test_float64_finite_differences(name):
  with jax.enable_x64(True):
    fn, args = _calls()[name]
    assert fn(*args).dtype == jnp.float64
    check_grads(fn, args, order=1, modes=("rev",), eps=1e-6, atol=1e-7, rtol=1e-7)


def test_accumulation_dtype_by_hand():
  """Sums and softmax statistics accumulate in at least float32: both 16-bit dtypes in
  float32, float32 in float32, float64 in float64."""
  from tokamax._src import numerics

  for dtype, want in (
    (jnp.float16, jnp.float32),
    (jnp.bfloat16, jnp.float32),
    (jnp.float32, jnp.float32),
    (jnp.float64, jnp.float64),
  ):
    assert numerics.accumulation_dtype(dtype) == jnp.dtype(want), dtype


def test_layer_norm_scale_and_offset_stay_float64():
  """float64 scale and offset enter the output and the gradients in float64: both match
  float64 LayerNorm written out in NumPy to 1e-12 (a float32 rounding of the scale or the
  offset is ~1e-8 off)."""
  import numpy as np

  rng = np.random.default_rng(0)
  x = rng.standard_normal((6, 8)) * 2 + 0.5
  scale = 1 + 0.3 * rng.standard_normal(8)
  offset = rng.standard_normal(8)
  dout = rng.standard_normal((6, 8))
  with jax.enable_x64(True):
    fn = lambda x, s, o: tokamax.layer_norm(x, s, o, implementation="xla")
    out, vjp = jax.vjp(fn, *(jnp.asarray(a, jnp.float64) for a in (x, scale, offset)))
    grads = vjp(jnp.asarray(dout, jnp.float64))
  centred = x - x.mean(1, keepdims=True)
  rstd = 1 / np.sqrt((centred**2).mean(1, keepdims=True) + 1e-6)
  normalized = centred * rstd
  g = dout * scale
  dx = (g - g.mean(1, keepdims=True) - normalized * (g * normalized).mean(1, keepdims=True)) * rstd
  want = (normalized * scale + offset, dx, (dout * normalized).sum(0), dout.sum(0))
  for name, got, expected in zip(
    ("out", "dx", "dscale", "doffset"), (out, *grads), want, strict=True
  ):
    assert got.dtype == jnp.float64, name
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-12, atol=1e-12, err_msg=name)
