"""Public dot_product_attention."""

from collections.abc import Sequence
from typing import Literal

import jax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from tokamax._src.ops.attention import spec

Implementation = Literal["xla", "xla_chunked", "cudnn", "triton", "mosaic", "mosaic_tpu"]


def dot_product_attention(
  query: Float[Array, "*B T N H"],
  key: Float[Array, "*B S K H"],
  value: Float[Array, "*B S K h"],
  bias: Float[Array, "*#B #N #T #S"] | None = None,
  mask: Bool[Array, "*#B #N #T #S"] | None = None,
  *,
  scale: float | None = None,
  is_causal: bool = False,
  query_seq_lengths: Int[Array, "*#B"] | None = None,
  key_value_seq_lengths: Int[Array, "*#B"] | None = None,
  local_window_size: int | tuple[int, int] | None = None,
  logits_soft_cap: float | None = None,
  precision: jax.lax.PrecisionLike = None,
  implementation: Implementation | Sequence | None = None,
  q_sharding: NamedSharding | None = None,
) -> Float[Array, "*B T N h"]:
  """Scaled dot-product attention, `softmax(scale * q k^T + bias) v`.

  Args:
    query: Queries [*B, T, N, H].
    key: Keys [*B, S, K, H]; N must be a multiple of K (GQA and MQA).
    value: Values [*B, S, K, h].
    bias: Added to the scaled logits, broadcastable to [*B, N, T, S].
    mask: Boolean, True where a query may see a key; broadcastable as `bias`.
    scale: Logit scale; defaults to 1/sqrt(H).
    is_causal: Query i sees keys j <= i.
    query_seq_lengths: Valid query rows per batch element; the rest are zero.
    key_value_seq_lengths: Valid keys per batch element.
    local_window_size: Query i sees keys in [i - left, i + right]; an int is
      a symmetric window.
    logits_soft_cap: If set, logits become `c * tanh(logits / c)` after scale
      and bias.
    precision: Matmul precision.
    implementation: A name, an Op, a sequence of them, or None for the best.
    q_sharding: If set, attention runs per shard of the query's batch and head
      dims over this sharding's mesh.

  Returns:
    The attention output [*B, T, N, h]; rows that see no key are zero.
  """
  kwargs = dict(
    scale=scale,
    is_causal=is_causal,
    query_seq_lengths=query_seq_lengths,
    key_value_seq_lengths=key_value_seq_lengths,
    local_window_size=local_window_size,
    logits_soft_cap=logits_soft_cap,
    precision=precision,
    implementation=implementation,
  )
  if q_sharding is not None:
    return _per_shard(q_sharding, query, key, value, bias, mask, kwargs)
  return spec.SPEC(query, key, value, bias, mask, **kwargs)


def _per_shard(sharding, query, key, value, bias, mask, kwargs):
  """Runs attention inside `shard_map`, splitting batch and head dims as `sharding` does."""
  if not isinstance(sharding, NamedSharding):
    raise TypeError(f"`q_sharding` must be a NamedSharding, got {type(sharding).__name__}.")
  ndim = query.ndim
  axes = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
  if len(axes) != ndim:
    raise ValueError(f"`q_sharding` spec {sharding.spec} has more entries than query dims {ndim}.")
  *batch, t_axis, n_axis, h_axis = axes
  if t_axis is not None or h_axis is not None:
    raise ValueError(
      f"`q_sharding` may split the batch and head dims only; got spec {sharding.spec} "
      "splitting T or H."
    )
  k_axis = n_axis if key.shape[-2] > 1 else None
  kv_spec = PartitionSpec(*batch, None, k_axis, None)

  def side_spec(x, trailing):
    """Spec of bias/mask ([*#B, #N, #T, #S], trailing=3) or lengths ([*#B], trailing=0)."""
    if x is None or x.ndim < trailing:
      return PartitionSpec()  # No batch or head dims (e.g. a bias [#T, #S]): whole on each.
    lead = x.shape[: x.ndim - trailing]
    batch_part = [
      a if d > 1 else None for a, d in zip(batch[len(batch) - len(lead) :], lead, strict=True)
    ]
    if trailing == 0:
      return PartitionSpec(*batch_part)
    return PartitionSpec(*batch_part, n_axis if x.shape[-3] > 1 else None, None, None)

  lengths = {name: kwargs.pop(name) for name in ("query_seq_lengths", "key_value_seq_lengths")}
  arrays = (
    query,
    key,
    value,
    bias,
    mask,
    lengths["query_seq_lengths"],
    lengths["key_value_seq_lengths"],
  )
  specs = (
    PartitionSpec(*axes),
    kv_spec,
    kv_spec,
    side_spec(bias, 3),
    side_spec(mask, 3),
    side_spec(lengths["query_seq_lengths"], 0),
    side_spec(lengths["key_value_seq_lengths"], 0),
  )

  def local(q, k, v, b, m, ql, kl):
    return spec.SPEC(q, k, v, b, m, query_seq_lengths=ql, key_value_seq_lengths=kl, **kwargs)

  return jax.shard_map(
    local, mesh=sharding.mesh, in_specs=specs, out_specs=PartitionSpec(*axes), check_vma=False
  )(*arrays)
