"""linear_softmax_cross_entropy_loss with a fused Pallas Mosaic GPU kernel (Hopper, sm_90).

The forward pass never writes the [B, V] logits: `mosaic_kernel.tile_stats`
reduces each (row tile, vocabulary tile) of x @ weights to its per-row
log-sum-exp and the logit at its label in the GEMM's epilogue, and XLA combines
the tiles. Vocabulary columns past the last whole tile are a small XLA matmul. A
vocabulary that is not a multiple of 64 columns (V=50257) costs a padded copy of
the weights. The backward pass recomputes the logits a vocabulary chunk at a time
(`chunked_xla`'s backward), so that no [B, V] array exists there either.

With `gradient_in_forward`, differentiation takes one pass over row chunks instead:
each chunk's logits (the kernel, which also writes their exponentials, over which
a second kernel writes the logits' cotangent) give both gradients for a unit
cotangent, so three GEMMs in all rather than four; dweights accumulates over the
chunks in the weights' dtype.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tokamax._src.ops import kernel_ops, partitioning
from tokamax._src.ops import mosaic_gemm as gemm
from tokamax._src.ops.linear_softmax_cross_entropy_loss import chunked_xla, mosaic_kernel, spec

_DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicLossConfig:
  """Tiling of the fused kernel and the backward pass's vocabulary chunks.

  Attributes:
    block_n: Vocabulary columns per work item of the kernel.
    num_stages: Shared-memory stages of the kernel's load pipeline.
    grid_tile_m: Row tiles visited together before moving along the vocabulary.
    vocab_chunk_size: Vocabulary columns per step of the backward pass.
    gradient_in_forward: Under differentiation with reduction "sum" or "mean",
      unsharded and V a multiple of 64: both gradients in the forward pass, one
      row chunk at a time (three GEMMs; see the module docstring), each chunk's
      [rows, V] exponentials in x's dtype in memory.
    row_chunks: Row chunks of `gradient_in_forward`: memory against the
      roundings of dweights (one per chunk).
  """

  block_n: int = 256
  num_stages: int = 4
  grid_tile_m: int = 32
  vocab_chunk_size: int = 4096
  gradient_in_forward: bool = False
  row_chunks: int = 8

  # The fields the forward kernel ignores (see `Op._forward_config`).
  BACKWARD_FIELDS: ClassVar[tuple[str, ...]] = (
    "vocab_chunk_size",
    "gradient_in_forward",
    "row_chunks",
  )

  def __post_init__(self):
    if self.row_chunks < 1:
      raise ValueError(f"`row_chunks` must be positive, got {self.row_chunks}.")


class UnitGradients(NamedTuple):
  """The gradients of x and weights for a unit cotangent of the output."""

  x: jax.Array
  weights: jax.Array


def _kernel_config(dtype, config: MosaicLossConfig) -> mosaic_kernel.MosaicLossKernelConfig:
  return mosaic_kernel.MosaicLossKernelConfig(
    block_n=config.block_n,
    block_k=gemm.swizzle_elems(dtype),
    num_stages=config.num_stages,
    grid_tile_m=config.grid_tile_m,
  )


def row_stats(
  args: spec.LossArgs, config: MosaicLossConfig, interpret=None
) -> tuple[jax.Array, jax.Array]:
  """float32 [B] each: the log-sum-exp of each row of x @ weights and its label's logit (0
  where `weights` does not hold the label), without the [B, V] logits."""
  x, w = args.x, args.weights
  b, v = x.shape[0], w.shape[1]
  kernel_config = _kernel_config(x.dtype, config)
  n_tiles = v // config.block_n
  rows = -b % kernel_config.block_m  # Whole row tiles: the padding rows are dropped.
  padded = jnp.pad(x, ((0, rows), (0, 0))) if rows else x
  labels = jnp.pad(args.labels, (0, rows), constant_values=-1) if rows else args.labels
  # The kernel's TMA tiling needs V to be a multiple of its 128-byte swizzle span: for other
  # V (50257) it reads a padded copy (its tiles never reach the padding).
  align = gemm.swizzle_elems(w.dtype)
  w_kernel = jnp.pad(w, ((0, 0), (0, -v % align))) if v % align else w
  lse_tiles, label_tiles = mosaic_kernel.tile_stats(
    padded,
    w_kernel,
    labels,
    n_tiles=n_tiles,
    config=kernel_config,
    num_sms=gemm.num_sms(interpret is not None),
    interpret=interpret,
  )
  lse = jax.nn.logsumexp(lse_tiles[:, :b], axis=0)
  return spec.with_tail_columns(args, lse, n_tiles * config.block_n, label_tiles[:, :b].sum(0))


def in_forward_reason(args: spec.LossArgs) -> str | None:
  """Why `gradient_in_forward` cannot serve `args` (the backward then recomputes), or None."""
  if args.reduction == "none":
    return "reduction none: each row's cotangent is known only in the backward pass"
  if args.vocab_shard is not None:
    return "a vocabulary shard: the log-sum-exps combine over the shards first"
  v = args.weights.shape[1]
  if v % gemm.swizzle_elems(args.weights.dtype):
    return f"V={v} is not a multiple of {gemm.swizzle_elems(args.weights.dtype)}"
  return None


def gradient_in_forward(
  args: spec.LossArgs, config: MosaicLossConfig, interpret=None
) -> tuple[jax.Array, UnitGradients]:
  """The output and the gradients for a unit cotangent, from one pass over row chunks.

  Each chunk's kernel pass gives its rows' log-sum-exps and exponentials;
  `mosaic_kernel.cotangent_in_place` turns those into the logits' cotangent (in
  x's dtype, the same buffer), which gives the chunk's rows of dx and adds the
  chunk's share to dweights, which stays in the weights' dtype.

  Args:
    args: The call (`in_forward_reason(args)` is None).
    config: Tiling and `row_chunks`.
    interpret: Pallas interpret parameters, or None.

  Returns:
    The op's output, and dx and dweights for a unit cotangent of it.
  """
  x, w = args.x, args.weights
  b, v = x.shape[0], w.shape[1]
  kernel_config = _kernel_config(x.dtype, config)
  block_m, bn = kernel_config.block_m, config.block_n
  rows = -(-b // config.row_chunks)
  rows += -rows % block_m
  count = -(-b // rows)
  pad = count * rows - b
  xs = jnp.pad(x, ((0, pad), (0, 0)))
  labels = jnp.pad(args.labels, (0, pad), constant_values=-1)
  weight = 1.0 if args.reduction == "sum" else 1.0 / b
  # A row whose label lies outside the vocabulary has a NaN cotangent, as `row_cotangents`
  # gives: its dx row and all of dweights are NaN, and the backward is a plain scale.
  weights = jnp.where(spec.valid_labels(args), weight, jnp.nan).astype(jnp.float32)
  row_weights = jnp.pad(weights, (0, pad))
  n_tiles = v // bn
  main = n_tiles * bn
  num_sms = gemm.num_sms(interpret is not None)
  matmul = lambda a, c, out: jnp.matmul(a, c, precision=args.precision, preferred_element_type=out)

  def chunk_pass(i, dw):
    """Chunk i's dx rows, dweights with its share (`dw` is None: only its share), lse and
    label logits."""
    chunk = lambda a: lax.dynamic_slice_in_dim(a, i * rows, rows)
    xc, lc = chunk(xs), chunk(labels)
    lse_tiles, picked_tiles, top, probs = mosaic_kernel.tile_stats(
      xc,
      w,
      lc,
      n_tiles=n_tiles,
      config=kernel_config,
      num_sms=num_sms,
      probabilities=True,
      interpret=interpret,
    )
    chunk_lse, chunk_picked = jax.nn.logsumexp(lse_tiles, axis=0), picked_tiles.sum(0)
    rw = chunk(row_weights)
    if main < v:  # The columns past the last whole tile, in XLA, as probabilities.
      tail = matmul(xc, w[:, main:], jnp.float32)
      chunk_lse = jnp.logaddexp(chunk_lse, jax.nn.logsumexp(tail, axis=1))
      chunk_picked += jnp.where(jnp.arange(main, v) == lc[:, None], tail, 0.0).sum(1)
      tail_probs = jnp.exp(tail - chunk_lse[:, None]).astype(probs.dtype)
      probs = lax.dynamic_update_slice(probs, tail_probs, (0, main))
    # What turns each tile's exponentials (the tail's probabilities) into the softmax term.
    scale = jnp.exp(top - chunk_lse) * rw
    if main < v:
      scale = jnp.concatenate([scale, rw[None]])
    dlogits = mosaic_kernel.cotangent_in_place(
      probs, scale, lc, rw, block_n=bn, num_sms=num_sms, interpret=interpret
    )
    dx_rows = matmul(dlogits, w.T, x.dtype)  # No float32 [rows, H] in memory.
    share = matmul(xc.T, dlogits, w.dtype)  # With `dw`, one GEMM that adds in place.
    return dx_rows, share if dw is None else dw + share, chunk_lse, chunk_picked

  def step(i, carry):
    dx, dw, lse, picked = carry
    dx_rows, dw, chunk_lse, chunk_picked = chunk_pass(i, dw)
    update = lambda a, u: lax.dynamic_update_slice_in_dim(a, u, i * rows, 0)
    return update(dx, dx_rows), dw, update(lse, chunk_lse), update(picked, chunk_picked)

  # The first chunk's share is dweights' first value: no zeros to fill and add to.
  dx_rows, dw, chunk_lse, chunk_picked = chunk_pass(0, None)
  init = (
    jnp.zeros(xs.shape, x.dtype).at[:rows].set(dx_rows),
    dw,
    jnp.zeros((count * rows,), jnp.float32).at[:rows].set(chunk_lse),
    jnp.zeros((count * rows,), jnp.float32).at[:rows].set(chunk_picked),
  )
  init = partitioning.vary(init, partitioning.record_vma(args))
  dx, dw, lse, picked = lax.fori_loop(1, count, step, init)
  out, _ = spec.loss(args, lse[:b], picked[:b])
  return out, UnitGradients(dx[:b], dw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicLoss(kernel_ops.MosaicGpuOp):
  """Fused matmul + log-sum-exp kernel forward; chunked recomputation backward."""

  name = "mosaic"
  spec = spec.SPEC
  config_cls = MosaicLossConfig

  def _unsupported_reason(self, args: spec.LossArgs) -> str | None:
    dtype = np.dtype(args.x.dtype).name
    if dtype not in _DTYPES:
      return f"input dtype {dtype} (supported: {', '.join(_DTYPES)})"
    if (reason := spec.empty_reason(args)) is not None:
      return reason
    config = self.config if self.config is not None else self._get_heuristics_config(args)
    h, v = args.weights.shape
    if v < config.block_n:
      return f"V={v} is below one vocabulary tile (block_n={config.block_n})"
    if config.gradient_in_forward and in_forward_reason(args) is not None:
      # `_fwd` falls back to the recomputing backward: the kernel writes no exponentials.
      config = dataclasses.replace(config, gradient_in_forward=False)
    itemsize = np.dtype(args.x.dtype).itemsize
    return mosaic_kernel.config_reason(
      _kernel_config(args.x.dtype, config), h, itemsize, config.gradient_in_forward
    )

  def _get_heuristics_config(self, args: spec.LossArgs) -> MosaicLossConfig:
    h, v = args.weights.shape
    block_k = gemm.swizzle_elems(args.x.dtype)
    # 3 stages and 8-row-tile bands: 0.96x the time of 4 stages and 32-row-tile bands at
    # B8192 H4096 V131072 and B4096 H4096 V256000 (h200/loss_sweep_8ceb7ef.json).
    return MosaicLossConfig(
      block_n=256 if v >= 256 else 128, num_stages=min(3, max(2, h // block_k)), grid_tile_m=8
    )

  def _get_autotuning_configs(self, args: spec.LossArgs) -> set[MosaicLossConfig]:
    configs = {
      MosaicLossConfig(block_n=b, num_stages=s, grid_tile_m=t)
      for b in (128, 256)
      for s in (3, 4)
      for t in (8, 32)
    }
    return {c for c in configs if self.with_config(c)._unsupported_reason(args) is None} or {
      self._get_heuristics_config(args)
    }

  def _fwd(self, args: spec.LossArgs, config: MosaicLossConfig):
    if config.gradient_in_forward and in_forward_reason(args) is None:
      return gradient_in_forward(args, config, self.interpret_params)
    return self._loss_and_lse(args, config)

  def _fwd_primal(self, args: spec.LossArgs, config: MosaicLossConfig):
    return self._loss_and_lse(args, config)[0]

  def _loss_and_lse(self, args: spec.LossArgs, config: MosaicLossConfig):
    """The output and the rows' log-sum-exps (the recomputing backward's residuals)."""
    return spec.loss(args, *row_stats(args, config, self.interpret_params))

  def _bwd(self, args, config, out, residuals, dout):
    del out
    if isinstance(residuals, UnitGradients):
      # Under jax.grad (a unit cotangent) XLA folds this scale away.
      scale = lambda g: (g.astype(jnp.float32) * dout).astype(g.dtype)
      return {"x": scale(residuals.x), "weights": scale(residuals.weights)}
    chunks = chunked_xla.ChunkedLossConfig(min(config.vocab_chunk_size, args.weights.shape[1]))
    return chunked_xla.backward(args, chunks, residuals, dout)
