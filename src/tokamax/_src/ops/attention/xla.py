"""dot_product_attention with the full T x S logits in memory."""

import dataclasses

import jax
import jax.numpy as jnp

from tokamax._src.ops import op
from tokamax._src.ops.attention import spec, xla_chunked

# Query rows per block where visibility comes from positions (causal, a window): each block
# computes the logits of the keys it can see and no others. H200, bf16, causal forward
# (bench/results/h200/attention_xla_blocks_d3c9e04.json): B4 T4096 N32 H128 7.40 ms
# against 10.70 in one block; 512 rows were faster at H128 and slower at H256 T8192.
QUERY_BLOCK_ROWS = 1024


def attend(args: spec.AttentionArgs, blocked: bool = True) -> tuple[jax.Array, jax.Array]:
  """Returns the output [B,T,N,h] and the log-sum-exp [B,K,G,T] (-inf where nothing is visible).

  Args:
    args: The call.
    blocked: Whether query blocks skip the keys they cannot see (`query_blocks`).
  """
  t, s = args.query.shape[1], args.key.shape[1]
  blocks = query_blocks(args) if blocked else [(0, t, 0, s)]
  outs, lses = zip(*(_attend_block(args, *block) for block in blocks), strict=True)
  return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=-1)


def query_blocks(args: spec.AttentionArgs) -> list[tuple[int, int, int, int]]:
  """(t0, t1, s0, s1): query rows [t0, t1) and the key columns [s0, s1) they can see.

  One block unless causality or a window hides whole key ranges from blocks of
  `QUERY_BLOCK_ROWS` rows.
  """
  t, s = args.query.shape[1], args.key.shape[1]
  if not (args.is_causal or args.local_window) or t < 2 * QUERY_BLOCK_ROWS:
    return [(0, t, 0, s)]
  blocks = []
  for t0 in range(0, t, QUERY_BLOCK_ROWS):
    t1 = min(t, t0 + QUERY_BLOCK_ROWS)
    s0, s1 = 0, s
    if args.is_causal:
      s1 = min(s1, t1)
    if args.local_window is not None:
      left, right = args.local_window
      s0, s1 = max(s0, t0 - left), min(s1, t1 + right)
    s0 = min(s0, s1 - 1)  # A block that sees no key keeps one, masked, for its zero rows.
    blocks.append((t0, t1, s0, s1))
  return blocks


def _attend_block(args: spec.AttentionArgs, t0: int, t1: int, s0: int, s1: int):
  q = args.query[:, t0:t1]
  k, v = args.key[:, s0:s1], args.value[:, s0:s1]
  bias, mask = (
    spec.slice_unless_broadcast(spec.slice_unless_broadcast(x, 2, t0, t1 - t0), 3, s0, s1 - s0)
    for x in (args.bias, args.mask)
  )
  logits, ok = spec.logits_and_mask(args, q, k, bias, mask, jnp.arange(t0, t1), jnp.arange(s0, s1))
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
  b, _, n, _ = q.shape
  return out.reshape(b, t1 - t0, n, v.shape[-1]).astype(q.dtype), lse


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
    # -inf, max's identity, also for no keys (S = 0), where jnp.max would raise.
    row_max = jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf)
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
  whole = xla_chunked.ChunkedConfig(kv_chunk_size=xla_chunked.chunkable_keys(args))
  return xla_chunked.backward(args, whole, out, lse, dout)


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaAttention(op.Op):
  """Attention as einsums and a softmax; memory grows with T x S."""

  name = "xla"
  spec = spec.SPEC

  def _fwd(self, args, config):
    # Under differentiation in one block: blocked, forward+backward took 1.13x as long at
    # B1 T16384 N16 H128 causal and 1.03x at B2 T8192 N8 H256 (0.95x at T4096).
    return attend(args, blocked=False)

  def _fwd_primal(self, args, config):
    return attend(args)[0]

  def _bwd(self, args, config, out, residuals, dout):
    return _backward(args, out, residuals, dout)
