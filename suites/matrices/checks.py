"""The checks every suite runs on a (case, implementation) pair.

Each takes the case and a callable with the op's public signature (an
`Implementation`, or any function: the teeth tests pass planted-bug copies)
and raises `AssertionError` with the comparator's report when it fails.
"""

import dataclasses

import jax
import pytest

from suites.matrices import cases as cases_lib
from tokamax_harness import compare, grads, tolerance
from tokamax_harness import plugin as harness_plugin


def case_key(case: cases_lib.Case) -> jax.Array:
  """The same inputs for a case whichever implementation is checked."""
  return harness_plugin.key_for(f"{case.op}/{case.family}/{case.id}")


def skip_unsupported(impl, args: tuple, kwargs: dict) -> None:
  """Skips the test with the implementation's reason if it cannot take this call."""
  reason_fn = getattr(impl, "unsupported_reason", None)
  if reason_fn is None:
    return
  reason = reason_fn(args, kwargs)
  if reason is not None:
    pytest.skip(f"{_label(impl)}: {reason}")


def skip_eager_gradients(impl) -> None:
  """Triton's host interpreter runs eager calls only; `custom_vjp` traces its functions."""
  if getattr(impl, "eager", False):
    pytest.skip(
      f"{impl.name}: gradients in Triton's interpreter need tracing, which it cannot do "
      "(checked on GPU and by the kernel's own tests)"
    )


def _label(impl) -> str:
  return getattr(impl, "label", getattr(impl, "name", repr(impl)))


def _relative(case: cases_lib.Case) -> bool:
  """Whether the relative rule applies (so the plain computation is needed)."""
  return tolerance.for_dtype(case.dtype).relative_rule


def _jit(impl) -> bool:
  return not getattr(impl, "eager", False)


def check_forward(
  case: cases_lib.Case, impl, key: jax.Array | None = None, *, name: str | None = None
):
  """The output against the high-precision reference (relative rule for 16-bit dtypes)."""
  args, kwargs = case.make_args(case_key(case) if key is None else key)
  skip_unsupported(impl, args, kwargs)
  out = case.call(impl, args, kwargs, jit=_jit(impl))
  compare.assert_finite(out, name=name or f"{case.op}[{_label(impl)}]")
  compare.assert_close(
    out,
    case.reference(args, kwargs),
    dtype=case.dtype,
    reduction_length=case.reduction_length,
    plain=case.plain(args, kwargs) if _relative(case) else None,
    has_matmul=case.has_matmul,
    name=name or f"{case.op}[{_label(impl)}]",
  )
  return out


def check_vjp(case: cases_lib.Case, impl, key: jax.Array | None = None) -> None:
  """The VJP for a random cotangent against the reference's VJP at high precision."""
  skip_eager_gradients(impl)
  key = case_key(case) if key is None else key
  args, kwargs = case.make_args(key)
  skip_unsupported(impl, args, kwargs)
  f, primals = case.differentiable(impl, args, kwargs)
  ref, _ = case.differentiable(lambda *a, **k: case.info.reference(a, k), args, kwargs)
  diff = case.builder_diff(args)
  names = tuple(case.build(key).names[i] for i in diff)
  grads.assert_vjp_close(
    jax.jit(f) if _jit(impl) else f,
    ref,
    primals,
    key=jax.random.fold_in(key, 1),
    plain=jax.jit(ref) if _relative(case) else None,
    reduction_length=max(case.reduction_length, _longest_dim(case)),
    has_matmul=case.has_matmul,
    names=names,
  )


def _longest_dim(case: cases_lib.Case) -> int:
  """Gradients reduce over the other operand's dims too (e.g. dk sums over T)."""
  dims = [v for v in case.shape_dict.values() if isinstance(v, int)]
  return max(dims) if dims else 1


def check_determinism(case: cases_lib.Case, impl, key: jax.Array | None = None) -> None:
  """Two runs give bitwise-equal outputs and gradients."""
  skip_eager_gradients(impl)
  key = case_key(case) if key is None else key
  args, kwargs = case.make_args(key)
  skip_unsupported(impl, args, kwargs)
  f, primals = case.differentiable(impl, args, kwargs)
  why_not = impl.instance.nondeterministic_gradients
  det_key = jax.random.fold_in(key, 2)
  grads.assert_deterministic(f, primals, key=det_key, jit=_jit(impl), gradients=why_not is None)
  if why_not is not None:
    pytest.skip(f"{impl.name}: outputs are bitwise deterministic; gradients are not: {why_not}")


def check_finite_differences(
  case: cases_lib.Case, impl, key: jax.Array | None = None, *, dtype: str = "float32"
) -> None:
  """`jax.test_util.check_grads` (reverse mode against finite differences) at the golden shape."""
  skip_eager_gradients(impl)
  # The golden shapes: finite differences of a large float32 case drown in the rounding of its
  # many-term sums (GLU 512x1024x768 on the H200).
  case = dataclasses.replace(case.at_golden_shape(), dtype=dtype)
  # Full float32 matmuls: finite differences of TF32 rounding are noise.
  with jax.enable_x64(dtype == "float64"), jax.default_matmul_precision("highest"):
    args, kwargs = case.make_args(case_key(case) if key is None else key)
    skip_unsupported(impl, args, kwargs)
    f, primals = case.differentiable(impl, args, kwargs)
    grads.check_grads(f, primals)
