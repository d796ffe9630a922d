"""Gradient checks: VJP against a reference VJP, finite differences, determinism."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np

from . import compare, references


def random_like(key: jax.Array, tree):
  """Random normal arrays shaped like the floating leaves of `tree`."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, max(len(leaves), 1))
  out = [
    jax.random.normal(k, np.shape(x), x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    for k, x in zip(keys, leaves, strict=False)
  ]
  return jax.tree.unflatten(treedef, out)


def widen(tree):
  """16-bit floating leaves as float32 (lossless), so references upcast them further."""

  def one(x):
    if (
      hasattr(x, "dtype")
      and jnp.issubdtype(x.dtype, jnp.floating)
      and jnp.dtype(x.dtype).itemsize < 4
    ):
      return jnp.asarray(x, jnp.float32)
    return x

  return jax.tree.map(one, tree)


def vjp(fn: Callable, primals: tuple, cotangent) -> tuple:
  """(out, grads) of `fn` at `primals` for `cotangent`, at the inputs' precision."""
  out, pullback = jax.vjp(fn, *primals)
  cotangent = jax.tree.map(lambda c, o: jnp.asarray(c, o.dtype), cotangent, out)
  return out, pullback(cotangent)


def assert_vjp_close(
  fn: Callable,
  reference: Callable,
  primals: tuple,
  *,
  key: jax.Array,
  plain: Callable | None = None,
  reduction_length: int = 1,
  has_matmul: bool = False,
  names: tuple[str, ...] | None = None,
) -> None:
  """Asserts `fn`'s VJP, and the value it comes with, match `reference`'s (at high
  precision) for a random cotangent.

  Args:
    fn: The function under test, of the differentiable `primals`.
    reference: The independent reference, same signature.
    primals: The differentiable inputs.
    key: Draws the cotangent.
    plain: The same computation done plainly in the input dtype; enables the
      relative rule on the gradients.
    reduction_length: The longest reduction behind a gradient element.
    has_matmul: Whether float32 matmuls are involved.
    names: Names of the primals, for reports.
  """
  shape = jax.eval_shape(fn, *primals)
  cotangent = random_like(key, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape))
  out, grads = vjp(fn, primals, cotangent)
  ref_out, ref_grads = references.high_precision_vjp(reference, widen(primals), widen(cotangent))
  plain_out, plain_grads = vjp(plain, primals, cotangent) if plain is not None else (None, None)
  names = tuple(names or ())
  if len(names) > len(primals):
    raise ValueError(f"{len(names)} names {names} for {len(primals)} primals")
  # Every primal is compared, named or not: a wrong last cotangent must not slip through.
  names = names + tuple(f"arg{i}" for i in range(len(names), len(primals)))
  for what, got in (("the VJP", grads), ("the reference VJP", ref_grads)):
    if len(got) != len(primals):
      raise AssertionError(f"{what} gave {len(got)} cotangents for {len(primals)} primals")
  failures = []
  try:  # The value a training step sees: an implementation's forward under differentiation.
    compare.assert_close(
      out,
      ref_out,
      plain=plain_out,
      reduction_length=reduction_length,
      has_matmul=has_matmul,
      name="the value under differentiation",
    )
  except AssertionError as e:
    failures.append(str(e))
  for i, name in enumerate(names):
    try:
      compare.assert_close(
        grads[i],
        ref_grads[i],
        dtype=jax.tree.leaves(primals[i])[0].dtype,
        plain=None if plain_grads is None else plain_grads[i],
        reduction_length=reduction_length,
        has_matmul=has_matmul,
        gradient=True,
        name=f"d{name}",
      )
    except AssertionError as e:
      failures.append(str(e))
  if failures:
    raise AssertionError("\n".join(failures))


def check_grads(fn: Callable, primals: tuple, *, order: int = 1, eps: float | None = None) -> None:
  """Finite-difference check of `fn`'s reverse-mode gradient (small f32/f64 cases)."""
  dtype = primals[0].dtype
  f64 = dtype == jnp.float64
  atol = rtol = 1e-5 if f64 else 3e-2
  eps = eps or (1e-4 if f64 else 1e-2)
  jax.test_util.check_grads(fn, primals, order=order, modes=("rev",), atol=atol, rtol=rtol, eps=eps)


def assert_deterministic(
  fn: Callable,
  primals: tuple,
  *,
  key: jax.Array,
  runs: int = 2,
  jit: bool = True,
  gradients: bool = True,
) -> None:
  """Asserts outputs (and with `gradients` their VJP) are bitwise equal over `runs` runs."""
  out = jax.eval_shape(fn, *primals)
  cotangent = random_like(key, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out))
  run = (lambda *p: vjp(fn, p, cotangent)) if gradients else fn
  run = jax.jit(run) if jit else run
  first = jax.device_get(run(*primals))
  for _ in range(runs - 1):
    compare.assert_bitwise_equal(
      first, jax.device_get(run(*primals)), name="(out, grads)" if gradients else "out"
    )
