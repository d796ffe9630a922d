"""The loss over vocabulary chunks: no [B, V] logits in memory, forward or backward."""

import dataclasses
import math

import jax
import jax.numpy as jnp

from tokamax._src import numerics
from tokamax._src.ops import op, partitioning
from tokamax._src.ops.linear_softmax_cross_entropy_loss import spec


@dataclasses.dataclass(frozen=True)
class ChunkedLossConfig:
  """Args: vocab_chunk_size: vocabulary columns per scan step."""

  vocab_chunk_size: int = 4096

  def __post_init__(self):
    if self.vocab_chunk_size < 1:
      raise ValueError(f"`vocab_chunk_size` must be positive, got {self.vocab_chunk_size}.")


class _Chunks:
  """Vocabulary chunks of `size` columns; the last one ends at V (overlapping its predecessor).

  No padded copy of the weights: every chunk is a slice of them. Columns of the
  last chunk that an earlier chunk covered are `repeated`: they count once in
  the sums, and their weight gradients are written twice with the same values.
  """

  def __init__(self, args: spec.LossArgs, size: int):
    v = args.weights.shape[1]
    self.size = min(size, v)
    self.count = math.ceil(v / self.size)
    self.v = v

  def logits(self, args: spec.LossArgs, i):
    """Logits [B, C] of chunk i, its first column, weights and repeated columns [C]."""
    start = jnp.minimum(i * self.size, self.v - self.size)
    w = jax.lax.dynamic_slice_in_dim(args.weights, start, self.size, 1)
    repeated = start + jnp.arange(self.size) < i * self.size
    logits = jnp.matmul(
      args.x,
      w,
      precision=args.precision,
      preferred_element_type=numerics.accumulation_dtype(args.x.dtype),
    )
    return logits, start, w, repeated


def _forward(args: spec.LossArgs, config: ChunkedLossConfig):
  chunks = _Chunks(args, config.vocab_chunk_size)
  b = args.x.shape[0]

  def step(carry, i):
    m, s, picked = carry
    logits, start, _, repeated = chunks.logits(args, i)
    logits = jnp.where(repeated, -jnp.inf, logits)
    m_chunk, s_chunk = numerics.row_max_and_sum(logits)
    m_new = jnp.maximum(m, m_chunk)
    s = s * jnp.exp(m - m_new) + s_chunk * jnp.exp(m_chunk - m_new)
    hit = (start + jnp.arange(chunks.size))[None, :] == args.labels[:, None]
    picked = picked + jnp.where(hit & ~repeated, logits, 0.0).sum(-1)
    return (m_new, s, picked), None

  acc = numerics.accumulation_dtype(args.x.dtype)
  init = (jnp.full((b,), -jnp.inf, acc), jnp.zeros((b,), acc), jnp.zeros((b,), acc))
  init = partitioning.vary(init, partitioning.record_vma(args))  # Inside shard_map.
  (m, s, picked), _ = jax.lax.scan(step, init, jnp.arange(chunks.count))
  return spec.loss(args, m + jnp.log(s), picked)


def row_cotangents(args: spec.LossArgs, dout: jax.Array) -> jax.Array:
  """The cotangent of each row's loss [B] (accumulation dtype) from the output's."""
  b = args.x.shape[0]
  if args.reduction == "sum":
    g = jnp.broadcast_to(dout, (b,))
  elif args.reduction == "mean":
    g = jnp.broadcast_to(dout / b, (b,))
  else:
    g = dout
  g = jnp.where(spec.valid_labels(args), g, jnp.nan)  # No gradient of a label not in V.
  return g.astype(numerics.accumulation_dtype(args.x.dtype))


def logit_cotangents(args: spec.LossArgs, logits, first_column, lse, g) -> jax.Array:
  """The cotangent of logits [B, C] (columns from `first_column` on), in x's dtype:
  (softmax - onehot(labels)) x the rows' cotangents `g`."""
  hit = (first_column + jnp.arange(logits.shape[1]))[None, :] == args.labels[:, None]
  return ((jnp.exp(logits - lse[:, None]) - hit) * g[:, None]).astype(args.x.dtype)


def backward(args: spec.LossArgs, config: ChunkedLossConfig, lse, dout):
  """Cotangents of x and weights from the log-sum-exp residuals, a chunk at a time.

  dweights is written chunk by chunk into one buffer of the weights' dtype (the
  output itself), so the temporaries stay one chunk's size.
  """
  chunks = _Chunks(args, config.vocab_chunk_size)
  acc = numerics.accumulation_dtype(args.x.dtype)
  g = row_cotangents(args, dout)

  def step(carry, i):
    dx, dw = carry
    logits, start, w, repeated = chunks.logits(args, i)
    dlogits = logit_cotangents(args, logits, start, lse, g)
    # Repeated columns: their dweights again (the same values), but dx only once.
    dx = dx + jnp.matmul(
      jnp.where(repeated, jnp.zeros((), dlogits.dtype), dlogits),
      w.T,
      precision=args.precision,
      preferred_element_type=acc,
    )
    dw_chunk = jnp.matmul(args.x.T, dlogits, precision=args.precision, preferred_element_type=acc)
    dw = jax.lax.dynamic_update_slice_in_dim(dw, dw_chunk.astype(dw.dtype), start, 1)
    return (dx, dw), None

  init = (jnp.zeros(args.x.shape, acc), jnp.zeros(args.weights.shape, args.weights.dtype))
  init = partitioning.vary(init, partitioning.record_vma(args))
  (dx, dw), _ = jax.lax.scan(step, init, jnp.arange(chunks.count))
  return {"x": dx.astype(args.x.dtype), "weights": dw}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkedXlaLoss(op.Op):
  """A scan over vocabulary chunks with an online log-sum-exp and a custom backward."""

  name = "chunked_xla"
  spec = spec.SPEC
  config_cls = ChunkedLossConfig

  def _fwd(self, args, config):
    return _forward(args, config)

  def _bwd(self, args, config, out, residuals, dout):
    return backward(args, config, residuals, dout)

  def _get_autotuning_configs(self, args):
    v = args.weights.shape[1]
    return {ChunkedLossConfig(min(c, v)) for c in (1024, 2048, 4096, 8192, 16384)}
