"""The gradient fallback of dispatch, with forwards that JAX cannot differentiate.

An implementation with `differentiable = False` and no `_bwd` gets its
gradient from the op's XLA implementation through `op._with_custom_vjp`.
The forwards here pass their output through `_opaque`, whose JVP raises: if
dispatch ever let JAX differentiate them, the test errors; if the fallback
gave zeros or another implementation's VJP, every cotangent (x, scale,
offset, both GLU weights, the attention bias) is compared with the
reference's and the wrong one is named.
"""

import dataclasses
import inspect
import textwrap

import jax
import jax.numpy as jnp
import pytest

from suites import matrices
from suites.matrices import checks
from tokamax._src.ops import op as op_lib


@jax.custom_jvp
def _opaque(x):
  return x


@_opaque.defjvp
def _opaque_jvp(primals, tangents):
  del primals, tangents
  raise TypeError("_opaque: JAX must not differentiate this forward")


def opaque_implementation(spec: op_lib.OpSpec) -> op_lib.Op:
  """The op's XLA implementation behind `_opaque`: forward only, no `_bwd`."""
  xla_cls = type(spec.get("xla"))

  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Opaque(xla_cls):
    name = "opaque"
    differentiable = False

    def _fwd(self, args, config):
      out, residuals = super()._fwd(args, config)
      return jax.tree.map(_opaque, out), residuals

    def _fwd_primal(self, args, config):
      return jax.tree.map(_opaque, super()._fwd_primal(args, config))

    def _bwd_unsupported_reason(self, args):
      return "forward only"  # Whatever `_bwd` the XLA implementation has.

  return Opaque()


class _Public:
  """The public signature, dispatching to `op`."""

  def __init__(self, spec, op):
    self.spec, self.op, self.name = spec, op, "opaque"

  def __call__(self, *args, **kwargs):
    return self.spec(*args, implementation=self.op, **kwargs)


CASES = [
  ("layer_norm", "plain"),
  ("layer_norm", "rms"),
  ("gated_linear_unit", "split_weights"),
  ("gated_linear_unit", "swiglu"),
  ("dot_product_attention", "bias"),
  ("ragged_dot", "default"),
  ("linear_softmax_cross_entropy_loss", "mean"),
]


def _case(op: str, feature: str):
  return next(
    c
    for c in matrices.for_family("cpu", op=op)
    if c.feature == feature and c.dtype == "float32" and c.kind == matrices.NATIVE
  )


def check_fallback(op: str, feature: str) -> None:
  case = _case(op, feature)
  checks.check_vjp(case, _Public(case.spec, opaque_implementation(case.spec)))


def test_the_forward_is_not_differentiable_by_jax():
  case = _case("layer_norm", "plain")
  impl = opaque_implementation(case.spec)
  args, kwargs = case.make_args(checks.case_key(case))
  record = impl.bind(*args, **kwargs).args
  with pytest.raises(TypeError, match="must not differentiate"):
    jax.grad(lambda x: impl._fwd(dataclasses.replace(record, x=x), None)[0].sum())(args[0])
  assert impl._bwd_unsupported_reason(record) is not None  # No backward of its own.


@pytest.mark.parametrize(("op", "feature"), CASES, ids=[f"{o}-{f}" for o, f in CASES])
def test_gradient_comes_from_xla(op, feature):
  check_fallback(op, feature)


# --- Planted bugs in the fallback ------------------------------------------------


def _planted(fn, old: str, new: str):
  """A copy of module-level function (or method) `fn` of op_lib with `old` replaced by `new`."""
  source = textwrap.dedent(inspect.getsource(fn))
  assert source.count(old) == 1, f"{old!r} is not in {fn.__qualname__}"
  namespace = dict(vars(op_lib))
  exec(compile(source.replace(old, new), op_lib.__file__, "exec"), namespace)
  return namespace[fn.__name__]


def test_fallback_returning_zeros_is_caught(monkeypatch):
  buggy = _planted(
    op_lib._with_custom_vjp,
    "return vjp(dout)",
    "(grads,) = vjp(dout)\n      return (jax.tree.map(jax.numpy.zeros_like, grads),)",
  )
  monkeypatch.setattr(op_lib, "_with_custom_vjp", buggy)
  with pytest.raises(AssertionError, match="dx"):
    check_fallback("layer_norm", "plain")


def test_fallback_dropping_the_last_cotangent_is_caught(monkeypatch):
  buggy = _planted(
    op_lib._with_custom_vjp,
    "return vjp(dout)",
    "(grads,) = vjp(dout)\n"
    "      last = [f.name for f in dataclasses.fields(record) if f.name in grads][-1]\n"
    "      return ({**grads, last: jax.tree.map(jax.numpy.zeros_like, grads[last])},)",
  )
  monkeypatch.setattr(op_lib, "_with_custom_vjp", buggy)
  with pytest.raises(AssertionError, match="doffset"):
    check_fallback("layer_norm", "plain")
  with pytest.raises(AssertionError, match="dweights"):
    check_fallback("gated_linear_unit", "split_weights")


def test_fallback_with_another_implementations_vjp_is_caught(monkeypatch):
  """The VJP of RMSNorm for a LayerNorm: a plausible wrong reference."""
  spec = _case("layer_norm", "plain").spec
  xla = spec.get("xla")
  rms = dataclasses.replace(xla)
  object.__setattr__(
    rms, "apply", lambda record: xla.apply(dataclasses.replace(record, subtract_mean=False))
  )
  monkeypatch.setitem(spec._cache, "xla", rms)
  with pytest.raises(AssertionError, match="dx"):
    check_fallback("layer_norm", "plain")


def test_fallback_skipped_for_a_non_differentiable_forward_is_caught(monkeypatch):
  """`differentiable` ignored: JAX differentiates the forward itself and meets `_opaque`."""
  buggy = _planted(op_lib.Op._apply_unpartitioned, "if self.differentiable and", "if True and")
  monkeypatch.setattr(op_lib.Op, "_apply_unpartitioned", buggy)
  with pytest.raises(TypeError, match="must not differentiate"):
    check_fallback("layer_norm", "plain")


def test_fallback_vjp_of_the_implementation_itself_is_caught(monkeypatch):
  """The fallback differentiating the op's own forward instead of XLA's."""
  buggy = _planted(
    op_lib._with_custom_vjp,
    "reference.apply(rebuild(a))",
    "op._fwd_primal(rebuild(a), config)",
  )
  monkeypatch.setattr(op_lib, "_with_custom_vjp", buggy)
  with pytest.raises(TypeError, match="must not differentiate"):
    check_fallback("layer_norm", "plain")


def test_zero_cotangent_for_integer_inputs():
  """ragged_dot's group sizes are integers: float0 cotangents, no error."""
  case = _case("ragged_dot", "default")
  impl = _Public(case.spec, opaque_implementation(case.spec))
  args, kwargs = case.make_args(checks.case_key(case))
  out, vjp = jax.vjp(lambda *a: impl(*a, **kwargs), *args)
  cts = vjp(jnp.ones_like(out))
  assert cts[0].shape == args[0].shape and cts[1].shape == args[1].shape
