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
  # A finite floor instead of selects on the row max and sum: XLA's GPU softmax fusion
  # forms only around elementwise ops. A row that sees no key gets exp(-inf) = 0 and a
  # zero sum; any other row's sum is >= 1.
  floor = jnp.finfo(logits.dtype).min
  row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True, initial=floor))
  unnormalized = jnp.exp(logits - row_max)
  denom = jnp.sum(unnormalized, axis=-1, keepdims=True)
  probs = unnormalized / jnp.maximum(denom, jnp.finfo(logits.dtype).tiny)
  out = jnp.einsum(
    "bkgts,bskh->btkgh",
    probs.astype(v.dtype),
    v,
    precision=args.precision,
    preferred_element_type=logits.dtype,
  )
  lse = jnp.where(denom > 0, jnp.log(denom) + row_max, -jnp.inf)[..., 0]
  return out.reshape(b, t, n, v.shape[-1]).astype(q.dtype), lse


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
