"""The harness shows its teeth: planted bugs in copies of an implementation are caught.

Each bug lives in a copy written here (a chunked online-softmax attention and a
layer norm with a hand-written VJP); the correct copy passes the same checks
that the suites run, and every planted bug fails them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from suites import matrices
from suites.matrices import checks

BLOCK = 16


def chunked_attention(
  query, key, value, bias=None, mask=None, *, bug=None, scale=None, is_causal=False, **unused
):
  """Flash-style attention over key blocks of BLOCK, with an optional planted bug."""
  del bias, mask, unused  # The cases used here have none.
  b, t, n, h = query.shape
  s, kh = key.shape[1], key.shape[2]
  key = jnp.repeat(key, n // kh, axis=2)
  value = jnp.repeat(value, n // kh, axis=2)
  scale = 1.0 / np.sqrt(h) if scale is None else scale
  if bug == "wrong_scale":
    scale = 1.0 / h
  q = query.astype(jnp.float32)
  row_max = jnp.full((b, n, t), -jnp.inf)
  total = jnp.zeros((b, n, t))
  acc = jnp.zeros((b, n, t, value.shape[-1]))
  qi = jnp.arange(t)[:, None]
  for start in range(0, s, BLOCK):
    kb = key[:, start : start + BLOCK].astype(jnp.float32)
    vb = value[:, start : start + BLOCK].astype(jnp.float32)
    logits = jnp.einsum("btnh,bsnh->bnts", q, kb, precision="highest") * scale
    kj = start + jnp.arange(kb.shape[1])[None, :]
    last = start + BLOCK >= s
    if is_causal and not (bug == "causal_last_block" and last):
      reach = 1 if bug == "mask_off_by_one" else 0
      logits = jnp.where(kj <= qi + reach, logits, -jnp.inf)
    if bug == "no_running_max":
      p = jnp.exp(logits)
      total = total + p.sum(-1)
      acc = acc + jnp.einsum("bnts,bsnh->bnth", p, vb, precision="highest")
      continue
    new_max = jnp.maximum(row_max, logits.max(-1))
    safe = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    p = jnp.exp(logits - safe[..., None])
    correction = jnp.exp(jnp.where(jnp.isfinite(row_max), row_max - safe, -jnp.inf))
    total = total * correction + p.sum(-1)
    acc = acc * correction[..., None] + jnp.einsum("bnts,bsnh->bnth", p, vb, precision="highest")
    row_max = new_max
  out = acc / jnp.where(total > 0, total, 1.0)[..., None]
  out = jnp.swapaxes(out, 1, 2)
  if bug == "unwritten_tail":
    written = (t // BLOCK) * BLOCK
    out = out.at[:, written:].set(0.0)
  return out.astype(query.dtype)


def layer_norm(x, scale, offset, *, bug=None, axis=-1, epsilon=1e-6, **unused):
  """LayerNorm over the last axis with a hand-written VJP, with an optional planted bug."""
  del unused
  assert axis in (-1, x.ndim - 1)

  @jax.custom_vjp
  def norm(x, scale, offset):
    return fwd(x, scale, offset)[0]

  def fwd(x, scale, offset):
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    rstd = jax.lax.rsqrt(((xf - mean) ** 2).mean(-1, keepdims=True) + epsilon)
    xhat = (xf - mean) * rstd
    y = xhat * scale + offset
    return y.astype(x.dtype), (xhat, rstd, scale)

  def fwd_rule(x, scale, offset):
    y, residuals = fwd(x, scale, offset)
    if bug == "wrong_value_under_grad":  # What a training step's loss would see.
      y = (y.astype(jnp.float32) * 1.01).astype(x.dtype)
    return y, residuals

  def bwd(res, g):
    xhat, rstd, scale = res
    g = g.astype(jnp.float32)
    if bug == "cotangent_row_mean":  # Right for a constant cotangent only.
      g = jnp.broadcast_to(g.mean(-1, keepdims=True), g.shape)
    gx = g * scale
    dx = gx - gx.mean(-1, keepdims=True)
    if bug != "dropped_grad_term":
      dx = dx - xhat * (gx * xhat).mean(-1, keepdims=True)
    dx = dx * rstd
    axes = tuple(range(g.ndim - 1))
    return (
      dx.astype(x.dtype),
      (g * xhat).sum(axes).astype(scale.dtype),
      g.sum(axes).astype(scale.dtype),
    )

  norm.defvjp(fwd_rule, bwd)
  return norm(x, scale, offset)


def _case(op, feature, dtype="float32"):
  return next(
    c for c in matrices.for_family("cpu", op=op) if c.feature == feature and c.dtype == dtype
  )


def _named(fn, name, **kw):
  f = functools.partial(fn, **kw)
  f.name = name
  return f


ATTENTION_BUGS = ("wrong_scale", "mask_off_by_one", "causal_last_block", "unwritten_tail")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_correct_attention_copy_passes(dtype):
  case = _case("dot_product_attention", "causal", dtype)
  checks.check_forward(case, _named(chunked_attention, "correct"))


@pytest.mark.parametrize("bug", ATTENTION_BUGS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_bug_is_caught(bug, dtype):
  case = _case("dot_product_attention", "causal", dtype)
  assert case.shape_dict["s"] % BLOCK and case.shape_dict["t"] % BLOCK, (
    "the case needs partial blocks"
  )
  with pytest.raises(AssertionError, match="max abs error") as failure:
    checks.check_forward(case, _named(chunked_attention, bug, bug=bug))
  assert "elements off" in str(failure.value)


def _large_logits(case, fn):
  """check_forward with logits in the hundreds: exp overflows without the running max."""
  args, kwargs = case.make_args(checks.case_key(case))
  kwargs = {**kwargs, "scale": 12.0}
  from tokamax_harness import compare

  out = case.call(fn, args, kwargs)
  compare.assert_finite(out, name=fn.name)
  compare.assert_close(
    out,
    case.reference(args, kwargs),
    dtype=case.dtype,
    reduction_length=case.reduction_length,
    name=fn.name,
  )


def test_softmax_without_running_max_is_caught():
  case = _case("dot_product_attention", "plain")
  _large_logits(case, _named(chunked_attention, "correct"))
  with pytest.raises(AssertionError, match=r"NaN|Inf"):
    _large_logits(case, _named(chunked_attention, "no_running_max", bug="no_running_max"))


def test_correct_layer_norm_vjp_passes():
  case = _case("layer_norm", "plain")
  checks.check_forward(case, _named(layer_norm, "correct"))
  checks.check_vjp(case, _named(layer_norm, "correct"))


def test_dropped_gradient_term_is_caught():
  case = _case("layer_norm", "plain")
  buggy = _named(layer_norm, "dropped_grad_term", bug="dropped_grad_term")
  checks.check_forward(case, buggy)  # The forward pass is right ...
  with pytest.raises(AssertionError, match="dx"):  # ... the gradient is not.
    checks.check_vjp(case, buggy)


def test_wrong_value_under_differentiation_is_caught():
  """A custom VJP whose forward rule (not its primal) is off: only `jax.vjp` sees it."""
  case = _case("layer_norm", "plain")
  buggy = _named(layer_norm, "wrong_value_under_grad", bug="wrong_value_under_grad")
  checks.check_forward(case, buggy)  # The value alone is right ...
  with pytest.raises(AssertionError, match="the value under differentiation"):
    checks.check_vjp(case, buggy)  # ... the value a training step sees is not.


def test_masked_rows_are_checked():
  """Rows past query_seq_lengths must be zero: garbage there is caught."""
  case = _case("dot_product_attention", "q_lengths")

  def garbage_in_padding(*args, **kwargs):
    out = matrices.resolve(case.spec, "xla")(*args, **kwargs)
    return out.at[:, -1].add(1.0)  # The last row is padding for some batch element.

  garbage_in_padding.name = "garbage_in_padding"
  _, kwargs = case.make_args(checks.case_key(case))
  assert int(np.min(kwargs["query_seq_lengths"])) < case.shape_dict["t"]
  with pytest.raises(AssertionError):
    checks.check_forward(case, garbage_in_padding)


def test_backward_that_only_sees_the_cotangents_mean_is_caught():
  """A backward right for a constant cotangent (e.g. the gradient of a sum) but not for others:
  the VJP check draws a random cotangent."""
  case = _case("layer_norm", "plain")
  buggy = _named(layer_norm, "cotangent_row_mean", bug="cotangent_row_mean")
  with pytest.raises(AssertionError, match="dx"):
    checks.check_vjp(case, buggy)
