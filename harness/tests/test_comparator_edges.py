"""The comparators at their edges, each against hand-derived numbers.

The fraction rule counts whole elements (1% of 150 is 1.5: one may be off, not
two); a NaN result is an element off with an infinite error; empty arrays
compare equal; a reduction length of 0 is scaled as 1; `relative_error` has no
floor above the tiny one guarding a zero reference; the relative rule's floor
is in ulps of the reference's magnitude (not the result's); a result of the
wrong sign and NaN against an infinity fail; `assert_finite` and
`assert_bitwise_equal` look at every leaf (a leaf missing in one run fails);
`random_like` keeps each leaf's dtype (and a tree without leaves); `widen` is
lossless; the VJP check passes the matmul flag, the reduction length and the
plain computation to the value and to every gradient it compares.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_harness import compare, grads, tolerance

# atol 1, no rtol; the default fraction (99% within the bound) and outlier factor (4x).
_UNIT = tolerance.Tolerance(atol=1.0, rtol=0.0)


def test_the_fraction_rule_rounds_the_allowance_down():
  """1% of 150 elements is 1.5: one element off (by 2x the bound) passes, two fail."""
  e = np.zeros(150)

  def with_off(count):
    return np.where(np.arange(150) < count, 2.0, 0.5)

  assert compare.compare(with_off(1), e, tol=_UNIT).ok
  report = compare.compare(with_off(2), e, tol=_UNIT)
  assert not report.ok and report.num_off == 2
  assert "2 of 150 elements" in report.message


def test_a_nan_result_is_an_element_off_with_an_infinite_error():
  e = np.zeros(4)
  report = compare.compare(np.array([np.nan, 0.0, 0.0, 0.0]), e, tol=_UNIT)
  assert not report.ok
  assert report.num_off == 1
  assert report.max_error == np.inf
  assert report.mean_error == 0.0  # Over the three finite errors.


def test_empty_arrays_compare_equal():
  (report,) = compare.assert_close(np.zeros((0, 3)), np.zeros((0, 3)), tol=_UNIT)
  assert report.ok and report.size == 0 and report.num_off == 0
  with pytest.raises(AssertionError, match="shape"):
    compare.assert_close(np.zeros((0, 3)), np.zeros((0, 4)), tol=_UNIT)


def test_a_reduction_length_of_zero_is_scaled_as_one():
  tol = tolerance.Tolerance(atol=0.5, rtol=0.0, fraction=1.0)
  np.testing.assert_array_equal(tol.bound(np.zeros(2), 0), [0.5, 0.5])
  compare.assert_close(np.full(4, 0.4), np.zeros(4), tol=tol, reduction_length=0)


def test_a_bound_without_a_reduction_length_is_the_elementwise_one():
  """No reduction length given: L = 1, so the bound is atol + rtol * |expected|, unscaled."""
  tol = tolerance.Tolerance(atol=0.5, rtol=0.25)
  np.testing.assert_allclose(tol.bound(np.array([0.0, -2.0])), [0.5, 1.0], rtol=1e-15)


def test_relative_error_of_a_small_reference():
  """||a - e|| / ||e|| is scale-free: 1 for a result twice a reference of norm 1e-3."""
  e = np.array([1e-3, 0.0])
  assert compare.relative_error(2.0 * e, e) == pytest.approx(1.0, rel=1e-12)
  tiny = np.array([3e-20, 4e-20])  # Norm 5e-20.
  assert compare.relative_error(tiny + np.array([0.0, 5e-21]), tiny) == pytest.approx(0.1)


def test_the_relative_rule_floor_is_in_ulps_of_the_reference_not_the_result():
  """bfloat16, exact plain computation, L = 10^4: the floor is 2 ulps (2^-6) x max |ref| 0.01
  x L^(1/4) 10 = 0.0015625. An error of 0.0017 on the largest element fails it, although 2
  ulps of the result's magnitude (0.0117) would allow 0.00183; the table's bound (0.2) is far
  away."""
  e = np.zeros(64)
  e[0] = 0.01
  length = 10_000
  floor = 2.0 * 2.0**-7 * 0.01 * length**0.25
  ok = e.copy()
  ok[0] += 0.9 * floor
  compare.assert_close(ok, e, dtype="bfloat16", reduction_length=length, plain=e)
  bad = e.copy()
  bad[0] += 0.0017
  with pytest.raises(AssertionError, match="relative rule"):
    compare.assert_close(bad, e, dtype="bfloat16", reduction_length=length, plain=e)


def test_the_relative_rule_floor_is_in_ulps_of_the_references_absolute_magnitude():
  """As above with a negative reference: max |ref| is 0.01 (its signed max is 0), so the same
  floor 0.0015625 allows an error of 0.9 of it on that element, and 0.0017 still fails."""
  e = np.zeros(64)
  e[0] = -0.01
  length = 10_000
  floor = 2.0 * 2.0**-7 * 0.01 * length**0.25
  ok = e.copy()
  ok[0] -= 0.9 * floor
  compare.assert_close(ok, e, dtype="bfloat16", reduction_length=length, plain=e)
  bad = e.copy()
  bad[0] -= 0.0017
  with pytest.raises(AssertionError, match="relative rule"):
    compare.assert_close(bad, e, dtype="bfloat16", reduction_length=length, plain=e)


def test_assert_finite_checks_every_leaf():
  with pytest.raises(AssertionError, match=r"out\['b'\]: NaN 1, Inf 0"):
    compare.assert_finite({"a": np.ones(3), "b": np.array([1.0, np.nan])}, name="out")
  with pytest.raises(AssertionError, match=r"out\[2\]: NaN 0, Inf 1"):
    compare.assert_finite((np.ones(2), None, np.array([np.inf])), name="out")


def test_assert_bitwise_equal_needs_as_many_leaves():
  x = np.arange(3.0)
  compare.assert_bitwise_equal((x, x), (x.copy(), x.copy()))
  with pytest.raises((AssertionError, ValueError)):
    compare.assert_bitwise_equal((x, x), (x,))
  with pytest.raises((AssertionError, ValueError)):
    compare.assert_bitwise_equal((x,), (x, x))


def test_random_like_keeps_each_leafs_dtype():
  tree = {"b": jnp.zeros((8,), jnp.bfloat16), "h": jnp.zeros((8,), jnp.float16)}
  out = grads.random_like(jax.random.key(0), tree)
  assert out["b"].dtype == jnp.bfloat16 and out["h"].dtype == jnp.float16


def test_random_like_of_a_tree_without_leaves_is_that_tree():
  for tree in ((), {}, {"a": None}):
    assert grads.random_like(jax.random.key(0), tree) == tree


def test_widen_turns_16_bit_floats_into_float32_losslessly():
  """float16 and bfloat16 leaves become float32 holding the same numbers; others are kept."""
  h = np.array([1 + 2**-10, 65504.0, 2**-24], np.float16)  # The first two do not fit a bfloat16.
  b = np.array([1 + 2**-7, 3e38, -(2**-133)], jnp.bfloat16)  # The last two do not fit a float16.
  f = np.array([1 + 2**-23, 0.1], np.float32)
  i = np.array([3, -4], np.int32)
  out = grads.widen({"h": jnp.asarray(h), "b": jnp.asarray(b), "f": jnp.asarray(f), "i": i})
  for name, x in (("h", h), ("b", b), ("f", f)):
    assert out[name].dtype == np.float32, name
    np.testing.assert_array_equal(np.asarray(out[name]), x.astype(np.float64), err_msg=name)
  assert out["i"].dtype == np.int32
  np.testing.assert_array_equal(out["i"], i)


def _plus(offset, gradient_offset):
  """2x + offset whose reverse-mode gradient is 2g + gradient_offset (planted errors)."""

  @jax.custom_vjp
  def f(x):
    return 2.0 * x + offset

  def fwd(x):
    return f(x), None

  def bwd(_, g):
    return (2.0 * g + gradient_offset,)

  f.defvjp(fwd, bwd)
  return f


def test_vjp_check_gives_value_and_gradients_the_gpu_matmul_bound(monkeypatch):
  """On a GPU (the lookup told so), a float32 matmul op gets atol 5e-4, rtol 2e-3 (x2 for
  gradients). Value and gradient 2e-4 off pass with has_matmul, fail the plain float32 row."""
  for_dtype = tolerance.for_dtype
  monkeypatch.setattr(
    tolerance, "for_dtype", lambda dtype, *, platform, **kw: for_dtype(dtype, platform="gpu", **kw)
  )
  x = jnp.linspace(-1.0, 1.0, 128, dtype=jnp.float32)
  key = jax.random.key(0)
  grads.assert_vjp_close(_plus(2e-4, 0.0), _plus(0.0, 0.0), (x,), key=key, has_matmul=True)
  grads.assert_vjp_close(_plus(0.0, 2e-4), _plus(0.0, 0.0), (x,), key=key, has_matmul=True)
  with pytest.raises(AssertionError, match="value under differentiation"):
    grads.assert_vjp_close(_plus(2e-4, 0.0), _plus(0.0, 0.0), (x,), key=key)
  with pytest.raises(AssertionError, match="dx"):
    grads.assert_vjp_close(_plus(0.0, 2e-4), _plus(0.0, 0.0), (x,), key=key, names=("x",))


def test_assert_close_takes_the_plain_float32_row_unless_told_of_a_matmul():
  """On a GPU a float32 result 2e-4 off (of values within 1) exceeds the plain float32 row
  (atol 2e-6, rtol 1e-5) but not the matmul row (atol 5e-4): `has_matmul` defaults to False."""
  e = np.linspace(-1.0, 1.0, 128, dtype=np.float32)
  a = e + np.float32(2e-4)
  compare.assert_close(a, e, platform="gpu", has_matmul=True)
  with pytest.raises(AssertionError, match="exceed the bound"):
    compare.assert_close(a, e, platform="gpu")


def test_vjp_check_scales_the_gradient_bound_by_the_reduction_length():
  """Gradients of 1e-6 x (rtol negligible) 2e-5 off: within 2 x atol 2e-6 x sqrt(100) = 4e-5,
  past 4x the bound at length 1 (1.6e-5)."""
  x = jnp.linspace(-1.0, 1.0, 128, dtype=jnp.float32)

  def reference(x):
    return 1e-6 * x

  @jax.custom_vjp
  def off(x):
    return 1e-6 * x

  off.defvjp(lambda x: (off(x), None), lambda _, g: (1e-6 * g + 2e-5,))
  key = jax.random.key(1)
  grads.assert_vjp_close(off, reference, (x,), key=key, reduction_length=100)
  with pytest.raises(AssertionError, match="dx"):
    grads.assert_vjp_close(off, reference, (x,), key=key, reduction_length=1, names=("x",))


def test_vjp_check_applies_the_relative_rule_to_the_value():
  """bfloat16 2x + 0.0015 for x in [-0.025, 0.025]: inside the table (atol 2e-3), past the
  relative rule's floor (2 ulps of max |ref| 0.05 = 7.8e-4; the plain 2x is exact)."""
  x = jnp.linspace(-0.025, 0.025, 128).astype(jnp.bfloat16)
  key = jax.random.key(2)
  exact = _plus(0.0, 0.0)
  off = _plus(0.0015, 0.0)
  grads.assert_vjp_close(off, exact, (x,), key=key)  # The table alone lets it pass ...
  with pytest.raises(AssertionError, match="relative rule"):  # ... the relative rule does not.
    grads.assert_vjp_close(off, exact, (x,), key=key, plain=exact)


def test_a_result_of_the_wrong_sign_fails():
  """|a - e|, not ||a| - |e||: -e against e is off by 2|e| everywhere."""
  e = np.linspace(0.5, 1.0, 16)
  report = compare.compare(-e, e, tol=tolerance.TABLE["float32"])
  assert not report.ok and report.num_off == 16
  assert report.max_error == pytest.approx(2.0)


def test_assert_bitwise_equal_fails_on_a_leaf_missing_in_one_run():
  x = np.arange(3.0)
  compare.assert_bitwise_equal((x, None), (x.copy(), None))  # Absent in both runs: fine.
  with pytest.raises(AssertionError):
    compare.assert_bitwise_equal((x, None), (x, x))
  with pytest.raises(AssertionError):
    compare.assert_bitwise_equal((x, x), (x, None))


@pytest.mark.parametrize(("actual", "expected"), [(np.nan, np.inf), (np.nan, -np.inf)])
def test_nan_against_an_infinity_fails(actual, expected):
  """NaN and Inf are different non-finite values: neither matches the other."""
  e = np.array([0.0, expected, 1.0])
  a = np.array([0.0, actual, 1.0])
  with pytest.raises(AssertionError, match="NaN or Inf on one side only"):
    compare.assert_close(a, e, tol=_UNIT)
  with pytest.raises(AssertionError, match="NaN or Inf on one side only"):
    compare.assert_close(e, a, tol=_UNIT)
  assert compare.relative_error(a, e) == np.inf
