"""The comparators' own teeth: NaN/Inf and every cotangent.

A NaN or Inf on one side only fails `assert_close` (and `relative_error`)
by itself, however loose the tolerance and without `assert_finite`. The VJP
check compares every cotangent, pytree leaves included, and names the wrong
one: planted-bug copies that break only the last cotangent (doffset, the
second GLU weight) are caught.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from suites import matrices
from suites.matrices import checks
from tokamax_harness import compare, grads, references, tolerance

# Loose enough that only the finiteness rule can fail a comparison.
LOOSE = tolerance.Tolerance(atol=1e30, rtol=1e30, fraction=0.0, outlier_factor=math.inf)


def _expected():
  return np.linspace(-1.0, 1.0, 64).reshape(8, 8)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("side", ["actual", "expected"])
def test_nonfinite_on_one_side_fails_by_itself(bad, side):
  e = _expected()
  a = e.copy()
  (a if side == "actual" else e)[3, 5] = bad
  with pytest.raises(AssertionError, match=r"NaN or Inf on one side only.*\(3, 5\)"):
    compare.assert_close(a, e, tol=LOOSE, name="out")
  # The default policy too, at every dtype.
  for dtype in tolerance.TABLE:
    assert not compare.compare(a, e, tol=tolerance.TABLE[dtype]).ok
  assert compare.relative_error(a, e) == math.inf


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_nan_in_a_low_precision_output_fails(dtype):
  e = _expected()
  a = jnp.asarray(e, dtype).at[0, 0].set(jnp.nan)
  with pytest.raises(AssertionError, match="NaN 1"):
    compare.assert_close(a, e, dtype=dtype)


def test_opposite_infinities_fail_and_equal_nonfinite_values_pass():
  e = _expected()
  e[0, 0], e[1, 1], e[2, 2] = np.inf, -np.inf, np.nan
  a = e.copy()
  compare.assert_close(a, e, tol=tolerance.TABLE["float64"])
  assert compare.relative_error(a, e) == 0.0
  a[0, 0] = -np.inf
  with pytest.raises(AssertionError, match="one side only"):
    compare.assert_close(a, e, tol=LOOSE)
  assert compare.relative_error(a, e) == math.inf


def test_nan_in_one_leaf_of_a_pytree_names_the_leaf():
  e = {"out": _expected(), "lse": _expected()[:, 0]}
  a = {"out": e["out"], "lse": e["lse"].copy()}
  a["lse"][-1] = np.nan
  with pytest.raises(AssertionError, match=r"res\['lse'\]") as failure:
    compare.assert_close(a, e, tol=LOOSE, name="res")
  assert "res['out']" not in str(failure.value)


def test_another_shape_fails_even_where_it_broadcasts():
  e = _expected()
  a = e[:1]  # [1, 8] against [8, 8]: broadcasting would compare row 0 with every row.
  e_same = np.broadcast_to(a, e.shape)
  report = compare.compare(a, e_same, tol=LOOSE)
  assert not report.ok and "shape" in report.message
  with pytest.raises(AssertionError, match="shape"):
    compare.assert_close(a, e_same, tol=LOOSE)
  assert compare.relative_error(a, e_same) == math.inf


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_assert_finite_catches_every_nonfinite_value(bad):
  a = _expected().copy()
  compare.assert_finite(a)
  a[3, 5] = bad
  with pytest.raises(AssertionError, match=r"\(3, 5\)"):
    compare.assert_finite(a, name="out")


def test_assert_bitwise_equal_compares_bits():
  a = np.array([0.0, 1.0, np.nan], np.float32)
  compare.assert_bitwise_equal(a, a.copy())  # The same NaN bits are equal.
  with pytest.raises(AssertionError, match="not deterministic"):
    compare.assert_bitwise_equal(a, np.array([-0.0, 1.0, np.nan], np.float32))
  with pytest.raises(AssertionError, match="not deterministic"):
    compare.assert_bitwise_equal(a, np.nextafter(a, np.float32(2)))


# --- Every cotangent --------------------------------------------------------------


def with_wrong_cotangent(fn, index: int, leaf: int = 0, factor: float = 1.5):
  """`fn` whose VJP scales leaf `leaf` of cotangent `index` by `factor` (a planted bug)."""

  @jax.custom_vjp
  def wrong(*primals):
    return fn(*primals)

  def fwd(*primals):
    out, pullback = jax.vjp(fn, *primals)
    return out, pullback

  def bwd(pullback, g):
    cts = list(pullback(g))
    leaves, treedef = jax.tree.flatten(cts[index])
    leaves[leaf] = leaves[leaf] * factor
    cts[index] = jax.tree.unflatten(treedef, leaves)
    return tuple(cts)

  wrong.defvjp(fwd, bwd)
  return wrong


def _norm(x, scale, offset):
  return references.layer_norm(x, scale, offset)


def _norm_primals():
  k = jax.random.split(jax.random.key(0), 3)
  return (
    jax.random.normal(k[0], (6, 32)) + 0.5,
    1.0 + 0.2 * jax.random.normal(k[1], (32,)),
    0.2 * jax.random.normal(k[2], (32,)),
  )


def test_correct_vjp_passes():
  grads.assert_vjp_close(_norm, _norm, _norm_primals(), key=jax.random.key(1))


@pytest.mark.parametrize(("index", "name"), [(0, "dx"), (1, "dscale"), (2, "doffset")])
def test_each_wrong_cotangent_is_caught_and_named(index, name):
  bad = with_wrong_cotangent(_norm, index)
  with pytest.raises(AssertionError, match=name) as failure:
    grads.assert_vjp_close(
      bad, _norm, _norm_primals(), key=jax.random.key(1), names=("x", "scale", "offset")
    )
  others = {"dx", "dscale", "doffset"} - {name}
  assert not any(f"{o}:" in str(failure.value) for o in others)


def test_wrong_last_cotangent_is_caught_without_names():
  bad = with_wrong_cotangent(_norm, 2)
  with pytest.raises(AssertionError, match="darg2"):
    grads.assert_vjp_close(bad, _norm, _norm_primals(), key=jax.random.key(1))
  # Names for a prefix only: the rest is still compared.
  with pytest.raises(AssertionError, match="darg2"):
    grads.assert_vjp_close(bad, _norm, _norm_primals(), key=jax.random.key(1), names=("x",))


def test_too_many_names_is_an_error():
  with pytest.raises(ValueError, match="names"):
    grads.assert_vjp_close(
      _norm, _norm, _norm_primals(), key=jax.random.key(1), names=("x", "scale", "offset", "z")
    )


def test_missing_cotangent_is_caught():
  def drops_last(x, scale, offset):
    return _norm(x, scale, jax.lax.stop_gradient(offset))

  with pytest.raises(AssertionError, match="doffset"):
    grads.assert_vjp_close(
      drops_last, _norm, _norm_primals(), key=jax.random.key(1), names=("x", "scale", "offset")
    )


def _glu(x, weights):
  return references.gated_linear_unit(x, weights, activation=jax.nn.silu)


def test_wrong_second_weight_of_a_weight_tuple_is_caught():
  k = jax.random.split(jax.random.key(2), 3)
  x = jax.random.normal(k[0], (8, 16))
  weights = (0.25 * jax.random.normal(k[1], (16, 8)), 0.25 * jax.random.normal(k[2], (16, 8)))
  grads.assert_vjp_close(_glu, _glu, (x, weights), key=jax.random.key(3), names=("x", "weights"))
  bad = with_wrong_cotangent(_glu, 1, leaf=1)
  with pytest.raises(AssertionError, match=r"dweights\[1\]") as failure:
    grads.assert_vjp_close(bad, _glu, (x, weights), key=jax.random.key(3), names=("x", "weights"))
  assert "dweights[0]" not in str(failure.value)


# --- Through the suites' check_vjp -------------------------------------------------


def _case(op, feature):
  return next(
    c
    for c in matrices.for_family("cpu", op=op)
    if c.feature == feature and c.dtype == "float32" and c.kind == matrices.NATIVE
  )


def _impl_with_wrong_cotangent(case, index, leaf=0):
  xla = matrices.resolve(case.spec, "xla")

  def impl(*args, **kwargs):
    diff = case.builder_diff(args)

    def f(*primals):
      full = list(args)
      for i, p in zip(diff, primals, strict=True):
        full[i] = p
      return xla(*full, **kwargs)

    return with_wrong_cotangent(f, index, leaf)(*(args[i] for i in diff))

  impl.name = f"wrong_cotangent_{index}_{leaf}"
  return impl


def test_check_vjp_catches_a_wrong_doffset():
  case = _case("layer_norm", "plain")
  checks.check_vjp(case, matrices.resolve(case.spec, "xla"))
  with pytest.raises(AssertionError, match="doffset"):
    checks.check_vjp(case, _impl_with_wrong_cotangent(case, 2))


def test_check_vjp_catches_a_wrong_second_split_weight():
  case = _case("gated_linear_unit", "split_weights")
  with pytest.raises(AssertionError, match=r"dweights\[1\]"):
    checks.check_vjp(case, _impl_with_wrong_cotangent(case, 1, leaf=1))
