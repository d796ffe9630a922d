"""dot_product_attention over key/value chunks: memory linear in sequence length.

The forward pass keeps a running max and sum per query row (online softmax) and
never holds more than [T, kv_chunk_size] logits per head; the backward pass
recomputes them chunk by chunk from the saved log-sum-exp.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from tokamax._src import numerics
from tokamax._src.ops import op, partitioning
from tokamax._src.ops.attention import spec


@dataclasses.dataclass(frozen=True)
class ChunkedConfig:
  """Args: kv_chunk_size: keys per step of the scan."""

  kv_chunk_size: int = 512

  def __post_init__(self):
    if self.kv_chunk_size < 1:
      raise ValueError(f"`kv_chunk_size` must be positive, got {self.kv_chunk_size}.")


def _pad_s(x: jax.Array | None, axis: int, length: int) -> jax.Array | None:
  if x is None or x.shape[axis] in (1, length):
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, pad)


def chunkable_keys(args: spec.AttentionArgs) -> int:
  """The most keys a chunk may span: S, or 1 where there are none (one hidden padding key)."""
  return max(args.key.shape[1], 1)


class _Chunks:
  """The padded key-side arrays and the per-chunk slices of them."""

  def __init__(self, args: spec.AttentionArgs, size: int):
    s = args.key.shape[1]
    # No keys (S = 0): one chunk of one zero-padded key, which `in_range` hides.
    self.size = min(size, chunkable_keys(args))
    self.count = math.ceil(s / self.size) or 1
    self.padded = self.count * self.size
    self.s = s
    self.key = _pad_s(args.key, 1, self.padded)
    self.value = _pad_s(args.value, 1, self.padded)
    self.bias = _pad_s(args.bias, 3, self.padded)
    self.mask = _pad_s(args.mask, 3, self.padded)

  def logits(self, args: spec.AttentionArgs, q: jax.Array, i):
    start = i * self.size
    k = spec.slice_unless_broadcast(self.key, 1, start, self.size)
    k_pos = start + jnp.arange(self.size)
    bias = spec.slice_unless_broadcast(self.bias, 3, start, self.size)
    mask = spec.slice_unless_broadcast(self.mask, 3, start, self.size)
    logits, ok = spec.logits_and_mask(args, q, k, bias, mask, jnp.arange(q.shape[1]), k_pos)
    in_range = k_pos < self.s
    ok = in_range if ok is None else ok & in_range
    return (
      jnp.where(ok, logits, -jnp.inf),
      k,
      spec.slice_unless_broadcast(self.value, 1, start, self.size),
    )


def _forward(args: spec.AttentionArgs, config: ChunkedConfig):
  q = args.query
  b, t, n, _ = q.shape
  kh, hv = args.key.shape[2], args.value.shape[-1]
  chunks = _Chunks(args, config.kv_chunk_size)
  shape = (b, kh, n // kh, t)
  acc_dtype = numerics.accumulation_dtype(q.dtype)

  def step(carry, i):
    m, total, acc = carry
    logits, _, v = chunks.logits(args, q, i)
    m_new = jnp.maximum(m, logits.max(axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(logits - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    pv = jnp.einsum(
      "bkgts,bskh->bkgth",
      p.astype(v.dtype),
      v,
      precision=args.precision,
      preferred_element_type=acc_dtype,
    )
    return (m_new, alpha * total + p.sum(-1), alpha[..., None] * acc + pv), None

  init = (
    jnp.full(shape, -jnp.inf, acc_dtype),
    jnp.zeros(shape, acc_dtype),
    jnp.zeros((*shape, hv), acc_dtype),
  )
  init = partitioning.vary(init, partitioning.record_vma(args))  # Inside shard_map.
  (m, total, acc), _ = jax.lax.scan(step, init, jnp.arange(chunks.count))
  out = acc / jnp.where(total == 0, 1.0, total)[..., None]
  lse = jnp.where(total == 0, -jnp.inf, jnp.log(jnp.where(total == 0, 1.0, total)) + m)
  out = jnp.moveaxis(out, 3, 1).reshape(b, t, n, hv).astype(q.dtype)
  return out, lse


def backward(args: spec.AttentionArgs, config: ChunkedConfig, out, lse, dout) -> dict:
  """Cotangents of query, key, value (and bias) from the output and its log-sum-exp
  [B,K,G,T], recomputing the logits a key chunk at a time."""
  q = args.query
  b, t, n, h = q.shape
  kh, hv = args.key.shape[2], args.value.shape[-1]
  g = n // kh
  chunks = _Chunks(args, config.kv_chunk_size)
  acc_dtype = numerics.accumulation_dtype(q.dtype)
  do = dout.reshape(b, t, kh, g, hv)
  delta = jnp.einsum(
    "btkgh,btkgh->bkgt",
    do.astype(acc_dtype),
    out.reshape(do.shape).astype(acc_dtype),
    precision=args.precision,
  )
  lse_safe = jnp.where(jnp.isfinite(lse), lse, jnp.inf)[..., None]
  bias = chunks.bias

  def step(carry, i):
    dq, dbias = carry
    logits, k, v = chunks.logits(args, q, i)
    p = jnp.exp(logits - lse_safe)
    dv = jnp.einsum(
      "bkgts,btkgh->bskh",
      p.astype(do.dtype),
      do,
      precision=args.precision,
      preferred_element_type=acc_dtype,
    )
    dp = spec.row_products(do, v, args.precision, acc_dtype)
    ds = p * (dp - delta[..., None])
    if args.soft_cap is not None:
      capped = jnp.where(jnp.isfinite(logits), logits, 0.0) / args.soft_cap
      ds = ds * (1.0 - capped * capped)
    if dbias is not None:
      dbias = _accumulate_bias(dbias, ds, i * chunks.size, chunks.size)
    ds_c = ds.astype(q.dtype)
    dq = dq + jnp.einsum(
      "bkgts,bskh->btkgh", ds_c, k, precision=args.precision, preferred_element_type=acc_dtype
    )
    qg = q.reshape(b, t, kh, g, h)
    dk = jnp.einsum(
      "bkgts,btkgh->bskh", ds_c, qg, precision=args.precision, preferred_element_type=acc_dtype
    )
    return (dq, dbias), (dk * args.scale, dv)

  dbias0 = None if bias is None else jnp.zeros(bias.shape, acc_dtype)
  init = (jnp.zeros((b, t, kh, g, h), acc_dtype), dbias0)
  init = partitioning.vary(init, partitioning.record_vma(args))
  (dq, dbias), (dk, dv) = jax.lax.scan(step, init, jnp.arange(chunks.count))

  def unchunk(x):  # [count, B, C, K, H] -> [B, S, K, H]
    x = jnp.moveaxis(x, 0, 1).reshape(b, chunks.padded, *x.shape[3:])
    return x[:, : chunks.s]

  grads = {
    "query": (dq * args.scale).reshape(q.shape).astype(q.dtype),
    "key": unchunk(dk).astype(args.key.dtype),
    "value": unchunk(dv).astype(args.value.dtype),
  }
  if dbias is not None:
    grads["bias"] = dbias[..., : args.bias.shape[3]].astype(args.bias.dtype)
  return grads


def _accumulate_bias(dbias: jax.Array, ds: jax.Array, start, size: int) -> jax.Array:
  """Adds ds [B,K,G,T,C] into dbias [B|1,N|1,T|1,S|1], summing broadcast dims."""
  b, kh, g, t, c = ds.shape
  ds = ds.reshape(b, kh * g, t, c)
  for axis in range(3):
    if dbias.shape[axis] == 1:
      ds = ds.sum(axis=axis, keepdims=True)
  if dbias.shape[3] == 1:
    return dbias + ds.sum(axis=3, keepdims=True)
  current = jax.lax.dynamic_slice_in_dim(dbias, start, size, 3)
  return jax.lax.dynamic_update_slice_in_dim(dbias, current + ds, start, 3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaChunkedAttention(op.Op):
  """Flash-style attention in XLA: a scan over key/value chunks."""

  name = "xla_chunked"
  spec = spec.SPEC
  config_cls = ChunkedConfig

  def _fwd(self, args, config):
    return _forward(args, config)

  def _bwd(self, args, config, out, residuals, dout):
    return backward(args, config, out, residuals, dout)

  def _get_heuristics_config(self, args):
    return ChunkedConfig(kv_chunk_size=min(512, chunkable_keys(args)))

  def _get_autotuning_configs(self, args):
    s = chunkable_keys(args)
    return {ChunkedConfig(kv_chunk_size=min(c, s)) for c in (128, 256, 512, 1024, 2048)}
