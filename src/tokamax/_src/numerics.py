"""Numeric conventions shared by the implementations."""

import jax
import jax.numpy as jnp
import numpy as np


def accumulation_dtype(dtype) -> np.dtype:
  """The dtype for sums and softmax statistics: at least float32, float64 for float64 inputs."""
  return jnp.promote_types(dtype, jnp.float32)


def triton_input_precision(dtype, precision) -> str:
  """Triton's `tl.dot` input precision for a float32 matmul at JAX `precision`.

  `precision=None` follows `jax.default_matmul_precision`, as JAX's own matmuls do.

  Args:
    dtype: The matmul's input dtype (only float32 has a choice).
    precision: None, a `jax.lax.Precision`, or a pair of them (the higher counts).

  Returns:
    "ieee", "tf32x3" or "tf32".
  """
  if np.dtype(dtype) != np.float32:
    return "ieee"  # Unused for 16-bit inputs.
  if isinstance(precision, tuple):
    precision = max((p for p in precision if p is not None), default=None, key=lambda p: p.value)
  if precision is None:
    precision = _configured_precision()
  if precision == jax.lax.Precision.HIGHEST:
    return "ieee"
  if precision == jax.lax.Precision.HIGH:
    return "tf32x3"
  return "tf32"


def _configured_precision() -> jax.lax.Precision:
  value = jax.config.jax_default_matmul_precision
  if value is None:
    return jax.lax.Precision.DEFAULT
  try:
    return jax.lax.Precision(value)
  except ValueError:  # A dot-algorithm preset name, e.g. "F32_F32_F32".
    return _preset_precision(str(value).upper())


def _preset_precision(preset: str) -> jax.lax.Precision:
  """The precision a dot-algorithm preset comes closest to: float32 or wider inputs, or six
  or nine bfloat16 passes, are HIGHEST; three passes HIGH; one pass of narrower inputs
  DEFAULT."""
  if preset.startswith(("F32_F32_F32", "F64_F64_F64")) or preset.endswith(("_X6", "_X9")):
    return jax.lax.Precision.HIGHEST
  if preset.endswith("_X3"):
    return jax.lax.Precision.HIGH
  return jax.lax.Precision.DEFAULT


@jax.custom_jvp
def row_max_and_sum(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Each row's max and sum of exp(logits - max), over the last axis.

  On a GPU in one pass: a variadic reduction carries (max, sum) and rescales the sum as the
  max grows, so the logits are read once (`jax.nn.logsumexp` reads them twice). Elsewhere
  the two passes, which XLA's CPU backend runs faster (1.8x at 256x8192 float32).

  Args:
    logits: [..., C], C >= 1.

  Returns:
    A max and the sum relative to it, each [...] in `logits`' dtype; max + log(sum) is the
    log-sum-exp (-inf for a row of -inf).
  """
  return jax.lax.platform_dependent(logits, cuda=_one_pass, default=_two_passes)


@row_max_and_sum.defjvp
def _row_max_and_sum_jvp(primals, tangents):
  """The two passes' derivative for both forms: JAX cannot differentiate the one-pass variadic
  reduction, and under a transformation that traces both branches of `platform_dependent`
  (`lax.scan`, as the chunked loss's forward; the outer derivative of a gradient) the CPU's
  derivative went through it too and failed."""
  _, tangents_out = jax.jvp(_two_passes, primals, tangents)
  return row_max_and_sum(*primals), tangents_out


def _two_passes(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  row_max = jnp.max(logits, axis=-1)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, jnp.zeros((), logits.dtype))
  return row_max, jnp.sum(jnp.exp(logits - row_max[..., None]), axis=-1)


def _one_pass(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  def combine(a, b):
    (m_a, s_a), (m_b, s_b) = a, b
    # exp(-|m_a - m_b|) rescales the smaller max's sum; where the maxes are equal (also
    # both -inf, whose difference is nan) the weight is 1. The difference is selected before
    # the exp so that no nan reaches a derivative (a select after it passes 0 * nan back).
    diff = jnp.where(m_a == m_b, jnp.zeros((), m_a.dtype), m_a - m_b)
    weight = jnp.exp(-jnp.abs(diff)).astype(s_a.dtype)
    return jnp.maximum(m_a, m_b), jnp.where(m_a >= m_b, s_a + s_b * weight, s_a * weight + s_b)

  init = (jnp.array(-jnp.inf, logits.dtype), jnp.array(0, logits.dtype))
  # Ones that carry a (zero) tangent from the logits: JAX's derivative of a variadic reduce
  # fails on an operand without one (ones_like), which scans over layers differentiated
  # twice reach past `row_max_and_sum`'s own derivative.
  ones = jnp.where(jnp.isnan(logits), logits, jnp.ones((), logits.dtype))
  return jax.lax.reduce((logits, ones), init, combine, (logits.ndim - 1,))
