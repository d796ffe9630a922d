"""The comparators' remaining rules, each against hand-derived numbers.

`relative_error` is ||a - e|| / ||e||; the element bound is relative to the
reference, not to the result; a zero tolerance accepts exact results; a leaf
missing on one side, another pytree structure or another shape with the same
bytes fails; the determinism check runs the function again and compares every
run; the finite-difference check and `random_like` keep their contracts.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_harness import compare, grads, tolerance


def test_relative_error_is_the_norm_of_the_difference_over_the_reference():
  e = np.array([3.0, 4.0])  # ||e|| = 5.
  assert compare.relative_error(e + np.array([0.0, 0.5]), e) == pytest.approx(0.1, rel=1e-12)
  assert compare.relative_error(2.0 * e, e) == pytest.approx(1.0, rel=1e-12)
  assert compare.relative_error(np.zeros(2), e) == pytest.approx(1.0, rel=1e-12)
  assert compare.relative_error(e, e) == 0.0


def test_the_bound_is_relative_to_the_reference_not_the_result():
  """rtol = 0.5 of |reference| = 1: an error of 0.4 passes, 0.9 fails (0.9 < 0.5 * |1.9|)."""
  tol = tolerance.Tolerance(atol=0.0, rtol=0.5, fraction=1.0, outlier_factor=100.0)
  e = np.ones(16)
  compare.assert_close(e - 0.4, e, tol=tol)  # 0.4 <= 0.5 (it would exceed 0.5 * |0.6| = 0.3).
  with pytest.raises(AssertionError, match="exceed the bound"):
    compare.assert_close(e + 0.9, e, tol=tol)


def test_a_zero_tolerance_accepts_exact_results_only():
  exact = tolerance.Tolerance(atol=0.0, rtol=0.0, fraction=1.0)
  e = np.linspace(-1.0, 1.0, 32)
  compare.assert_close(e.copy(), e, tol=exact)
  compare.assert_close(np.zeros(4), np.zeros(4), tol=exact)
  with pytest.raises(AssertionError, match="1 of 32 elements"):
    compare.assert_close(np.where(np.arange(32) == 5, np.nextafter(e, 2.0), e), e, tol=exact)


def test_a_leaf_missing_on_one_side_fails():
  e = {"out": np.ones(4), "lse": np.zeros(2)}
  with pytest.raises(AssertionError, match="one side is None"):
    compare.assert_close({"out": np.ones(4), "lse": None}, e, tol=tolerance.TABLE["float64"])
  with pytest.raises(AssertionError, match="one side is None"):
    compare.assert_close(e, {"out": np.ones(4), "lse": None}, tol=tolerance.TABLE["float64"])
  # None on both sides (an absent residual, a non-differentiable input) is not compared.
  compare.assert_close(
    {"out": np.ones(4), "lse": None},
    {"out": np.ones(4), "lse": None},
    tol=tolerance.TABLE["float64"],
  )


def test_another_pytree_structure_fails_even_with_as_many_leaves():
  a = {"out": np.ones(4), "lse": np.zeros(2)}
  e = {"out": np.ones(4), "max": np.zeros(2)}
  with pytest.raises(AssertionError, match="structure"):
    compare.assert_close(a, e, tol=tolerance.TABLE["float64"])


def test_bitwise_equal_needs_the_same_shape():
  x = np.arange(6, dtype=np.float32).reshape(2, 3)
  with pytest.raises(AssertionError, match=r"\(2, 3\)"):
    compare.assert_bitwise_equal(x, x.reshape(3, 2))
  with pytest.raises(AssertionError, match="float64"):
    compare.assert_bitwise_equal(x, x.astype(np.float64))


def _drifting(from_run: int):
  """x + 1 from the `from_run`-th run on (1-based, traces not counted): nondeterministic."""
  runs = itertools.count(1)

  def fn(x):
    if isinstance(x, jax.core.Tracer):  # `assert_deterministic` traces it for the output shape.
      return x
    return x + (1.0 if next(runs) >= from_run else 0.0)

  return fn


@pytest.mark.parametrize("runs", [2, 3])
def test_assert_deterministic_compares_every_run(runs):
  x = jnp.arange(4.0)
  key = jax.random.key(0)
  grads.assert_deterministic(
    lambda x: x * 2.0, (x,), key=key, runs=runs, jit=False, gradients=False
  )
  # Differs on the last run only: every run must be compared with the first.
  with pytest.raises(AssertionError, match="not deterministic"):
    grads.assert_deterministic(
      _drifting(runs), (x,), key=key, runs=runs, jit=False, gradients=False
    )


def _counting(calls: list[int]):
  """x * 2 that counts its calls with concrete arrays (traces excluded) in `calls[0]`."""

  def fn(x):
    if not isinstance(x, jax.core.Tracer):
      calls[0] += 1
    return x * 2.0

  return fn


@pytest.mark.parametrize("runs", [2, 3])
def test_assert_deterministic_runs_the_function_runs_times_and_compiles_by_default(runs):
  """Its docstring's "over `runs` runs": eagerly (jit=False) the function runs exactly `runs`
  times; by default (jit=True) every run is the compiled program, which sees only tracers."""
  x = jnp.arange(4.0)
  key = jax.random.key(0)
  eager = [0]
  grads.assert_deterministic(_counting(eager), (x,), key=key, runs=runs, jit=False, gradients=False)
  assert eager[0] == runs
  compiled = [0]
  grads.assert_deterministic(_counting(compiled), (x,), key=key, runs=runs, gradients=False)
  assert compiled[0] == 0


def _scaled_gradient(fn, factor):
  """`fn` whose reverse-mode gradient is `factor` times the true one (a planted bug)."""

  @jax.custom_vjp
  def f(x):
    return fn(x)

  def fwd(x):
    return fn(x), x

  def bwd(x, g):
    (dx,) = jax.vjp(fn, x)[1](g)
    return (dx * factor,)

  f.defvjp(fwd, bwd)
  return f


def _sum_sin(x):
  return jnp.sum(jnp.sin(x))


def test_check_grads_float64_catches_a_gradient_off_by_1e_4():
  """The float64 finite-difference tolerance is 1e-5: a 1e-4 relative error fails."""
  with jax.enable_x64(True):
    x = jnp.linspace(0.1, 1.5, 16, dtype=jnp.float64)
    grads.check_grads(_scaled_gradient(_sum_sin, 1.0), (x,))
    with pytest.raises(AssertionError):
      grads.check_grads(_scaled_gradient(_sum_sin, 1.0 + 1e-4), (x,))


def test_check_grads_float32_catches_a_gradient_off_by_10_percent():
  """The float32 finite-difference tolerance is 3e-2: a 10% error fails."""
  x = jnp.linspace(0.1, 1.5, 16, dtype=jnp.float32)
  grads.check_grads(_scaled_gradient(_sum_sin, 1.0), (x,))
  with pytest.raises(AssertionError):
    grads.check_grads(_scaled_gradient(_sum_sin, 1.1), (x,))


@pytest.mark.parametrize("scale", [1.0, 10.0])
def test_check_grads_float32_tolerance_is_relative_too(scale):
  """3e-2 absolute and relative: a gradient 1% off passes at any scale of the function (jax's
  own float32 default, 2e-3, would fail it), and 10% off fails."""
  x = jnp.linspace(0.1, 1.5, 16, dtype=jnp.float32)

  def fn(v):
    return scale * _sum_sin(v)

  grads.check_grads(_scaled_gradient(fn, 1.01), (x,))
  with pytest.raises(AssertionError):
    grads.check_grads(_scaled_gradient(fn, 1.1), (x,))


def test_random_like_draws_each_leaf_independently():
  tree = {"a": jnp.zeros((64,)), "b": jnp.zeros((64,)), "i": jnp.zeros((3,), jnp.int32)}
  out = grads.random_like(jax.random.key(0), tree)
  a, b = np.asarray(out["a"]), np.asarray(out["b"])
  assert not np.array_equal(a, b)  # Cotangents of two outputs are not the same draw.
  assert 0.5 < a.std() < 1.5 and 0.5 < b.std() < 1.5
  np.testing.assert_array_equal(np.asarray(out["i"]), 0)  # Integer leaves are kept.


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64])
def test_no_tolerance_for_dtypes_outside_the_table(dtype):
  """Integers are compared exactly elsewhere; no float row may silently stand in."""
  with pytest.raises(KeyError, match="no tolerance"):
    tolerance.for_dtype(dtype)


def _times_two(x):
  return x * 2.0  # Exact in bfloat16: the plain computation has no error.


# x * 2 whose gradient is 2.3% too large: inside bfloat16's gradient bound (rtol 3.2e-2)
# where |ref| is large, outside the relative rule (2 x the plain error, here 0, + 2 ulps =
# 1.6% of max |ref|).
_gradient_off_by_2_percent = _scaled_gradient(_times_two, 1.023)


def test_vjp_check_applies_the_relative_rule_to_gradients():
  x = jax.random.normal(jax.random.key(0), (256,)).astype(jnp.bfloat16)
  key = jax.random.key(1)
  grads.assert_vjp_close(_times_two, _times_two, (x,), key=key, plain=_times_two)
  bad = _gradient_off_by_2_percent
  grads.assert_vjp_close(bad, _times_two, (x,), key=key)  # The table alone lets it pass ...
  with pytest.raises(AssertionError, match="relative rule"):  # ... the relative rule does not.
    grads.assert_vjp_close(bad, _times_two, (x,), key=key, plain=_times_two)


def test_report_of_known_errors():
  """Errors 0.0 .. 0.9 in a shuffled order: max 0.9 at its index, mean 0.45, 7 above 0.25."""
  errors = np.array([0.3, 0.1, 0.0, 0.9, 0.5, 0.2, 0.7, 0.4, 0.8, 0.6]).reshape(2, 5)
  e = np.linspace(-1.0, 1.0, 10).reshape(2, 5)
  tol = tolerance.Tolerance(atol=0.25, rtol=0.0, fraction=0.0, outlier_factor=np.inf)
  report = compare.compare(e + errors, e, tol=tol, name="out")
  assert report.ok
  assert report.max_error == pytest.approx(0.9, rel=1e-12)
  assert report.mean_error == pytest.approx(0.45, rel=1e-12)
  assert (report.num_off, report.size) == (7, 10)
  # The worst element is (0, 3), not the first one off (0, 0).
  assert "max abs error 0.9 at (0, 3)" in report.message
  assert "first indices [(0, 0), (0, 3), (0, 4)" in report.message


def test_report_of_too_many_elements_off_gives_their_share():
  """3 of 8 elements off by 0.5 against a bound of 0.25: 37.5% off, 10% allowed."""
  e = np.zeros(8)
  a = np.array([0.5, 0.0, 0.5, 0.0, 0.0, 0.5, 0.0, 0.0])
  tol = tolerance.Tolerance(atol=0.25, rtol=0.0, fraction=0.9, outlier_factor=np.inf)
  report = compare.compare(a, e, tol=tol, name="out")
  assert not report.ok
  assert "3 of 8 elements (37.5%) exceed the bound; at most 10% may" in report.message


def test_mean_error_is_over_the_finite_errors():
  e = np.zeros(4)
  a = np.array([0.2, 0.4, np.inf, 0.0])
  report = compare.compare(a, e, tol=tolerance.Tolerance(atol=1.0, rtol=0.0))
  assert not report.ok and report.max_error == np.inf
  assert report.mean_error == pytest.approx(0.2, rel=1e-12)  # (0.2 + 0.4 + 0.0) / 3.


def _off_by(factor):
  return _scaled_gradient(lambda x: x * 2.0, factor)


def test_vjp_check_compares_gradients_at_twice_the_forward_bound():
  """float32 gradients of 2x: the gradient bound is 2 x (2e-6 + 1e-5 |ref|).

  A gradient 1.5e-5 too large relatively is outside the forward bound for most elements
  (3e-5 |ct| > 2e-6 + 2e-5 |ct| where |ct| > 0.2) but inside the gradient bound
  (4e-6 + 4e-5 |ct|); one 2.5e-5 too large is outside both where |ct| > 0.4.
  """
  x = jnp.linspace(0.5, 1.5, 256, dtype=jnp.float32)
  key = jax.random.key(4)
  grads.assert_vjp_close(_off_by(1.0 + 1.5e-5), lambda x: x * 2.0, (x,), key=key)
  with pytest.raises(AssertionError, match="dx"):
    grads.assert_vjp_close(_off_by(1.0 + 2.5e-5), lambda x: x * 2.0, (x,), key=key, names=("x",))


def _nondeterministic_backward():
  """x * 2 whose gradient drifts by 1 from the second backward pass on; the forward is fixed."""
  calls = itertools.count()

  @jax.custom_vjp
  def f(x):
    return x * 2.0

  def fwd(x):
    return x * 2.0, None

  def bwd(_, g):
    return (g * 2.0 + (1.0 if next(calls) > 0 else 0.0),)

  f.defvjp(fwd, bwd)
  return f


def test_assert_deterministic_runs_the_backward_pass():
  x = jnp.arange(4.0)
  key = jax.random.key(0)
  fn = _nondeterministic_backward()
  grads.assert_deterministic(fn, (x,), key=key, jit=False, gradients=False)  # Forward: fixed.
  with pytest.raises(AssertionError, match="not deterministic"):
    grads.assert_deterministic(_nondeterministic_backward(), (x,), key=key, jit=False)


@jax.custom_jvp
def _cube_with_a_flat_second_derivative(x):
  return x**3


@_cube_with_a_flat_second_derivative.defjvp
def _cube_jvp(primals, tangents):
  """The right first derivative 3x^2, but no derivative of it (stop_gradient): f'' = 0, not 6x."""
  (x,), (t,) = primals, tangents
  return _cube_with_a_flat_second_derivative(x), 3 * jax.lax.stop_gradient(x) ** 2 * t


def test_check_grads_checks_the_order_asked_for():
  x = jnp.linspace(0.5, 1.5, 8, dtype=jnp.float32)
  grads.check_grads(lambda x: jnp.sum(_cube_with_a_flat_second_derivative(x)), (x,), order=1)
  with pytest.raises(AssertionError):
    grads.check_grads(lambda x: jnp.sum(_cube_with_a_flat_second_derivative(x)), (x,), order=2)


def test_check_grads_uses_the_step_asked_for():
  """sin(100 x): a central difference's relative error is (100 eps)^2 / 6 per unit step,
  17% at the float32 default eps of 1e-2 (past 3e-2), 0.17% at eps = 1e-3."""
  x = jnp.linspace(0.1, 0.2, 4, dtype=jnp.float32)

  def f(x):
    return jnp.sum(jnp.sin(100 * x))

  grads.check_grads(f, (x,), eps=1e-3)
  with pytest.raises(AssertionError):
    grads.check_grads(f, (x,))


def test_check_grads_float32_default_step_passes_a_curved_gradient():
  """sin(20 x), the right gradient: along jax's fixed random tangent the central difference is
  off by 2.0% at the float32 default eps of 1e-2 (within 3e-2, computed by hand in float64),
  and by 7.8% at eps = 2e-2: a coarser default step fails a correct gradient."""
  x = jnp.linspace(0.1, 0.2, 4, dtype=jnp.float32)
  grads.check_grads(lambda x: jnp.sum(jnp.sin(20 * x)), (x,))


def test_vjp_check_scales_the_value_bound_by_the_reduction_length():
  """A value 1e-5 (5 float32 atol) off: within atol x sqrt(100), past atol at length 1."""
  x = jax.random.normal(jax.random.key(0), (256,), jnp.float32)

  def reference(x):
    return 2 * x

  def off(x):
    return 2 * x + 1e-5

  grads.assert_vjp_close(off, reference, (x,), key=jax.random.key(1), reduction_length=100)
  with pytest.raises(AssertionError, match="value under differentiation"):
    grads.assert_vjp_close(off, reference, (x,), key=jax.random.key(1), reduction_length=1)
