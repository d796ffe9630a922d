"""The loss over vocabulary chunks: no [B, V] logits in memory, forward or backward."""

import dataclasses
import math

import jax
import jax.numpy as jnp

from tokamax._src import numerics
from tokamax._src.ops import op
from tokamax._src.ops.linear_softmax_cross_entropy_loss import spec


@dataclasses.dataclass(frozen=True)
class ChunkedLossConfig:
  """Args: vocab_chunk_size: vocabulary columns per scan step."""

  vocab_chunk_size: int = 4096

  def __post_init__(self):
    if self.vocab_chunk_size < 1:
      raise ValueError(f"`vocab_chunk_size` must be positive, got {self.vocab_chunk_size}.")


class _Chunks:
  def __init__(self, args: spec.LossArgs, size: int):
    v = args.weights.shape[1]
    self.size = min(size, v)
    self.count = math.ceil(v / self.size)
    self.v = v
    self.weights = jnp.pad(args.weights, ((0, 0), (0, self.count * self.size - v)))

  def logits(self, args: spec.LossArgs, i):
    """Logits [B, C] of chunk i (-inf past V), its weights and column ids."""
    w = jax.lax.dynamic_slice_in_dim(self.weights, i * self.size, self.size, 1)
    cols = i * self.size + jnp.arange(self.size)
    logits = jnp.matmul(
      args.x,
      w,
      precision=args.precision,
      preferred_element_type=numerics.accumulation_dtype(args.x.dtype),
    )
    return jnp.where(cols < self.v, logits, -jnp.inf), w, cols


def _forward(args: spec.LossArgs, config: ChunkedLossConfig):
  chunks = _Chunks(args, config.vocab_chunk_size)
  b = args.x.shape[0]

  def step(carry, i):
    m, s, picked = carry
    logits, _, cols = chunks.logits(args, i)
    m_new = jnp.maximum(m, logits.max(-1))
    s = s * jnp.exp(m - m_new) + jnp.exp(logits - m_new[:, None]).sum(-1)
    hit = cols[None, :] == args.labels[:, None]
    picked = picked + jnp.where(hit, logits, 0.0).sum(-1)
    return (m_new, s, picked), None

  acc = numerics.accumulation_dtype(args.x.dtype)
  init = (jnp.full((b,), -jnp.inf, acc), jnp.zeros((b,), acc), jnp.zeros((b,), acc))
  (m, s, picked), _ = jax.lax.scan(step, init, jnp.arange(chunks.count))
  lse = m + jnp.log(s)
  return spec.reduce(args, lse - picked), lse


def backward(args: spec.LossArgs, config: ChunkedLossConfig, lse, dout):
  chunks = _Chunks(args, config.vocab_chunk_size)
  b = args.x.shape[0]
  if args.reduction == "sum":
    g = jnp.broadcast_to(dout, (b,))
  elif args.reduction == "mean":
    g = jnp.broadcast_to(dout / b, (b,))
  else:
    g = dout
  g = g.astype(numerics.accumulation_dtype(args.x.dtype))

  def step(dx, i):
    logits, w, cols = chunks.logits(args, i)
    hit = cols[None, :] == args.labels[:, None]
    dlogits = (jnp.exp(logits - lse[:, None]) - hit) * g[:, None]
    dlogits = dlogits.astype(args.x.dtype)
    dx = dx + jnp.matmul(
      dlogits, w.T, preferred_element_type=numerics.accumulation_dtype(args.x.dtype)
    )
    dw = jnp.matmul(
      args.x.T, dlogits, preferred_element_type=numerics.accumulation_dtype(args.x.dtype)
    )
    return dx, dw

  dx, dw = jax.lax.scan(
    step,
    jnp.zeros(args.x.shape, numerics.accumulation_dtype(args.x.dtype)),
    jnp.arange(chunks.count),
  )
  dw = jnp.moveaxis(dw, 0, 1).reshape(args.x.shape[1], -1)[:, : chunks.v]
  return {"x": dx.astype(args.x.dtype), "weights": dw.astype(args.weights.dtype)}


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
