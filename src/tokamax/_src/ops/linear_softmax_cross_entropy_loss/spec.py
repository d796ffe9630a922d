"""The linear_softmax_cross_entropy_loss op: cross entropy of softmax(x @ W)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from tokamax._src import arguments, validation
from tokamax._src.ops import op
from tokamax._src.ops import partitioning as partitioning_lib

REDUCTIONS = ("sum", "mean", "none")


@arguments.op_arguments
class LossArgs:
  """Canonical arguments of `linear_softmax_cross_entropy_loss`."""

  x: Float[Array, "B H"]
  labels: Int[Array, " B"]
  weights: Float[Array, "H V"]
  reduction: str = arguments.static()
  precision: object = arguments.static()
  # On one shard of a call on vocabulary-sharded `weights` (set by `partitioning`): the
  # devices the vocabulary is split over; `labels` then count from the shard's first column.
  vocab_shard: partitioning_lib.Shard | None = arguments.static(None)


def canonicalize(x, labels, weights, *, reduction="sum", precision=None) -> LossArgs:
  x = validation.floating("x", x)
  weights = validation.floating("weights", weights)
  labels = validation.integer("labels", labels)
  validation.rank("x", x, 2, "x [B, H]")
  validation.rank("weights", weights, 2, "weights [H, V]")
  validation.rank("labels", labels, 1, "labels [B]")
  validation.same_dtype(x=x, weights=weights)
  if weights.shape[0] != x.shape[1]:
    raise ValueError(f"`weights` rows {weights.shape[0]} must equal `x` features {x.shape[1]}.")
  if labels.shape[0] != x.shape[0]:
    raise ValueError(f"`labels` length {labels.shape[0]} must equal `x` rows {x.shape[0]}.")
  if reduction not in REDUCTIONS:
    raise ValueError(f"`reduction` must be one of {REDUCTIONS}, got {reduction!r}.")
  validation.concrete_within("labels", labels, 0, weights.shape[1])
  return LossArgs(
    x=x,
    labels=labels.astype(jnp.int32),
    weights=weights,
    reduction=reduction,
    precision=validation.precision(precision),
  )


def empty_reason(args: LossArgs) -> str | None:
  """Why a kernel does not take `args`: no rows or an empty H (the XLA forms do), or None."""
  b, h = args.x.shape
  if b == 0 or h == 0:
    return f"empty dimension (B={b}, H={h})"
  return None


def reduce(args: LossArgs, per_row: jax.Array) -> jax.Array:
  if args.reduction == "sum":
    return per_row.sum()
  if args.reduction == "mean":
    return per_row.mean()
  return per_row


def label_columns(args: LossArgs, start: int = 0) -> tuple[jax.Array, jax.Array]:
  """Each row's label as a column of `weights[:, start:]` (clipped into them), and whether
  they hold it (on a vocabulary shard, another shard may; past a kernel's tiles, the tail)."""
  v = args.weights.shape[1]
  held = (args.labels >= start) & (args.labels < v)
  return jnp.clip(args.labels - start, 0, v - start - 1), held


def picked_logits(args: LossArgs, logits: jax.Array, start: int = 0) -> jax.Array:
  """[B]: each row's logit at its label from `logits` [B, C] of columns [start, V) (0 where
  they do not hold the label)."""
  columns, held = label_columns(args, start)
  picked = jnp.take_along_axis(logits, columns[:, None], axis=-1)[:, 0]
  return jnp.where(held, picked, 0.0)


def label_logits(args: LossArgs) -> jax.Array:
  """float32 [B]: each row's logit at its label, from the B gathered weight columns (0
  where `weights` does not hold the label)."""
  columns, held = label_columns(args)
  logits = jnp.einsum(
    "bh,hb->b",
    args.x,
    jnp.take(args.weights, columns, axis=1),  # [H, B]
    precision=args.precision,
    preferred_element_type=jnp.float32,
  )
  return jnp.where(held, logits, 0.0)


def valid_labels(args: LossArgs) -> jax.Array:
  """bool [B]: whether each row's label lies in the vocabulary (on one of its shards).

  Traced labels cannot be checked when the call is made (`canonicalize` checks concrete
  ones); a row whose label lies outside gets a NaN loss rather than its log-sum-exp.
  """
  _, held = label_columns(args)
  shard = args.vocab_shard
  if shard is None:
    return held
  held = partitioning_lib.vary(held.astype(jnp.int32), partitioning_lib.record_vma(args))
  return jax.lax.psum(held, shard.axes) == 1


def loss(args: LossArgs, lse: jax.Array, label_logit: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The output and each row's log-sum-exp over the vocabulary, from the rows' log-sum-exp
  and label logit [B] over the columns of `weights`; rows whose label lies outside the
  vocabulary lose NaN.

  On a vocabulary shard (`vocab_shard`) the log-sum-exps combine over the shards and the
  output is the shard's share of the loss, which `partitioning` sums: an even share of the
  log-sum-exp less the label's logit where the shard holds the label.
  """
  shard = args.vocab_shard
  if shard is None:
    return reduce(args, _nan_unless(valid_labels(args), lse - label_logit)), lse
  lse = partitioning_lib.vary(lse, partitioning_lib.record_vma(args))  # A kernel's is untyped.
  top = jax.lax.pmax(jax.lax.stop_gradient(lse), shard.axes)
  lse = top + jnp.log(jax.lax.psum(jnp.exp(lse - top), shard.axes))
  per_row = _nan_unless(valid_labels(args), lse / shard.count - label_logit)
  return reduce(args, per_row), lse


def _nan_unless(ok: jax.Array, x: jax.Array) -> jax.Array:
  return jnp.where(ok, x, jnp.asarray(jnp.nan, x.dtype))


def with_tail_columns(
  args: LossArgs, lse: jax.Array, start: int, label_logit: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None]:
  """`lse` [B] of columns [0, start) combined with the columns from `start` on (in XLA): the
  vocabulary past a kernel's last whole tile; and `label_logit` [B] of columns [0, start)
  with the label's logit where the tail holds it (None stays None)."""
  v = args.weights.shape[1]
  if start >= v:
    return lse, label_logit
  tail = jnp.matmul(
    args.x, args.weights[:, start:], precision=args.precision, preferred_element_type=jnp.float32
  )
  lse = jnp.logaddexp(lse, jax.nn.logsumexp(tail, axis=1))
  if label_logit is not None:
    label_logit = label_logit + picked_logits(args, tail, start)
  return lse, label_logit


def cost(args: LossArgs) -> op.Cost:
  b, h = args.x.shape
  v = args.weights.shape[1]
  itemsize = np.dtype(args.x.dtype).itemsize
  return op.Cost(flops=2.0 * b * h * v, bytes=float(itemsize * (b * h + h * v)))


def _localize(args: LossArgs, shards) -> LossArgs:
  """One vocabulary shard's labels, counted from its first column (see `loss`)."""
  if "v" not in shards:
    return args
  first = shards["v"].index() * args.weights.shape[1]
  return dataclasses.replace(args, labels=args.labels - first, vocab_shard=shards["v"])


def partitioning(args: LossArgs) -> partitioning_lib.Rule:
  """Rows split; a reduced loss is summed or averaged over them. The vocabulary splits
  too: each shard's output is its share of the loss (`loss`), and the shares add up."""
  combine = {"v": "sum"} if args.reduction == "none" else {"b": args.reduction, "v": "sum"}
  return partitioning_lib.Rule(
    {"x": ("b", "h"), "labels": ("b",), "weights": ("h", "v")},
    ("b",) if args.reduction == "none" else (),
    frozenset(("b", "v")),
    combine,
    _localize,
  )


def _random_labels(args: LossArgs, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
  """Integer inputs for timing: uniform labels over the vocabulary."""
  return rng.integers(0, args.weights.shape[1], shape, np.int32)


# Bytes of float32 [B, V] logits up to which `implementation=None` differentiates through XLA.
MATERIALIZED_LOGITS_LIMIT = 8 * 2**30


def gradient_preference(args: LossArgs, platform: str) -> tuple[str, ...]:
  """XLA under differentiation on a GPU while its float32 logits fit the limit.

  Keeping the logits costs three GEMMs for forward and backward; the kernels
  recompute them in a fourth (H200, B8192 H4096 V131072 bf16: 42.1 against
  60.0 ms, bench/results/h200/bench_run_748cea4.json). Above the limit, the
  kernels' few hundred megabytes win.
  """
  logits_bytes = 4 * args.x.shape[0] * args.weights.shape[1]
  if platform == "gpu" and logits_bytes <= MATERIALIZED_LOGITS_LIMIT:
    return ("xla",)
  return ()


SPEC = op.OpSpec(
  name="linear_softmax_cross_entropy_loss",
  canonicalize=canonicalize,
  implementations={
    "xla": "tokamax._src.ops.linear_softmax_cross_entropy_loss.xla:XlaLoss",
    "chunked_xla": "tokamax._src.ops.linear_softmax_cross_entropy_loss.chunked_xla:ChunkedXlaLoss",
    "mosaic": "tokamax._src.ops.linear_softmax_cross_entropy_loss.mosaic:MosaicLoss",
    "mosaic_tpu": "tokamax._src.ops.linear_softmax_cross_entropy_loss.mosaic_tpu:MosaicTpuLoss",
  },
  # "mosaic" names the Mosaic GPU kernel on every platform; the TPU one is "mosaic_tpu".
  preference={"gpu": ("mosaic",), "tpu": ("mosaic_tpu",)},
  gradient_preference=gradient_preference,
  cost=cost,
  partitioning=partitioning,
  integer_inputs={"labels": _random_labels},
)
