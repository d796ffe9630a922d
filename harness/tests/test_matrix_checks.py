"""The suites' checks hand the comparators what the case says.

`check_forward` compares in the case's dtype, at its reduction length, with its
matmul flag, against a float64 reference, and for 16-bit dtypes with the plain
computation (the relative rule); `check_vjp` does the same for gradients, at the
longest dimension of the case; `check_determinism` checks the gradients unless
the implementation says they are not deterministic. The comparators are replaced
by recorders here: what they do is tested elsewhere.
"""

import dataclasses
import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from suites import matrices, opdb
from suites.matrices import checks
from tokamax._src import triton_call
from tokamax_harness import compare, grads, hardware


def _case(op, feature, dtype, **shape):
  case = next(
    c for c in matrices.for_family("cpu", op=op) if c.feature == feature and c.dtype == dtype
  )
  if shape:
    case = dataclasses.replace(case, shape=tuple({**case.shape_dict, **shape}.items()))
  return case


def _record(monkeypatch, module, name) -> list:
  calls = []
  monkeypatch.setattr(module, name, lambda *args, **kwargs: calls.append((args, kwargs)))
  return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_check_forward_compares_as_the_case_says(monkeypatch, dtype):
  """Attention, causal, S = 56 keys: reduction length 56, matmuls, plain for bfloat16 only."""
  case = _case("dot_product_attention", "causal", dtype)
  assert case.shape_dict["s"] == 56
  calls = _record(monkeypatch, compare, "assert_close")
  checks.check_forward(case, matrices.resolve(case.spec, "xla"))
  ((out, reference), kwargs), *rest = calls
  assert not rest
  assert np.asarray(out).dtype == jnp.dtype(dtype)
  assert np.asarray(reference).dtype == np.float64
  assert kwargs["dtype"] == dtype
  assert kwargs["reduction_length"] == 56
  assert kwargs["has_matmul"] is True
  if dtype == "float32":
    assert kwargs["plain"] is None
  else:  # The reference computed plainly from bfloat16 inputs: near the float64 one, not it.
    plain = np.asarray(kwargs["plain"])
    assert plain.dtype != np.float64
    err = np.abs(plain.astype(np.float64) - reference)
    assert 0.0 < err.max() < 0.1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_check_vjp_compares_as_the_case_says(monkeypatch, dtype):
  """Attention with 96 queries over 56 keys of head dim 32: the forward reduces over 56, but dk
  and dv sum over the 96 queries, so gradients are compared at the longest dimension (96), with
  matmuls, every differentiable input named."""
  case = _case("dot_product_attention", "causal", dtype, t=96)
  assert case.reduction_length == 56
  calls = _record(monkeypatch, grads, "assert_vjp_close")
  checks.check_vjp(case, matrices.resolve(case.spec, "xla"))
  (_, kwargs), *rest = calls
  assert not rest
  assert kwargs["reduction_length"] == 96
  assert kwargs["has_matmul"] is True
  assert kwargs["names"] == ("query", "key", "value")
  assert (kwargs["plain"] is None) == (dtype == "float32")


def _layer_norm_with_drifting_gradients(why_not):
  """x * scale + offset whose dx drifts by one per backward run (a host counter), like an
  atomic reduction; the forward pass is fixed."""
  runs = itertools.count()

  @jax.custom_vjp
  def f(x, scale, offset):
    return x * scale + offset

  def fwd(x, scale, offset):
    return f(x, scale, offset), (x, scale)

  def bwd(res, g):
    x, scale = res
    drift = jax.pure_callback(lambda: np.float32(next(runs)), jax.ShapeDtypeStruct((), jnp.float32))
    axes = tuple(range(g.ndim - 1))
    return g * scale + drift.astype(g.dtype), (g * x).sum(axes), g.sum(axes)

  f.defvjp(fwd, bwd)

  def impl(x, scale, offset, **unused):
    del unused
    return f(x, scale, offset)

  impl.name = "drifting"
  impl.instance = types.SimpleNamespace(nondeterministic_gradients=why_not)
  return impl


def test_check_determinism_checks_gradients_unless_told_they_vary():
  case = _case("layer_norm", "plain", "float32")
  with pytest.raises(AssertionError, match="not deterministic"):
    checks.check_determinism(case, _layer_norm_with_drifting_gradients(None))
  # Declared nondeterministic: the outputs are checked (they are fixed), then the test skips.
  with pytest.raises(pytest.skip.Exception, match="atomics"):
    checks.check_determinism(case, _layer_norm_with_drifting_gradients("atomics"))


@pytest.mark.parametrize(("dtype", "want"), [("float32", np.float32), ("float64", np.float64)])
def test_check_finite_differences_runs_in_the_dtype_asked_for(monkeypatch, dtype, want):
  """A bfloat16 case is checked by finite differences in float32 (default) or float64, at the
  op's golden shape, with full-precision matmuls."""
  case = _case("layer_norm", "plain", "bfloat16")
  seen = []

  def record(fn, primals, **kwargs):
    del fn, kwargs
    seen.append(
      ([p.dtype for p in primals], primals[0].shape, jax.config.jax_default_matmul_precision)
    )

  monkeypatch.setattr(grads, "check_grads", record)
  checks.check_finite_differences(case, matrices.resolve(case.spec, "xla"), dtype=dtype)
  ((dtypes, shape, precision),) = seen
  assert dtypes == [want] * 3
  golden = case.info.golden_shape
  assert shape == (*golden["rows"], golden["d"])
  assert precision == "highest"


def _skip_reason(fn, *args) -> str | None:
  """Why `fn(*args)` skipped the test, or None; a skip is caught here, so a check that skips
  when it should not fails this test instead of skipping it."""
  try:
    fn(*args)
  except pytest.skip.Exception as e:
    return str(e)
  return None


def test_skips_only_what_the_implementation_cannot_take():
  def impl(*args, **kwargs):
    del args, kwargs

  impl.name = "fake"
  # No `unsupported_reason`: it takes everything.
  assert _skip_reason(checks.skip_unsupported, impl, (), {}) is None
  impl.unsupported_reason = lambda args, kwargs: None
  assert _skip_reason(checks.skip_unsupported, impl, (), {}) is None
  impl.unsupported_reason = lambda args, kwargs: "no fp8 here"
  assert _skip_reason(checks.skip_unsupported, impl, (), {}) == "fake: no fp8 here"


def test_only_eager_implementations_skip_gradients():
  compiled = types.SimpleNamespace(name="compiled")
  assert _skip_reason(checks.skip_eager_gradients, compiled) is None
  jitted = types.SimpleNamespace(name="jitted", eager=False)
  assert _skip_reason(checks.skip_eager_gradients, jitted) is None
  eager = types.SimpleNamespace(name="triton", eager=True)
  assert "interpreter" in _skip_reason(checks.skip_eager_gradients, eager)


@pytest.mark.parametrize(("eager", "traced"), [(None, True), (False, True), (True, False)])
def test_check_forward_jits_all_but_eager_implementations(eager, traced):
  """Implementations run under jax.jit (their arrays traced), but for those marked eager (Triton's
  host interpreter runs eager calls only); one without the mark is not eager."""
  case = _case("layer_norm", "plain", "float32")
  xla = matrices.resolve(case.spec, "xla")
  seen = []

  def impl(*args, **kwargs):
    seen.append(isinstance(args[0], jax.core.Tracer))
    return xla(*args, **kwargs)

  impl.name = "wrapped"
  if eager is not None:
    impl.eager = eager
  checks.check_forward(case, impl)
  assert seen == [traced]


def test_config_variants_run_their_fixed_config():
  """A config variant is its implementation with the variant's fields as its fixed config
  (labelled name@label); one of an implementation that cannot run here keeps its reason."""
  spec = opdb.get("dot_product_attention").spec
  impls = matrices.all_for(spec, variants={"xla_chunked": {"kv16": {"kv_chunk_size": 16}}})
  (default,) = [i for i in impls if i.name == "xla_chunked" and i.variant is None]
  (variant,) = [i for i in impls if i.variant == "kv16"]
  assert variant.label == "xla_chunked@kv16"
  assert default.instance.config is None
  assert variant.instance.config.kv_chunk_size == 16
  absent = matrices.Implementation("op", "gpu_only", "triton", None, "no GPU here")
  labelled = matrices.implementations.with_variant(absent, "v", {"block": 8})
  assert (labelled.instance, labelled.reason, labelled.label) == (None, "no GPU here", "gpu_only@v")


def test_cpu_resolves_kernels_to_their_interpreters():
  """On CPU a Pallas kernel (an `interpret` field) runs with interpret=True, Triton's in its host
  interpreter called eagerly, and XLA natively (suites/matrices/implementations.py)."""
  if hardware.detect().platform != "cpu":
    pytest.skip("needs the CPU backend: it checks how kernels resolve on a CPU")
  spec = opdb.get("gated_linear_unit").spec
  xla, triton, mosaic = (matrices.resolve(spec, n) for n in ("xla", "triton", "mosaic"))
  assert (xla.family, xla.interpret, xla.eager) == (hardware.XLA, False, False)
  assert (triton.family, triton.interpret, triton.eager) == (hardware.TRITON, True, True)
  assert (mosaic.family, mosaic.interpret, mosaic.eager) == (hardware.MOSAIC_GPU, True, False)
  assert mosaic.instance.interpret is True
  assert all(i.instance is not None and i.reason is None for i in (xla, triton, mosaic))


def test_only_interpreted_triton_runs_in_tritons_host_interpreter():
  """`context` enters Triton's interpreter for an interpreted Triton implementation only: a
  native one (a GPU) runs compiled and a Pallas kernel needs no Triton context."""

  def impl(family, interpret):
    return matrices.Implementation("op", "name", family, object(), None, interpret=interpret)

  with impl(hardware.TRITON, True).context():
    assert triton_call.interpreting()
  for family, interpret in ((hardware.TRITON, False), (hardware.MOSAIC_GPU, True)):
    with impl(family, interpret).context():
      assert not triton_call.interpreting(), (family, interpret)
