"""layer_norm against the float64 reference."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from suites import opdb
from suites.core.conftest import assert_matches, references
from tokamax._src.ops.normalization import spec as norm_spec

CASES = {
  "layernorm": dict(shape=(6, 37)),
  "rmsnorm": dict(shape=(6, 37), subtract_mean=False),
  "axis0": dict(shape=(19, 5), axis=0),
  "axis_middle_3d": dict(shape=(3, 21, 4), axis=1),
  "negative_axis": dict(shape=(3, 4, 9), axis=-2),
  "axis_minus_ndim": dict(shape=(19, 5), axis=-2),
  "no_scale": dict(shape=(4, 33), scale=False),
  "no_offset": dict(shape=(4, 33), offset=False),
  "neither": dict(shape=(4, 33), scale=False, offset=False),
  "scale_offset": dict(shape=(4, 33), scale_offset=1.0),
  "scale_offset_no_scale_rms": dict(
    shape=(4, 33), scale=False, scale_offset=0.5, subtract_mean=False
  ),
  # LayerNorm's own backward (RMSNorm's is JAX's): dx takes 1 + scale_offset without a scale.
  "scale_offset_no_scale_layernorm": dict(shape=(4, 33), scale=False, scale_offset=0.5),
  "epsilon": dict(shape=(4, 16), epsilon=0.3),
  "zero_epsilon": dict(shape=(4, 16), epsilon=0.0),
  "vector": dict(shape=(50,)),
  # A mean that dwarfs the spread: one-pass variances (E[x^2] - E[x]^2) cancel there.
  "large_mean": dict(shape=(6, 64), mean=100.0),
}


@pytest.mark.parametrize("impl", ("xla", None))
@pytest.mark.parametrize("name", CASES)
def test_forward_and_gradient(name, impl, inputs):
  case = dict(CASES[name])
  shape = case.pop("shape")
  axis = case.pop("axis", -1)
  with_scale, with_offset = case.pop("scale", True), case.pop("offset", True)
  x = inputs.normal(shape, 2.0) + 0.5 + case.pop("mean", 0.0)
  d = shape[axis]
  params = {}
  if with_scale:
    params["scale"] = inputs.normal((d,))
  if with_offset:
    params["offset"] = inputs.normal((d,))

  def run(x, p):
    return tokamax.layer_norm(
      x, p.get("scale"), p.get("offset"), axis=axis, implementation=impl, **case
    )

  def reference(x, p):
    return references.layer_norm(x, p.get("scale"), p.get("offset"), axis=axis, **case)

  out = run(x, params)
  dout = inputs.normal(out.shape)
  ref_out, ref_grads = references.high_precision_vjp(reference, (x, params), dout)
  assert_matches(out, ref_out, what="output")
  grads = jax.vjp(run, x, params)[1](dout)
  assert_matches(grads[0], ref_grads[0], what="dx")
  for key in params:
    assert_matches(grads[1][key], ref_grads[1][key], what=f"d{key}")


@pytest.mark.parametrize("impl", ("xla", None))
@pytest.mark.parametrize("subtract_mean", (True, False), ids=("layernorm", "rmsnorm"))
@pytest.mark.parametrize("dtype", (jnp.bfloat16, jnp.float16))
def test_16_bit_inputs_give_outputs_of_their_dtype(dtype, subtract_mean, impl, inputs):
  """The output has x's dtype (statistics run in float32 inside), value and gradient."""
  x = (inputs.normal((5, 40)) + 0.5).astype(dtype)
  scale, offset = inputs.normal((40,)).astype(dtype), inputs.normal((40,)).astype(dtype)

  def run(x):
    return tokamax.layer_norm(x, scale, offset, subtract_mean=subtract_mean, implementation=impl)

  out, vjp = jax.vjp(run, x)
  assert out.dtype == dtype
  assert vjp(jnp.ones_like(out))[0].dtype == dtype
  ref = references.high_precision(references.layer_norm)(
    x, scale, offset, subtract_mean=subtract_mean
  )
  # One rounding to the 16-bit dtype (8 or 11 significant bits) of O(1) values.
  np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=1e-2, atol=3e-2)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_partitioning_splits_every_axis_but_the_normalized_one(axis):
  """The sharding rule's labels: the normalized axis shares its label with scale and offset
  and never splits (each row's statistics need all of it); every other axis is rows, splits,
  and keeps its own label in the output."""
  shape = (3, 5, 7)
  d = shape[axis]
  x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)
  record = norm_spec.canonicalize(x, jnp.ones(d), jnp.ones(d), axis=axis)
  rule = norm_spec.partitioning(record)
  shapes = {"x": shape, "scale": (d,), "offset": (d,)}
  sizes = {}
  for name, labels in rule.inputs.items():
    assert len(labels) == len(shapes[name]), name
    for label, size in zip(labels, shapes[name], strict=True):
      assert sizes.setdefault(label, size) == size, (name, labels)
  x_labels = rule.inputs["x"]
  assert tuple(rule.output) == tuple(x_labels)
  assert x_labels[axis] == rule.inputs["scale"][0] == rule.inputs["offset"][0]
  rows = {x_labels[i] for i in range(len(shape)) if i != axis % len(shape)}
  assert len(rows) == len(shape) - 1 and set(rule.split) == rows


@pytest.mark.parametrize("impl", ("xla", None))
@pytest.mark.parametrize("dtype", (jnp.bfloat16, jnp.float16))
def test_16_bit_scale_and_offset_get_gradients_of_their_dtype(dtype, impl, inputs):
  """dscale and doffset have the dtype of scale and offset (summed over rows in float32),
  and match the float64 reference to one 16-bit rounding."""
  x = (inputs.normal((6, 40)) + 0.5).astype(dtype)
  scale, offset = inputs.normal((40,)).astype(dtype), inputs.normal((40,)).astype(dtype)
  dout = inputs.normal((6, 40)).astype(dtype)

  def run(scale, offset):
    return tokamax.layer_norm(x, scale, offset, implementation=impl)

  dscale, doffset = jax.vjp(run, scale, offset)[1](dout)
  assert (dscale.dtype, doffset.dtype) == (dtype, dtype)
  x64, dout64 = np.asarray(x, np.float64), np.asarray(dout, np.float64)
  normalized = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(
    np.asarray(dscale, np.float64), (dout64 * normalized).sum(0), rtol=1e-2, atol=3e-2
  )
  np.testing.assert_allclose(np.asarray(doffset, np.float64), dout64.sum(0), rtol=1e-2, atol=3e-2)


@pytest.mark.parametrize("axis", (np.int64(0), np.int32(-2)), ids=("int64", "int32_negative"))
def test_numpy_integer_axis_is_an_axis(axis, inputs):
  """A numpy integer axis (as from `np.argmax` or a shape computation) normalizes that axis."""
  x = inputs.normal((19, 5), 2.0) + 0.5
  scale, offset = inputs.normal((19,)), inputs.normal((19,))
  out = tokamax.layer_norm(x, scale, offset, axis=axis, implementation="xla")
  ref = references.high_precision(references.layer_norm)(x, scale, offset, axis=0)
  assert_matches(out, ref)


@pytest.mark.parametrize("impl", ("xla", None))
def test_bfloat16_rows_of_a_large_mean(impl, inputs):
  """bfloat16 rows near 100 with O(1) spread, against the float64 reference of the same
  bfloat16 values: the output and the backward pass must use the mean (and 1/std) in float32,
  not rounded to bfloat16 (spacing 0.5 at 100), whether computed for the output or saved for
  the gradient."""
  bf16 = jnp.bfloat16
  x = (inputs.normal((6, 64)) + 100.0).astype(bf16)
  scale, offset = inputs.normal((64,)).astype(bf16), inputs.normal((64,)).astype(bf16)
  dout = inputs.normal((6, 64)).astype(bf16)

  def run(x, scale, offset):
    return tokamax.layer_norm(x, scale, offset, implementation=impl)

  out, vjp = jax.vjp(run, x, scale, offset)
  ref_out, ref_grads = references.high_precision_vjp(
    references.layer_norm, (x, scale, offset), dout
  )
  got = (("output", run(x, scale, offset)), ("output under vjp", out))
  got += tuple(zip(("dx", "dscale", "doffset"), vjp(dout), strict=True))
  for (name, value), want in zip(got, (ref_out, ref_out, *ref_grads), strict=True):
    error = np.abs(np.asarray(value, np.float64) - want).max()
    # A bfloat16 rounding: about 0.3% of the largest value; a mean off by up to 0.25 (of a
    # unit spread): 5% of dscale.
    assert error <= 1.5e-2 * np.abs(want).max(), (name, error, np.abs(want).max())


@pytest.mark.parametrize("impl", ("xla", None))
@pytest.mark.parametrize("subtract_mean", (True, False))
@pytest.mark.parametrize("shape", ((3, 0), (0, 5)))
def test_empty_inputs_have_empty_values_and_gradients(shape, subtract_mean, impl):
  """No rows, or rows of no elements: the value and every cotangent are empty arrays of
  their inputs' shapes and dtypes (the one-pass statistics have no first element to
  shift by where the normalised axis is empty)."""
  x = jnp.ones(shape, jnp.float32)
  scale = jnp.ones(shape[-1:], jnp.bfloat16)
  offset = jnp.ones(shape[-1:], jnp.bfloat16)

  def run(x, scale, offset):
    return tokamax.layer_norm(
      x, scale, offset, subtract_mean=subtract_mean, implementation=impl
    ).sum()

  grads = jax.grad(run, argnums=(0, 1, 2))(x, scale, offset)
  out = tokamax.layer_norm(x, scale, offset, subtract_mean=subtract_mean, implementation=impl)
  assert out.shape == shape
  for got, want in zip(grads, (x, scale, offset), strict=True):
    assert (got.shape, got.dtype) == (want.shape, want.dtype)


@pytest.mark.parametrize("impl", ("xla", None))
def test_scale_and_offset_as_python_lists(impl, inputs):
  """scale and offset given as Python lists (as x may be) are converted like arrays: the
  output is the arrays', not an AttributeError of a list where an array was kept."""
  x = inputs.normal((4, 6), 2.0) + 0.5
  scale = [0.5, 1.0, -1.5, 2.0, 0.25, 1.0]
  offset = [0.1, -0.2, 0.0, 0.3, 1.0, -1.0]
  out = tokamax.layer_norm(x, scale, offset, implementation=impl)
  ref = references.high_precision(references.layer_norm)(
    x, jnp.asarray(scale, jnp.float32), jnp.asarray(offset, jnp.float32)
  )
  assert_matches(out, ref)


def test_op_database_gpu_benchmarks_are_the_perf_doc_cases():
  """The op database's GPU layer_norm benchmark calls are the cases of docs/perf.md's layer
  norm table ("layer_norm ROWSxD" for the plain feature, "rms_norm ROWSxD" for rms)."""
  perf = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "perf.md").read_text()
  names = {"plain": "layer_norm", "rms": "rms_norm"}
  calls = opdb.get("layer_norm").bench[opdb.H100]
  assert {c.feature for c in calls} == set(names)
  for call in calls:
    (rows,), d = call.shape["rows"], call.shape["d"]
    assert f"| {names[call.feature]} {rows}x{d} | fwd |" in perf, call
