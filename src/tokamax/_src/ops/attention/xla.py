"""dot_product_attention with the full T x S logits in memory."""

import dataclasses

import jax
import jax.numpy as jnp

from tokamax._src.ops import op
from tokamax._src.ops.attention import spec, xla_chunked


def attend(args: spec.AttentionArgs) -> tuple[jax.Array, jax.Array]:
  """Returns the output [B,T,N,h] and the log-sum-exp [B,K,G,T] (-inf where nothing is visible)."""
  q, k, v = args.query, args.key, args.value
  b, t, n, _ = q.shape
  s = k.shape[1]
  logits, ok = spec.logits_and_mask(args, q, k, args.bias, args.mask, jnp.arange(t), jnp.arange(s))
  if ok is not None:
    logits = jnp.where(ok, logits, -jnp.inf)
  fused = ok is None or args.mask is not None or args.bias is not None
  row_max, total, divisor = _row_max_and_sum(logits, fused)
  probs = jnp.exp(logits - row_max) / divisor
  out = jnp.einsum(
    "bkgts,bskh->btkgh",
    probs.astype(v.dtype),
    v,
    precision=args.precision,
    preferred_element_type=logits.dtype,
  )
  lse = jnp.where(total > 0, jnp.log(total) + row_max, -jnp.inf)[..., 0]
  return out.reshape(b, t, n, v.shape[-1]).astype(q.dtype), lse


def _row_max_and_sum(logits: jax.Array, fused: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Each row's max (finite), its sum of exp(logits - max) (0 where the row sees no key) and
  that sum as a divisor (non-zero).

  Two forms of the same values, for XLA's GPU fusions (H200, bf16, B4 T4096 N32 H128,
  bench/results/h200/attention_xla_ab_7af72e4.json):
  - fused: a finite floor under the max and a clamp of the sum are elementwise, so that the
    softmax becomes one fusion: 7.05 ms without a mask against 10.70 with selects; with a
    mask or bias array 11.4 / 10.7 against 15.1 / 12.1;
  - not fused: selects on the max and sum keep the three passes apart, each recomputing a
    visibility that comes from positions alone: causal 10.7 against the fusion's 11.7 (it
    cannot take the select in, so a masked copy of the logits goes through memory).
  """
  if fused:
    row_max = jnp.max(logits, axis=-1, keepdims=True, initial=jnp.finfo(logits.dtype).min)
  else:
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  row_max = jax.lax.stop_gradient(row_max)
  total = jnp.sum(jnp.exp(logits - row_max), axis=-1, keepdims=True)
  if fused:  # A row that sees any key has a sum >= 1.
    return row_max, total, jnp.maximum(total, jnp.finfo(logits.dtype).tiny)
  return row_max, total, jnp.where(total == 0, 1.0, total)


def bias_grad(args: spec.AttentionArgs, out: jax.Array, dout: jax.Array) -> jax.Array:
  """The bias cotangent, for kernels without one: the analytic backward's ds from the
  recomputed log-sum-exp (materialises [B,N,T,S]; its dq, dk, dv are dropped under jit)."""
  _, lse = attend(args)
  return _backward(args, out, lse, dout)["bias"]


def _backward(args: spec.AttentionArgs, out, lse, dout) -> dict:
  # The analytic backward from the log-sum-exp, as one key chunk: its cotangent GEMMs run
  # in the inputs' dtype (JAX's own derivative of `attend` multiplies in float32).
  whole = xla_chunked.ChunkedConfig(kv_chunk_size=args.key.shape[1])
  return xla_chunked.backward(args, whole, out, lse, dout)


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaAttention(op.Op):
  """Attention as einsums and a softmax; memory grows with T x S."""

  name = "xla"
  spec = spec.SPEC

  def _fwd(self, args, config):
    return attend(args)

  def _bwd(self, args, config, out, residuals, dout):
    return _backward(args, out, residuals, dout)
