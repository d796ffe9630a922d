"""linear_softmax_cross_entropy_loss against the float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from suites import opdb
from suites.core.conftest import assert_matches, references
from tokamax._src import numerics
from tokamax._src.ops.linear_softmax_cross_entropy_loss import spec as loss_spec

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


@pytest.mark.parametrize("impl", ("xla", "chunked_xla"))
@pytest.mark.parametrize("shape", ("small", "vocab_50257"))
def test_one_pass_statistics_as_on_a_gpu(shape, impl, inputs, monkeypatch):
  """The GPU's one-pass row max and sum (a CPU computes two passes) through the op."""
  monkeypatch.setattr(numerics, "row_max_and_sum", numerics._one_pass)
  test_forward_and_gradient(shape, "sum", impl, inputs)


@pytest.mark.parametrize("form", (numerics._one_pass, numerics._two_passes), ids=("one", "two"))
def test_row_max_and_sum_give_the_log_sum_exp(form):
  """Both forms against float64 numpy: wide and narrow rows, impossible columns, a row that
  sees nothing (-inf), and a single column."""
  rng = np.random.default_rng(7)
  rows = rng.normal(size=(6, 1000)) * np.array([1, 30, 300, 1e-3, 1, 1])[:, None]
  rows[4, ::3] = -np.inf
  rows[5] = -np.inf
  row_max, total = jax.jit(form)(jnp.asarray(rows, jnp.float32))
  lse = np.asarray(row_max + jnp.log(total), np.float64)
  rows = rows.astype(np.float32).astype(np.float64)
  top = rows[:5].max(-1, keepdims=True)
  expected = np.log(np.exp(rows[:5] - top).sum(-1)) + top[:, 0]
  np.testing.assert_allclose(lse[:5], expected, rtol=2e-6, atol=1e-6)
  assert lse[5] == -np.inf
  single_max, single_total = form(jnp.array([[3.0]]))
  assert float(single_max[0] + jnp.log(single_total[0])) == 3.0


@pytest.mark.parametrize("form", (numerics._one_pass, numerics._two_passes), ids=("one", "two"))
def test_row_max_and_sum_reduce_the_last_axis_of_three(form):
  """Logits [2, 3, 40] (the documented [..., C]): each row's max and log-sum-exp over the
  last axis, [2, 3], against float64 numpy, with rows of different scales so that a
  reduction over another axis gives other numbers."""
  rng = np.random.default_rng(12)
  rows = (rng.normal(size=(2, 3, 40)) * np.array([0.5, 4.0, 20.0])[:, None]).astype(np.float32)
  row_max, total = jax.jit(form)(jnp.asarray(rows))
  assert row_max.shape == total.shape == (2, 3)
  np.testing.assert_array_equal(np.asarray(row_max), rows.max(-1))
  wide = rows.astype(np.float64)
  top = wide.max(-1, keepdims=True)
  expected = np.log(np.exp(wide - top).sum(-1)) + top[..., 0]
  lse = np.asarray(row_max, np.float64) + np.log(np.asarray(total, np.float64))
  np.testing.assert_allclose(lse, expected, rtol=1e-6)


@pytest.mark.parametrize("form", (numerics._one_pass, numerics._two_passes), ids=("one", "two"))
def test_row_max_and_sum_of_rows_far_below_zero(form):
  """Rows whose every logit is about -1000: the max is the row's own (not 0, where every
  exp would underflow) and the log-sum-exp matches float64 numpy."""
  rows = np.random.default_rng(8).normal(size=(3, 64)) - np.array([1000.0, 50.0, 1e4])[:, None]
  rows = rows.astype(np.float32)
  row_max, total = jax.jit(form)(jnp.asarray(rows))
  np.testing.assert_array_equal(np.asarray(row_max), rows.max(-1))
  wide = rows.astype(np.float64)
  top = wide.max(-1, keepdims=True)
  expected = np.log(np.exp(wide - top).sum(-1)) + top[:, 0]
  lse = np.asarray(row_max, np.float64) + np.log(np.asarray(total, np.float64))
  np.testing.assert_allclose(lse, expected, rtol=1e-6)


@pytest.mark.parametrize("impl", ("xla", "chunked_xla", None))
@pytest.mark.parametrize("reduction", ("sum", "mean", "none"))
def test_bfloat16_inputs_give_a_float32_loss_and_bfloat16_gradients(reduction, impl, inputs):
  """The loss is float32 (as documented); the cotangents have their inputs' dtype."""
  bf16 = jnp.bfloat16
  x, w = inputs.normal((8, 16)).astype(bf16), inputs.normal((16, 50), 0.5).astype(bf16)
  labels = inputs.ints((8,), 0, 50)

  def run(x, w):
    return tokamax.linear_softmax_cross_entropy_loss(
      x, labels, w, reduction=reduction, implementation=impl
    )

  out, vjp = jax.vjp(run, x, w)
  assert out.dtype == jnp.float32
  assert out.shape == ((8,) if reduction == "none" else ())
  dx, dw = vjp(jnp.ones_like(out))
  assert (dx.dtype, dw.dtype) == (bf16, bf16)
  ref = references.high_precision(references.linear_softmax_cross_entropy_loss)(
    x, labels, w, reduction=reduction
  )
  np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=1e-4, atol=1e-4)


def _check_vjp(impl, x, w, labels, reduction, inputs, dx_columns=slice(None)):
  """The loss and its VJP through `impl` against the high-precision reference; dx is compared
  on `dx_columns` only."""

  def run(x, w):
    return tokamax.linear_softmax_cross_entropy_loss(
      x, labels, w, reduction=reduction, implementation=impl
    )

  def reference(x, w):
    return references.linear_softmax_cross_entropy_loss(x, labels, w, reduction=reduction)

  out, vjp = jax.vjp(run, x, w)
  dout = inputs.normal(out.shape)
  ref_out, ref_grads = references.high_precision_vjp(reference, (x, w), dout)
  assert_matches(out, ref_out, what="loss")
  dx, dw = vjp(dout)
  assert_matches(dx[:, dx_columns], ref_grads[0][:, dx_columns], what="dx")
  assert_matches(dw, ref_grads[1], what="dweights")


@pytest.mark.parametrize("reduction", ("sum", "none"))
def test_chunked_labels_at_the_chunk_edges_and_in_the_overlap(reduction, inputs):
  """V=50 in chunks of 16: the last chunk is shifted back to columns [34, 50), of which [34, 48)
  the third chunk covers too. Labels at every chunk edge and in that overlap count once, in
  the loss and in both gradients."""
  from tokamax._src.ops.linear_softmax_cross_entropy_loss import chunked_xla

  labels = jnp.array([0, 15, 16, 31, 32, 33, 34, 40, 47, 48, 49], jnp.int32)
  x = inputs.normal((labels.shape[0], 8))
  w = inputs.normal((8, 50), 0.5)
  op = chunked_xla.ChunkedXlaLoss(config=chunked_xla.ChunkedLossConfig(vocab_chunk_size=16))
  _check_vjp(op, x, w, labels, reduction, inputs)


@pytest.mark.parametrize("impl", ("xla", "chunked_xla"))
def test_logits_far_below_zero(impl, inputs):
  """Every logit near -120 (x's last feature is 1, its weights -120), over 3 vocabulary chunks
  of 16: exp(logit) underflows in float32, so the log-sum-exp must come from each row's
  running max, not from zero."""
  from tokamax._src.ops.linear_softmax_cross_entropy_loss import chunked_xla

  if impl == "chunked_xla":
    impl = chunked_xla.ChunkedXlaLoss(config=chunked_xla.ChunkedLossConfig(vocab_chunk_size=16))
  x = jnp.concatenate([inputs.normal((6, 7)), jnp.ones((6, 1))], axis=1)
  w = jnp.concatenate([inputs.normal((7, 40), 0.5), jnp.full((1, 40), -120.0)], axis=0)
  labels = inputs.ints((6,), 0, 40)
  # dx's last column is -120 x (sum of the softmax - 1): zero up to float32 rounding of 120.
  _check_vjp(impl, x, w, labels, "none", inputs, dx_columns=slice(7))


@pytest.mark.parametrize(("b", "h"), [(0, 128), (256, 0)], ids=["no_rows", "empty_h"])
@pytest.mark.parametrize("name", ["mosaic", "mosaic_tpu"])
def test_kernels_refuse_empty_inputs_that_xla_computes(name, b, h):
  """No rows or H = 0: the kernels name it (the Mosaic TPU reason raised ZeroDivisionError,
  the Mosaic GPU one took B = 0), so that `None` computes the call in XLA."""
  x = jnp.ones((b, h), jnp.bfloat16)
  w = jnp.ones((h, 512), jnp.bfloat16)
  args = loss_spec.SPEC.canonicalize(x, jnp.zeros((b,), jnp.int32), w)
  op = loss_spec.SPEC.implementation_class(name)()
  assert op._unsupported_reason(args) == f"empty dimension (B={b}, H={h})"


@pytest.mark.parametrize("impl", ("xla", "chunked_xla", None))
def test_traced_labels_outside_the_vocabulary_lose_nan(impl, inputs):
  """Labels that only a trace holds (canonicalize cannot check them): a row whose label is
  negative or past V loses NaN, not its log-sum-exp; the other rows match the reference, and
  the gradient is NaN where such a row reaches it."""
  b, h, v = 6, 8, 20
  x, w = inputs.normal((b, h)), inputs.normal((h, v), 0.5)
  labels = jnp.asarray([3, -1, 19, 20, 0, 7], jnp.int32)
  bad = np.asarray([False, True, False, True, False, False])

  def run(x, w, labels, reduction):
    return tokamax.linear_softmax_cross_entropy_loss(
      x, labels, w, reduction=reduction, implementation=impl
    )

  per_row = jax.jit(run, static_argnums=3)(x, w, labels, "none")
  np.testing.assert_array_equal(np.isnan(np.asarray(per_row)), bad)
  good = np.flatnonzero(~bad)
  ref = references.linear_softmax_cross_entropy_loss(x[good], labels[good], w, reduction="none")
  assert_matches(per_row[good], ref, what="loss of the rows with a label in V")
  assert np.isnan(float(jax.jit(run, static_argnums=3)(x, w, labels, "sum")))
  dx, dw = jax.jit(jax.grad(run, argnums=(0, 1)), static_argnums=3)(x, w, labels, "mean")
  np.testing.assert_array_equal(np.isnan(np.asarray(dx)).all(axis=1), bad)
  assert not np.isnan(np.asarray(dx)[good]).any()
  assert np.isnan(np.asarray(dw)).all()


def test_chunked_running_max_falls_from_chunk_to_chunk(inputs):
  """The first of 3 vocabulary chunks of 16 holds logits near +60, the others near -60: the
  running max must stay the first chunk's (rescaling by exp(m - m_chunk) = exp(120) from a later
  chunk's max overflows float32)."""
  from tokamax._src.ops.linear_softmax_cross_entropy_loss import chunked_xla

  op = chunked_xla.ChunkedXlaLoss(config=chunked_xla.ChunkedLossConfig(vocab_chunk_size=16))
  x = jnp.concatenate([inputs.normal((6, 7)), jnp.ones((6, 1))], axis=1)
  last = jnp.where(jnp.arange(48) < 16, 60.0, -60.0)[None, :]
  w = jnp.concatenate([inputs.normal((7, 48), 0.5), last], axis=0)
  labels = jnp.asarray([0, 5, 15, 16, 30, 47], jnp.int32)
  _check_vjp(op, x, w, labels, "none", inputs, dx_columns=slice(7))


@pytest.mark.parametrize("impl", ("xla", "chunked_xla"))
@pytest.mark.parametrize(
  ("dtype", "labels"),
  ((jnp.uint8, [0, 100, 200, 255, 17, 250]), (jnp.int8, [0, 100, 120, 127, 17, 5])),
  ids=("uint8", "int8"),
)
def test_narrow_integer_labels_index_the_whole_vocabulary(dtype, labels, impl, inputs):
  """Labels of a narrow integer dtype over a vocabulary of 300 (past what the dtype holds):
  each row's loss is the reference's with the same labels as int32 (no NaN from a column
  arithmetic that wraps in the narrow dtype)."""
  x, w = inputs.normal((6, 8)), inputs.normal((8, 300), 0.5)
  narrow = jnp.array(labels, dtype)
  out = tokamax.linear_softmax_cross_entropy_loss(
    x, narrow, w, reduction="none", implementation=impl
  )
  ref = references.high_precision(references.linear_softmax_cross_entropy_loss)(
    x, jnp.array(labels, jnp.int32), w, reduction="none"
  )
  assert_matches(out, ref)


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="Mosaic TPU runs here")
def test_the_public_loss_passes_the_implementation_on():
  """An implementation that cannot run here is refused by name, not replaced by XLA."""
  x, w = jnp.ones((4, 8)), jnp.ones((8, 16))
  with pytest.raises(NotImplementedError, match="mosaic_tpu: runs on tpu"):
    tokamax.linear_softmax_cross_entropy_loss(
      x, jnp.zeros((4,), jnp.int32), w, implementation="mosaic_tpu"
    )


@pytest.mark.parametrize("impl", ("xla", "chunked_xla", None))
def test_bfloat16_gradients_of_large_logits(impl, inputs):
  """bfloat16 inputs whose logits are all near 100 (x's last feature is 1, its weights 100)
  with O(1) differences: the backward pass must use float32 logits (or recompute them), not
  logits rounded to bfloat16 (spacing 0.5 at 100), against the float64 reference of the same
  bfloat16 values."""
  bf16 = jnp.bfloat16
  b, h, v = 8, 8, 64
  x = jnp.concatenate([inputs.normal((b, h - 1)), jnp.ones((b, 1))], axis=1).astype(bf16)
  w = jnp.concatenate([inputs.normal((h - 1, v)), jnp.full((1, v), 100.0)], axis=0).astype(bf16)
  labels = inputs.ints((b,), 0, v)
  dout = inputs.normal((b,))

  def run(x, w):
    return tokamax.linear_softmax_cross_entropy_loss(
      x, labels, w, reduction="none", implementation=impl
    )

  def reference(x, w):
    return references.linear_softmax_cross_entropy_loss(x, labels, w, reduction="none")

  dx, dw = jax.vjp(run, x, w)[1](dout)
  _, (ref_dx, ref_dw) = references.high_precision_vjp(reference, (x, w), dout)
  # dx's last column is 100 x (sum of the softmax - 1) x dout: zero up to rounding.
  for name, got, want in (("dx", dx[:, : h - 1], ref_dx[:, : h - 1]), ("dweights", dw, ref_dw)):
    error = np.abs(np.asarray(got, np.float64) - want).max()
    # bfloat16 cotangents of the logits: about 0.5% of the largest; logits rounded to
    # bfloat16 before the softmax: more than 5%.
    assert error <= 2e-2 * np.abs(want).max(), (name, error, np.abs(want).max())


@pytest.mark.parametrize("reduction", ("sum", "none"))
@pytest.mark.parametrize("impl", ("xla", "chunked_xla", "chunked_xla_16"))
def test_second_derivatives_match_the_reference(impl, reduction, inputs):
  """A Hessian-vector product (forward over reverse) and a gradient of a gradient, in x and
  the weights, against JAX's derivatives of the float64 reference. The chunked forward's
  scan traced both forms of `numerics.row_max_and_sum`, and JAX cannot differentiate the
  GPU's one-pass reduction: both failed on the CPU (a `Zero` passed to reshape)."""
  from tokamax._src.ops.linear_softmax_cross_entropy_loss import chunked_xla

  b, h, v = 5, 6, 40
  if impl == "chunked_xla_16":  # Three chunks, the last overlapping the second.
    impl = chunked_xla.ChunkedXlaLoss(config=chunked_xla.ChunkedLossConfig(vocab_chunk_size=16))
  x, w = inputs.normal((b, h)), inputs.normal((h, v), 0.5)
  labels = inputs.ints((b,), 0, v)
  tx, tw = inputs.normal((b, h)), inputs.normal((h, v))
  weights = inputs.normal((b,)) if reduction == "none" else jnp.ones(())

  def scalar(loss_fn):
    return lambda x, w: (loss_fn(x, labels, w, reduction=reduction) * weights).sum()

  def second_derivatives(loss_fn, x, w, tx, tw):
    f = scalar(loss_fn)
    grad = jax.grad(f, (0, 1))
    _, hvp = jax.jvp(grad, (x, w), (tx, tw))
    # The gradient of |dL/dx|^2 in (x, w): reverse over reverse.
    gg = jax.grad(lambda x, w: (grad(x, w)[0] ** 2).sum(), (0, 1))(x, w)
    return (*hvp, *gg)

  def run(x, labels, w, reduction):
    return tokamax.linear_softmax_cross_entropy_loss(
      x, labels, w, reduction=reduction, implementation=impl
    )

  got = second_derivatives(run, x, w, tx, tw)
  want = references.high_precision(
    lambda *a: second_derivatives(references.linear_softmax_cross_entropy_loss, *a)
  )(x, w, tx, tw)
  for name, g, r in zip(("hvp_x", "hvp_w", "gg_x", "gg_w"), got, want, strict=True):
    assert_matches(g, r, what=name)


@pytest.mark.parametrize("impl", ("xla", "chunked_xla"))
def test_gradient_of_the_gradient_inside_a_scan(impl, inputs):
  """The loss in a `lax.scan` (as over layers) differentiated twice, against the float64
  reference. The scan's partial evaluation inlines `row_max_and_sum` without its custom
  derivative, so JAX differentiated the GPU's one-pass reduction too, and failed on its ones
  operand (a symbolic zero tangent)."""
  b, h, v = 5, 6, 40
  x, w = inputs.normal((b, h)), inputs.normal((h, v), 0.5)
  labels = inputs.ints((b,), 0, v)
  scales = jnp.array([1.0, -0.5, 2.0])

  def gradient_of_gradient(loss_fn, x, w):
    def layers(x, w):
      step = lambda total, s: (total + loss_fn(s * x, labels, w, reduction="sum"), None)
      return jax.lax.scan(step, jnp.zeros((), x.dtype), scales.astype(x.dtype))[0]

    grad = jax.grad(layers, (0, 1))
    return jax.grad(lambda x, w: (grad(x, w)[0] ** 2).sum(), (0, 1))(x, w)

  def run(x, labels, w, reduction):
    return tokamax.linear_softmax_cross_entropy_loss(
      x, labels, w, reduction=reduction, implementation=impl
    )

  got = gradient_of_gradient(run, x, w)
  want = references.high_precision(
    lambda x, w: gradient_of_gradient(references.linear_softmax_cross_entropy_loss, x, w)
  )(x, w)
  assert_matches(got[0], want[0], what="gg_x")
  assert_matches(got[1], want[1], what="gg_w")


def test_one_pass_row_max_and_sum_has_the_two_passes_derivative(inputs):
  """The GPU's one-pass form under jax.jvp directly: the tangent of its log-sum-exp is the
  softmax-weighted tangent (float64 numpy)."""
  logits, tangent = inputs.normal((4, 33), 3.0), inputs.normal((4, 33))
  (_, total), (dmax, dtotal) = jax.jvp(numerics._one_pass, (logits,), (tangent,))
  dlse = np.asarray(dmax + dtotal / total, np.float64)
  wide = np.asarray(logits, np.float64)
  softmax = np.exp(wide - wide.max(-1, keepdims=True))
  softmax /= softmax.sum(-1, keepdims=True)
  np.testing.assert_allclose(dlse, (softmax * np.asarray(tangent)).sum(-1), rtol=1e-5, atol=1e-5)


def test_one_pass_row_max_and_sum_gradient_with_minus_inf_columns():
  """Reverse mode through the one-pass form where -inf logits (masked, or the chunked loss's
  repeated columns) meet in its reduction tree: the log-sum-exp's gradient is the softmax,
  finite, and 0 on the -inf columns (float64 numpy)."""
  rng = np.random.default_rng(3)
  rows = rng.normal(size=(3, 17))
  rows[0, :8] = -np.inf
  rows[1, ::2] = -np.inf
  rows[2, 5:] = -np.inf

  def lse(logits):
    row_max, total = numerics._one_pass(logits)
    return (row_max + jnp.log(total)).sum()

  grad = np.asarray(jax.grad(lse)(jnp.asarray(rows, jnp.float32)), np.float64)
  softmax = np.exp(rows - rows.max(-1, keepdims=True))
  softmax /= softmax.sum(-1, keepdims=True)
  np.testing.assert_allclose(grad, softmax, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("magnitude", "feature"), [(1.0, "sum"), (1000.0, "large_logits")])
def test_op_database_logits_have_the_documented_scale(magnitude, feature):
  """The op database draws x and weights so that the logits x @ w have unit variance at
  magnitude 1 (std `magnitude`): "large_logits" puts them in the thousands."""
  info = opdb.get("linear_softmax_cross_entropy_loss")
  shape = dict(b=256, h=64, v=512)
  built = info.build(opdb.Draw(jax.random.key(0)), shape, "float32", info.features[feature])
  x, _, w = (np.asarray(a, np.float64) for a in built.args)
  std = (x @ w).std()
  assert 0.9 * magnitude < std < 1.1 * magnitude, std
