"""linear_softmax_cross_entropy_loss against the float64 reference."""

import jax
import pytest

import tokamax
from suites.core.conftest import assert_matches, references

SHAPES = {"small": (8, 16, 50), "vocab_50257": (6, 8, 50257), "one_row": (1, 4, 3)}


@pytest.mark.parametrize("impl", ("xla", "chunked_xla", None))
@pytest.mark.parametrize("reduction", ("sum", "mean", "none"))
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_gradient(shape, reduction, impl, inputs):
  b, h, v = SHAPES[shape]
  x = inputs.normal((b, h))
  w = inputs.normal((h, v), 0.5)
  labels = inputs.ints((b,), 0, v)

  def run(x, w):
    return tokamax.linear_softmax_cross_entropy_loss(
      x, labels, w, reduction=reduction, implementation=impl
    )

  def reference(x, w):
    return references.linear_softmax_cross_entropy_loss(x, labels, w, reduction=reduction)

  out = run(x, w)
  dout = inputs.normal(out.shape)
  ref_out, ref_grads = references.high_precision_vjp(reference, (x, w), dout)
  assert_matches(out, ref_out, what="loss")
  dx, dw = jax.vjp(run, x, w)[1](dout)
  assert_matches(dx, ref_grads[0], what="dx")
  assert_matches(dw, ref_grads[1], what="dweights")
