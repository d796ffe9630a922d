"""gated_linear_unit against the float64 reference."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from suites import opdb
from suites.core.conftest import assert_matches, references
from suites.opdb import base
from tokamax._src.ops.gated_linear_unit import spec as glu_spec

ACTIVATIONS = {"none": None, "swish": jax.nn.swish, "gelu": jax.nn.gelu, "relu": jax.nn.relu}


@pytest.mark.parametrize("impl", ("xla", None))
@pytest.mark.parametrize("fused", (True, False), ids=("fused", "pair"))
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("x_shape", ((13, 24), (2, 3, 24)), ids=("2d", "batched"))
def test_forward_and_gradient(x_shape, activation, fused, impl, inputs):
  act = ACTIVATIONS[activation]
  x = inputs.normal(x_shape)
  w = (
    inputs.normal((24, 2, 19), 0.3)
    if fused
    else (inputs.normal((24, 19), 0.3), inputs.normal((24, 19), 0.3))
  )

  def run(x, w):
    return tokamax.gated_linear_unit(x, w, activation=act, implementation=impl)

  def reference(x, w):
    return references.gated_linear_unit(x, w, activation=act)

  out = run(x, w)
  dout = inputs.normal(out.shape)
  ref_out, ref_grads = references.high_precision_vjp(reference, (x, w), dout)
  assert_matches(out, ref_out, what="output")
  grads = jax.vjp(run, x, w)[1](dout)
  assert_matches(grads[0], ref_grads[0], what="dx")
  for g, r in zip(jax.tree.leaves(grads[1]), jax.tree.leaves(ref_grads[1]), strict=True):
    assert_matches(g, r, what="dweights")


@pytest.mark.parametrize("impl", ("xla", None))
@pytest.mark.parametrize("fused", (True, False), ids=("fused", "pair"))
def test_bfloat16_inputs_give_bfloat16_outputs_and_gradients(fused, impl, inputs):
  """The output and both cotangents have the inputs' dtype (float32 accumulation inside)."""
  bf16 = jnp.bfloat16
  x = inputs.normal((9, 32)).astype(bf16)
  w = (
    inputs.normal((32, 2, 16), 0.3).astype(bf16)
    if fused
    else tuple(inputs.normal((32, 16), 0.3).astype(bf16) for _ in range(2))
  )

  def run(x, w):
    return tokamax.gated_linear_unit(x, w, activation=jax.nn.swish, implementation=impl)

  out, vjp = jax.vjp(run, x, w)
  assert out.dtype == bf16
  dx, dw = vjp(jnp.ones_like(out))
  assert dx.dtype == bf16
  assert all(g.dtype == bf16 for g in jax.tree.leaves(dw))
  ref = references.high_precision(references.gated_linear_unit)(x, w, activation=jax.nn.swish)
  # One bfloat16 rounding (8 significant bits) of O(1) values, and the matmul's input roundings.
  np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "pair"])
def test_partitioning_splits_rows_and_columns_never_k(fused):
  """The sharding rule's labels: each names axes of one size across x, the weights and the
  output (B=2, M=3, K=5, N=7 here); rows and N split, the contracted K never (its shards'
  outputs would be partial sums), nor the [K, 2, N] weights' gate/up axis."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 3, 5)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((5, 2, 7)), jnp.float32)
  record = glu_spec.canonicalize(x, w if fused else (w[:, 0], w[:, 1]))
  rule = glu_spec.partitioning(record)
  leaves = {"x": [x.shape], "weights": [w.shape] if fused else [(5, 7), (5, 7)]}
  labels = {"x": [rule.inputs["x"]], "weights": rule.inputs["weights"]}
  if fused:
    labels["weights"] = [labels["weights"]]
  sizes = {}
  for name in leaves:
    for leaf_labels, shape in zip(labels[name], leaves[name], strict=True):
      assert len(leaf_labels) == len(shape), name
      for label, size in zip(leaf_labels, shape, strict=True):
        if label is not None:
          assert sizes.setdefault(label, size) == size, (name, leaf_labels)
  assert len(rule.output) == 3
  for label, size in zip(rule.output, (2, 3, 7), strict=True):
    assert sizes[label] == size, rule.output
  k_label = rule.inputs["x"][-1]
  assert set(rule.split) == {*rule.output} and k_label not in rule.split
  if fused:
    assert rule.inputs["weights"][1] is None or rule.inputs["weights"][1] not in rule.split


def test_weights_as_a_list_pair_are_the_gate_and_up_weights(inputs):
  """A list [w_gate, w_up] is taken as the pair a tuple is (not stacked into fused weights)."""
  x = inputs.normal((7, 24))
  w_gate, w_up = inputs.normal((24, 19), 0.3), inputs.normal((24, 19), 0.3)
  out = tokamax.gated_linear_unit(x, [w_gate, w_up], activation=jax.nn.swish, implementation="xla")
  ref = references.high_precision(references.gated_linear_unit)(
    x, (w_gate, w_up), activation=jax.nn.swish
  )
  assert_matches(out, ref)


def test_gate_and_up_weights_put_the_gate_first(inputs):
  """Fused [K, 2, N] weights hold the gate at index 0 and the up projection at 1 (as the pair
  holds them in order): `gate_and_up_weights` returns them so, as numpy slices them."""
  w = inputs.normal((24, 2, 19))
  fused = glu_spec.canonicalize(inputs.normal((7, 24)), w).gate_and_up_weights()
  pair = glu_spec.canonicalize(inputs.normal((7, 24)), (w[:, 0], w[:, 1])).gate_and_up_weights()
  for got in (fused, pair):
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(w)[:, 0])
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(w)[:, 1])


@pytest.mark.parametrize("impl", ("xla", None))
@pytest.mark.parametrize(("k", "n"), [(0, 5), (6, 0)], ids=("no_k", "no_n"))
def test_gradient_of_an_empty_contraction_or_output(k, n, impl, inputs):
  """Fused weights [K, 2, N] with K = 0 (a zero output) or N = 0 (an empty one): the
  gradients have the inputs' shapes and are zero, as the reference's, instead of a reshape
  that cannot infer its row count failing."""
  x, w = inputs.normal((2, 3, k)), inputs.normal((k, 2, n))

  def run(x, w):
    return tokamax.gated_linear_unit(x, w, activation=jax.nn.silu, implementation=impl)

  out, vjp = jax.vjp(run, x, w)
  dout = inputs.normal(out.shape)
  ref_out, ref_grads = references.high_precision_vjp(
    lambda x, w: references.gated_linear_unit(x, w, activation=jax.nn.silu), (x, w), dout
  )
  assert_matches(out, ref_out)
  for name, g, ref in zip(("dx", "dweights"), vjp(dout), ref_grads, strict=True):
    assert g.shape == ref.shape, name
    assert_matches(g, ref, what=name)


def test_gpu_benchmark_calls_are_the_cases_of_perf_md():
  """The op database's GPU benchmark calls are the GLU cases docs/perf.md reports (a row
  naming the MxKxN shape and each mode timed), so the benchmarks re-measure its numbers."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  with open(os.path.join(root, "docs", "perf.md")) as f:
    rows = [line for line in f if line.startswith("|")]
  info = opdb.get("gated_linear_unit")
  for family in (base.H100, base.A100):
    for call in info.bench[family]:
      shape = "{m}x{k}x{n}".format(**call.shape)
      for mode in call.modes:
        assert any(shape in r and f"| {mode} |" in r for r in rows), (family, shape, mode)


def test_kernel_case_names_state_their_weights_and_dtype():
  """A kernel case named "..._pair" passes a [K, N] weight pair and one named "..._fused" a
  fused [K, 2, N] array; an "f32_", "f16_" or "bf16_" prefix is its dtype."""
  dtypes = {"f32_": "float32", "f16_": "float16", "bf16_": "bfloat16"}
  for family, cases in opdb.get("gated_linear_unit").kernel_cases.items():
    for name, case in cases.items():
      if "pair" in name.split("_"):
        assert not case.fused, (family, name)
      if "fused" in name.split("_"):
        assert case.fused, (family, name)
      for prefix, dtype in dtypes.items():
        if name.startswith(prefix):
          assert case.dtype == dtype, (family, name)
