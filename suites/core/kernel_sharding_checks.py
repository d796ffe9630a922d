"""Kernel implementations on arrays sharded over 8 host devices (issue 21).

Each case runs an op's forward pass and VJP jitted on sharded arrays and on whole
ones, compares them within the harness's tolerances and reads the compiled HLO: no
all-gather unless the case shards an axis the op cannot split (then one warning
names it). Triton kernels run in Triton's interpreter (float32) on arrays with explicit mesh
axes; the `auto_` cases run the same partitioning through XLA's partitioner
(`custom_partitioning`, automatic mesh axes) with the XLA implementation as the
kernel, since interpreters' host callbacks cannot run inside it. The Mosaic TPU loss,
ragged_dot and attention run in Pallas's TPU interpreter (explicit mesh axes). The Mosaic GPU
kernels run in Pallas's GPU interpreter (explicit mesh axes), one device's cluster at a time
(`serialize_mosaic_gpu_clusters` says why), and are also lowered for CUDA on sharded operands
(`Lowering`): their calls take shards and nothing is gathered. Some cases run outside jit
(`Case.eager`), inside the caller's `shard_map`, or interpreted on automatic mesh axes, which
runs the call on whole arrays by design (`Case.gathers`).

Usage (test_kernel_sharding runs it in a subprocess):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m suites.core.kernel_sharding_checks [CASE...]
Prints one JSON line per case: {"case": ..., "error": null or the failure}.
"""

import contextlib
import dataclasses
import json
import sys
import threading
import traceback
import types
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import callback
from jax._src.pallas.mosaic.interpret import thread_map
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, interpret_pallas_call
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import tokamax
from tokamax._src import triton_call
from tokamax._src.ops.attention import mosaic as attention_mosaic
from tokamax._src.ops.attention import mosaic_tpu as attention_tpu
from tokamax._src.ops.attention import spec as attention_spec
from tokamax._src.ops.attention import xla as attention_xla
from tokamax._src.ops.gated_linear_unit import mosaic as glu_mosaic
from tokamax._src.ops.gated_linear_unit import spec as glu_spec
from tokamax._src.ops.gated_linear_unit import xla as glu_xla
from tokamax._src.ops.linear_softmax_cross_entropy_loss import chunked_xla as loss_chunked
from tokamax._src.ops.linear_softmax_cross_entropy_loss import mosaic as loss_mosaic
from tokamax._src.ops.linear_softmax_cross_entropy_loss import mosaic_tpu as loss_tpu
from tokamax._src.ops.linear_softmax_cross_entropy_loss import spec as loss_spec
from tokamax._src.ops.linear_softmax_cross_entropy_loss import xla as loss_xla
from tokamax._src.ops.normalization import xla as norm_xla
from tokamax._src.ops.ragged_dot import mosaic as ragged_mosaic
from tokamax._src.ops.ragged_dot import mosaic_tpu as ragged_tpu
from tokamax._src.ops.ragged_dot import spec as ragged_spec
from tokamax._src.ops.ragged_dot import xla as ragged_xla
from tokamax_harness import compare

AXES = ("data", "model")


def serialize_mosaic_gpu_clusters() -> None:
  """Makes Pallas's Mosaic GPU interpreter run one device's cluster at a time (jax 0.11).

  Inside `shard_map` the interpreter runs every device's kernel as one multi-GPU program
  sharing one `GPUSharedMemory` (gpu_callbacks._shared_memory), its devices' programs
  concurrently (`_clean_up_shared_memory` waits for all of them at a `threading.Barrier`).
  But `gpu_callbacks.cluster_finished`, run after each cluster (grid point) of each device,
  calls `GPUSharedMemory.reset_per_cluster_state`, which resets every device's state: the
  register (wgmma accumulator) ids, named barriers, vector clocks, TMA thread ids. A device
  finishing a cluster so corrupts the clusters other devices are running (KeyError on a
  register buffer's deallocation, spurious races, and named-barrier waits that never end);
  and `_assert_no_barriers_allocated`, after a device's grid, sees the barriers of clusters
  still running on other devices ('Barrier remains allocated'). Here a lock is taken by an
  ordered callback before each cluster's `thread_map` and released by `cluster_finished`, and
  the barrier assertion takes it too. The kernels and their semantics are unchanged: on one
  device every cluster already runs alone.
  """
  if getattr(interpret_pallas_call.thread_map, "serialized", False):
    return
  lock = threading.Lock()

  def acquire(token):
    lock.acquire()
    return token

  def serial_thread_map(f, num_threads, token, *args, **kwargs):
    token = callback.io_callback(acquire, gpu_callbacks.TOKEN_SHAPE_DTYPE, token, ordered=True)
    return thread_map.thread_map(f, num_threads, token, *args, **kwargs)

  cluster_finished = gpu_callbacks.cluster_finished
  assert_no_barriers = gpu_callbacks._assert_no_barriers_allocated

  def serial_cluster_finished(*, token):
    try:
      return cluster_finished(token=token)
    finally:
      lock.release()

  def serial_assert_no_barriers(token):
    with lock:
      return assert_no_barriers(token)

  interpret_pallas_call.thread_map = types.SimpleNamespace(
    thread_map=serial_thread_map,
    TOP_LEVEL_TOKEN_VALUE=thread_map.TOP_LEVEL_TOKEN_VALUE,
    serialized=True,
  )
  gpu_callbacks.cluster_finished = serial_cluster_finished
  gpu_callbacks._assert_no_barriers_allocated = serial_assert_no_barriers


def _partitioned(cls):
  """The XLA implementation `cls`, partitioned by its op's rule like a kernel."""
  return dataclasses.dataclass(frozen=True, kw_only=True)(
    type(f"Partitioned{cls.__name__}", (cls,), {"partitioned": True})
  )()


@dataclasses.dataclass(frozen=True)
class Case:
  """One op call on sharded arrays.

  Attributes:
    fn: The call, of the arrays in `args`.
    args: Float arrays (differentiated) and integer ones.
    specs: One `PartitionSpec` per arg.
    explicit: Explicit mesh axes (shard_map route) or automatic ones (custom_partitioning).
    warns: A substring of the expected warning (an axis the op cannot split), or None.
    interpret_triton: Run inside `triton_call.interpret()`.
    reference: The call on whole arrays where `fn` needs the mesh (default `fn`).
    gathers: The call runs on whole arrays by design (an interpreter's host callbacks
      cannot run inside XLA's partitioner): the program may gather, and nothing warns.
    eager: Run outside `jit`: the forward pass on the concrete arrays, the VJP on JAX's
      tracers (whose mesh is abstract), each meeting the constants `fn` closes over.
  """

  fn: Callable[..., jax.Array]
  args: tuple[jax.Array, ...]
  specs: tuple[P, ...]
  explicit: bool = True
  warns: str | None = None
  interpret_triton: bool = False
  reference: Callable[..., jax.Array] | None = None
  gathers: bool = False
  eager: bool = False


def _normal(seed, shape, dtype=jnp.float32, scale=1.0):
  return (scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)).astype(dtype)


def _attention(impl, dtype, b, t, n, k, h, **kw):
  q = _normal(1, (b, t, n, h), dtype)
  kk, v = _normal(2, (b, t, k, h), dtype), _normal(3, (b, t, k, h), dtype)
  return (
    lambda q, k, v: tokamax.dot_product_attention(q, k, v, implementation=impl, **kw),
    (q, kk, v),
  )


def _attention_features(impl):
  """Attention with a bias per batch and head, a mask broadcast over both, and per-batch
  sequence lengths: each shard needs its own batch rows and heads of the bias and lengths."""
  (_, (q, k, v)) = _attention(impl, jnp.float32, 4, 16, 4, 2, 16)
  bias = _normal(15, (4, 4, 16, 16))
  # Key 0 always visible (a row masked whole has no softmax).
  mask = jax.random.bernoulli(jax.random.key(16), 0.7, (1, 1, 16, 16)).at[..., 0].set(True)
  q_lengths, kv_lengths = jnp.array([16, 3, 9, 12]), jnp.array([7, 16, 12, 1])
  return (
    lambda q, k, v, bias, mask, q_lengths, kv_lengths: tokamax.dot_product_attention(
      q,
      k,
      v,
      bias,
      mask,
      query_seq_lengths=q_lengths,
      key_value_seq_lengths=kv_lengths,
      implementation=impl,
    ),
    (q, k, v, bias, mask, q_lengths, kv_lengths),
  )


# Query, key, value, bias [B, N, T, S], mask [1, 1, T, S] and the two lengths [B].
FEATURE_SPECS = (
  *[P("data", None, "model", None)] * 3,
  P("data", "model"),
  P(),
  P("data"),
  P("data"),
)


def _inside_shard_map(call, specs, out_spec: P | None = None) -> Case:
  """The call inside the caller's `shard_map` over the mesh, on the shards of `specs` (the
  output's: `out_spec`, by default attention's `HEADS`)."""
  fn, args = call
  body = jax.shard_map(fn, in_specs=tuple(specs), out_specs=out_spec or HEADS)
  return Case(body, args, tuple(specs), reference=fn)


def _glu(impl, dtype, m, k, n, **kw):
  x, w = _normal(4, (m, k), dtype), _normal(5, (k, 2, n), dtype, k**-0.5)
  return (
    lambda x, w: tokamax.gated_linear_unit(x, w, activation=jax.nn.swish, implementation=impl),
    (x, w),
  )


def _norm(impl, rows, d):
  return (
    lambda x, s: tokamax.layer_norm(x, s, None, implementation=impl),
    (_normal(6, (rows, d)), 1 + _normal(7, (d,))),
  )


def _ragged(impl, dtype, m, k, n, sizes):
  lhs, rhs = _normal(8, (m, k), dtype), _normal(9, (len(sizes), k, n), dtype, k**-0.5)
  return (
    lambda lhs, rhs, gs: tokamax.ragged_dot(lhs, rhs, gs, implementation=impl),
    (lhs, rhs, jnp.asarray(sizes, jnp.int32)),
  )


def _loss(impl, b, h, v, reduction, dtype=jnp.float32, outside=(), logit_scale=1.0):
  """The loss call and its arrays; the rows in `outside` get labels outside [0, v); the logits
  have about `logit_scale`'s standard deviation."""
  labels = jax.random.randint(jax.random.key(11), (b,), 0, v)
  for i, row in enumerate(outside):
    labels = labels.at[row].set(v + i if i % 2 else -1 - i)
  return (
    lambda x, w, labels: tokamax.linear_softmax_cross_entropy_loss(
      x, labels, w, reduction=reduction, implementation=impl
    ),
    (_normal(12, (b, h), dtype), _normal(13, (h, v), dtype, logit_scale * h**-0.5), labels),
  )


def _case(call, specs, **kw) -> Case:
  return Case(*call, tuple(specs), **kw)


ROWS_ALL, ROWS = P(AXES), P("data")
HEADS = P("data", None, "model", None)
VOCAB = P(None, "model")
# The loss's chunked backward: 5-column chunks, the last overlapping (12 columns a shard).
CHUNKED_LOSS = _partitioned(loss_chunked.ChunkedXlaLoss).with_config(
  loss_chunked.ChunkedLossConfig(5)
)
# The Mosaic TPU loss in its interpreter: on each of 2 vocabulary shards one 128-column tile
# and a 64-column tail (XLA's), forward and backward; 8-row tiles.
TPU_LOSS = loss_tpu.MosaicTpuLoss(
  interpret=True,
  config=loss_tpu.MosaicTpuLossConfig(
    block_b=8, block_v=128, block_k=32, bwd_block_b=8, bwd_block_v=128
  ),
)
# The Mosaic TPU ragged_dot and attention in their interpreter, at the blocks of their own
# heuristics for each shard's shapes.
TPU_RAGGED = ragged_tpu.MosaicTpuRaggedDot(interpret=True)
TPU_ATTENTION = attention_tpu.MosaicTpuAttention(interpret=True)
# The Mosaic GPU kernels in their interpreter, at the small tiles of their kernel tests.
GPU_GLU = glu_mosaic.MosaicGatedLinearUnit(
  interpret=True,
  config=glu_mosaic.MosaicGluConfig(block_n=64, num_stages=2, epi_n=64, grid_tile_m=2),
)
GPU_RAGGED = ragged_mosaic.MosaicRaggedDot(
  interpret=True, config=ragged_mosaic.MosaicRaggedDotConfig(block_n=64, num_stages=2, epi_n=64)
)
GPU_LOSS = loss_mosaic.MosaicLoss(
  interpret=True, config=loss_mosaic.MosaicLossConfig(block_n=128, num_stages=2, grid_tile_m=2)
)
GPU_ATTENTION = attention_mosaic.MosaicAttention(interpret=True)


# Cases expected to fail (a strict xfail each, with the reason), until their bug is fixed.
KNOWN_FAILURES: dict[str, str] = {}


def cases() -> dict[str, Case]:
  """Every case by name: op, implementation, what is sharded."""
  triton = dict(interpret_triton=True)
  norm = _norm("triton", 16, 32)
  auto_norm = _norm(_partitioned(norm_xla.XlaLayerNorm), 16, 32)
  sizes = (5, 0, 7, 4)
  scale = 1 + _normal(7, (32,))  # Closed over by the eager cases: a constant, not traced.
  constant_scale = lambda impl: lambda x: tokamax.layer_norm(x, scale, None, implementation=impl)
  return {
    "layer_norm/triton/rows": _case(_norm("triton", 16, 32), [ROWS_ALL, P()], **triton),
    "layer_norm/triton/rows_split_features_replicated": _case(
      _norm("triton", 16, 32), [P("data", "model"), P()], warns="axis 1 (d) of `x`", **triton
    ),
    "gated_linear_unit/triton/rows_and_columns": _case(
      _glu("triton", jnp.float32, 16, 32, 24), [ROWS, P(None, None, "model")], **triton
    ),
    "attention/triton/batch_and_kv_heads": _case(
      _attention("triton", jnp.float32, 4, 16, 4, 2, 16, is_causal=True), [HEADS] * 3, **triton
    ),
    "ragged_dot/triton/rows_and_columns": _case(
      _ragged("triton", jnp.float32, 16, 32, 8, sizes),
      [ROWS, P(None, None, "model"), P()],
      **triton,
    ),
    "ragged_dot/triton/groups": _case(
      _ragged("triton", jnp.float32, 16, 32, 8, sizes), [ROWS, P("model"), P()], **triton
    ),
    "layer_norm/triton/inside_shard_map": Case(
      jax.shard_map(norm[0], in_specs=(ROWS, P()), out_specs=ROWS),
      norm[1],
      (ROWS, P()),
      reference=norm[0],
      **triton,
    ),
    "layer_norm/triton/rows_under_vmap": Case(
      jax.vmap(norm[0], in_axes=(0, None)),
      (_normal(14, (3, 16, 32)), norm[1][1]),
      (P(None, "data"), P()),
      **triton,
    ),
    "layer_norm/xla/auto_rows_under_vmap": Case(
      jax.vmap(auto_norm[0], in_axes=(0, None)),
      (_normal(14, (3, 16, 32)), auto_norm[1][1]),
      (P(None, "data"), P()),
      explicit=False,
    ),
    "layer_norm/xla/auto_rows": _case(auto_norm, [ROWS_ALL, P()], explicit=False),
    # Interpreters (host callbacks) on automatic mesh axes: run on whole arrays, not split.
    "layer_norm/triton/auto_rows_interpreted": _case(
      _norm("triton", 16, 32), [ROWS, P()], explicit=False, gathers=True, **triton
    ),
    "ragged_dot/mosaic_tpu/auto_rows_interpreted": _case(
      _ragged(TPU_RAGGED, jnp.float32, 32, 32, 8, (9, 0, 14, 6)),
      [ROWS, P(), P()],
      explicit=False,
      gathers=True,
    ),
    # Outside jit, the scale a constant (on one device) next to rows on the mesh.
    "layer_norm/xla/eager_rows_constant_scale": Case(
      constant_scale(_partitioned(norm_xla.XlaLayerNorm)),
      (_normal(6, (16, 32)),),
      (ROWS_ALL,),
      eager=True,
    ),
    "layer_norm/triton/eager_rows_constant_scale": Case(
      constant_scale("triton"), (_normal(6, (16, 32)),), (ROWS_ALL,), eager=True, **triton
    ),
    "gated_linear_unit/xla/auto_rows_and_columns": _case(
      _glu(_partitioned(glu_xla.XlaGatedLinearUnit), jnp.float32, 16, 32, 24),
      [ROWS, P(None, None, "model")],
      explicit=False,
    ),
    "attention/xla/auto_batch_and_kv_heads": _case(
      _attention(_partitioned(attention_xla.XlaAttention), jnp.float32, 4, 16, 4, 2, 16),
      [HEADS] * 3,
      explicit=False,
    ),
    "attention/triton/batch_and_kv_heads_bias_mask_lengths": _case(
      _attention_features("triton"), FEATURE_SPECS, **triton
    ),
    # The XLA implementations as named in a call (the default on the CPU too) on explicit
    # mesh axes: split by their op's rule, since JAX's sharding in types cannot type their
    # scans, their contractions over sharded rows, the loss's gather or ragged_dot.
    "attention/xla/explicit_batch_and_kv_heads_bias_mask_lengths": _case(
      _attention_features("xla"), FEATURE_SPECS
    ),
    "attention/xla_chunked/explicit_batch_and_kv_heads": _case(
      _attention("xla_chunked", jnp.float32, 4, 16, 4, 2, 16, is_causal=True), [HEADS] * 3
    ),
    "attention/default/explicit_batch_and_kv_heads": _case(
      _attention(None, jnp.float32, 4, 16, 4, 2, 16), [HEADS] * 3
    ),
    "layer_norm/xla/explicit_rows": _case(_norm("xla", 16, 32), [ROWS_ALL, P()]),
    "gated_linear_unit/xla/explicit_rows_and_columns": _case(
      _glu("xla", jnp.float32, 16, 32, 24), [ROWS, P(None, None, "model")]
    ),
    "gated_linear_unit/default/explicit_rows_and_columns": _case(
      _glu(None, jnp.float32, 16, 32, 24), [ROWS, P(None, None, "model")]
    ),
    "ragged_dot/xla/explicit_rows_and_columns": _case(
      _ragged("xla", jnp.float32, 16, 32, 8, sizes), [ROWS, P(None, None, "model"), P()]
    ),
    "ragged_dot/default/explicit_groups": _case(
      _ragged(None, jnp.float32, 16, 32, 8, sizes), [ROWS, P("model"), P()]
    ),
    "loss/xla/explicit_rows_and_vocabulary_mean": _case(
      _loss("xla", 16, 32, 24, "mean"), [ROWS, VOCAB, ROWS]
    ),
    "loss/chunked_xla/explicit_rows_sum": _case(
      _loss("chunked_xla", 16, 32, 24, "sum"), [ROWS, P(), ROWS]
    ),
    "loss/default/explicit_rows_and_vocabulary_none": _case(
      _loss(None, 16, 32, 24, "none", outside=(2,)), [ROWS, VOCAB, ROWS]
    ),
    # The XLA implementations inside the caller's shard_map: their scans' carries vary over
    # the manual mesh axes like their inputs.
    "attention/xla/inside_shard_map_bias_mask_lengths": _inside_shard_map(
      _attention_features("xla"), FEATURE_SPECS
    ),
    # Rows split, the weights whole: the weights' cotangent sums the shards' shares.
    "gated_linear_unit/xla/inside_shard_map_rows": _inside_shard_map(
      _glu("xla", jnp.float32, 16, 32, 24), [ROWS, P()], out_spec=ROWS
    ),
    "attention/xla_chunked/inside_shard_map_bias_mask_lengths": _inside_shard_map(
      _attention_features("xla_chunked"), FEATURE_SPECS
    ),
    "attention/xla/auto_mqa_heads_replicated": _case(
      _attention(_partitioned(attention_xla.XlaAttention), jnp.float32, 4, 16, 4, 1, 16),
      [HEADS, P("data"), P("data")],
      explicit=False,
      warns="axis 2 (('k', 'g')) of `query`",
    ),
    # Rows over both mesh axes: each shard's share of every group follows its index over
    # the 8 devices of ("data", "model").
    "ragged_dot/xla/rows_over_both_axes": _case(
      _ragged(_partitioned(ragged_xla.XlaRaggedDot), jnp.float32, 16, 32, 8, sizes),
      [ROWS_ALL, P(), P()],
    ),
    "ragged_dot/xla/auto_rows_and_groups": _case(
      _ragged(_partitioned(ragged_xla.XlaRaggedDot), jnp.float32, 16, 32, 8, sizes),
      [ROWS, P("model"), P()],
      explicit=False,
    ),
    "loss/xla/rows_sum_features_replicated": _case(
      _loss(_partitioned(loss_xla.XlaLoss), 16, 32, 24, "sum"),
      [P("data", "model"), P(), ROWS],
      warns="axis 1 (h) of `x`",
    ),
    "loss/xla/auto_rows_mean": _case(
      _loss(_partitioned(loss_xla.XlaLoss), 16, 32, 24, "mean"), [ROWS, P(), ROWS], explicit=False
    ),
    "loss/xla/vocabulary_sum": _case(
      _loss(_partitioned(loss_xla.XlaLoss), 16, 32, 24, "sum"), [P(), VOCAB, P()]
    ),
    # Logits of about 100: the shards' log-sum-exps differ by more than float32's exp reaches
    # (88), so they must combine around the largest of them.
    "loss/xla/vocabulary_sum_large_logits": _case(
      _loss(_partitioned(loss_xla.XlaLoss), 16, 32, 24, "sum", logit_scale=100.0), [P(), VOCAB, P()]
    ),
    "loss/xla/rows_and_vocabulary_mean": _case(
      _loss(_partitioned(loss_xla.XlaLoss), 16, 32, 24, "mean"), [ROWS, VOCAB, ROWS]
    ),
    "loss/xla/auto_rows_and_vocabulary_none": _case(
      _loss(_partitioned(loss_xla.XlaLoss), 16, 32, 24, "none"),
      [ROWS, VOCAB, ROWS],
      explicit=False,
    ),
    # A row whose label no shard holds (-1, past V) loses NaN on every layout.
    "loss/xla/vocabulary_none_labels_outside": _case(
      _loss(_partitioned(loss_xla.XlaLoss), 16, 32, 24, "none", outside=(0, 5)), [P(), VOCAB, P()]
    ),
    "loss/chunked_xla/rows_and_vocabulary_mean_labels_outside": _case(
      _loss(CHUNKED_LOSS, 16, 32, 24, "mean", outside=(3, 12)), [ROWS, VOCAB, ROWS]
    ),
    "loss/chunked_xla/rows_and_vocabulary_none": _case(
      _loss(CHUNKED_LOSS, 16, 32, 24, "none"), [ROWS, VOCAB, ROWS]
    ),
    "loss/chunked_xla/vocabulary_mean": _case(
      _loss(CHUNKED_LOSS, 16, 32, 24, "mean"), [P(), VOCAB, P()]
    ),
    "loss/chunked_xla/auto_rows_and_vocabulary_sum": _case(
      _loss(CHUNKED_LOSS, 16, 32, 24, "sum"), [ROWS, VOCAB, ROWS], explicit=False
    ),
    "loss/mosaic_tpu/rows_and_vocabulary_sum": _case(
      _loss(TPU_LOSS, 32, 32, 384, "sum"), [ROWS, VOCAB, ROWS]
    ),
    "loss/mosaic_tpu/vocabulary_none": _case(
      _loss(TPU_LOSS, 16, 32, 384, "none"), [P(), VOCAB, P()]
    ),
    "ragged_dot/mosaic_tpu/rows": _case(
      _ragged(TPU_RAGGED, jnp.float32, 32, 32, 8, (9, 0, 14, 6)), [ROWS, P(), P()]
    ),
    "ragged_dot/mosaic_tpu/rows_and_groups": _case(
      _ragged(TPU_RAGGED, jnp.float32, 32, 32, 8, (9, 0, 14, 6)), [ROWS, P("model"), P()]
    ),
    "attention/mosaic_tpu/batch": _case(
      _attention(TPU_ATTENTION, jnp.float32, 4, 16, 2, 2, 64, is_causal=True), [ROWS] * 3
    ),
    "attention/mosaic_tpu/batch_and_kv_heads": _case(
      _attention(TPU_ATTENTION, jnp.float32, 4, 16, 4, 2, 64, is_causal=True), [HEADS] * 3
    ),
    "gated_linear_unit/mosaic/interpret_rows_and_columns": _case(
      _glu(GPU_GLU, jnp.bfloat16, 256, 128, 128), [ROWS, P(None, None, "model")]
    ),
    "ragged_dot/mosaic/interpret_rows_and_groups": _case(
      _ragged(GPU_RAGGED, jnp.bfloat16, 256, 128, 64, (40, 0, 70, 30)), [ROWS, P("model"), P()]
    ),
    "loss/mosaic/interpret_rows_and_vocabulary_sum": _case(
      _loss(GPU_LOSS, 256, 128, 512, "sum", jnp.bfloat16), [ROWS, VOCAB, ROWS]
    ),
    "attention/mosaic/interpret_batch_and_kv_heads": _case(
      _attention(GPU_ATTENTION, jnp.bfloat16, 4, 128, 4, 2, 64, is_causal=True), [HEADS] * 3
    ),
  }


@dataclasses.dataclass(frozen=True)
class Lowering:
  """A Mosaic GPU kernel lowered for CUDA on sharded operands (explicit mesh axes).

  The Mosaic GPU interpreter cannot run sharded (test_kernel_sharding says why): these
  read the lowered forward and backward program instead.

  Attributes:
    impl: The kernel implementation.
    canonicalize: The op's record, of the arrays.
    arrays: (shape, dtype, spec) of each array; the float ones are differentiated.
    local: An operand type that the kernel's custom calls take on one shard.
    whole: That operand's unsharded type, which no kernel call may take.
  """

  impl: Any
  canonicalize: Callable[..., Any]
  arrays: tuple[tuple[tuple[int, ...], Any, P], ...]
  local: str
  whole: str


def check_lowering(case: Lowering) -> None:
  """Fails unless the kernel's calls take shards only and nothing is gathered."""
  mesh = jax.make_mesh((4, 2), AXES, axis_types=(AxisType.Explicit,) * 2)
  floats = [i for i, (_, dtype, _) in enumerate(case.arrays) if jnp.issubdtype(dtype, jnp.floating)]
  loss = lambda *xs: case.impl.apply(case.canonicalize(*xs)).astype(jnp.float32).sum()
  with jax.set_mesh(mesh):
    structs = [
      jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
      for shape, dtype, spec in case.arrays
    ]
    lowered = jax.jit(jax.grad(loss, argnums=floats)).trace(*structs)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if "custom_call" in line and "mosaic_gpu" in line]
  assert calls, "no Mosaic GPU kernel in the program"
  assert "all_gather" not in text and "all-gather" not in text, "the program gathers"
  assert any(case.local in line for line in calls), [line[-300:] for line in calls]
  assert not any(case.whole in line for line in calls), "a kernel call takes whole arrays"


def _run(case: Case, args, fn_of_args):
  """(output, cotangents of the float args) of the jitted call, and its compiled HLO."""
  floats = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating)]

  def fwd_vjp(*args):
    def fn(*xs):
      full = list(args)
      for i, x in zip(floats, xs, strict=True):
        full[i] = x
      return fn_of_args(*full)

    out, vjp = jax.vjp(fn, *(args[i] for i in floats))
    ct = _normal(10, out.shape, out.dtype)
    if case.explicit and jax.typeof(out).sharding.mesh.axis_names:
      ct = jax.sharding.reshard(ct, jax.typeof(out).sharding.spec)
    return out, vjp(ct)

  fn = jax.jit(fwd_vjp)
  hlo = fn.lower(*args).compile().as_text()
  if case.eager:
    return (fn_of_args(*args), fwd_vjp(*args)[1]), hlo
  return fn(*args), hlo


def check(case: Case) -> None:
  """Fails unless the sharded call matches the whole one, without gathering its operands."""
  with triton_call.interpret() if case.interpret_triton else contextlib.nullcontext():
    expected, _ = _run(case, case.args, case.reference or case.fn)
    types = (AxisType.Explicit if case.explicit else AxisType.Auto,) * 2
    mesh = jax.make_mesh((4, 2), AXES, axis_types=types)
    sharded = [
      jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(case.args, case.specs, strict=True)
    ]
    with (
      jax.set_mesh(mesh) if case.explicit else contextlib.nullcontext(),
      warnings.catch_warnings(record=True) as caught,
    ):
      warnings.simplefilter("always")
      actual, hlo = _run(case, sharded, case.fn)
  messages = [str(w.message) for w in caught]
  if case.gathers:
    assert not any("replicated" in m for m in messages), messages
  elif case.warns is None:
    assert "all-gather" not in hlo, "the compiled program gathers an operand"
    assert not any("replicated" in m for m in messages), messages
  else:
    assert any(case.warns in m for m in messages), messages
  compare.assert_close(actual[0], expected[0], name="output")
  compare.assert_close(actual[1], expected[1], gradient=True, reduction_length=8, name="grads")


def lowerings() -> dict[str, Lowering]:
  """The Mosaic GPU kernels' cases by name."""
  bf16, i32 = jnp.bfloat16, jnp.int32
  x, w = ((512, 256), bf16, ROWS), ((256, 2, 256), bf16, P(None, None, "model"))
  q, kv = ((4, 128, 4, 64), bf16, HEADS), ((4, 128, 2, 64), bf16, HEADS)
  rhs, sizes = ((4, 256, 256), bf16, P("model")), ((4,), i32, P())
  vocab = ((256, 1024), bf16, VOCAB)
  return {
    "gated_linear_unit/mosaic/rows_and_columns": Lowering(
      glu_mosaic.MosaicGatedLinearUnit(),
      lambda x, w: glu_spec.canonicalize(x, w, activation=jax.nn.swish),
      (x, w),
      "tensor<128x256xbf16>",
      "tensor<512x256xbf16>",
    ),
    "attention/mosaic/batch_and_kv_heads": Lowering(
      attention_mosaic.MosaicAttention(),
      lambda q, k, v: attention_spec.canonicalize(q, k, v, is_causal=True),
      (q, kv, kv),
      "tensor<1x128x2x64xbf16>",
      "tensor<4x128x4x64xbf16>",
    ),
    "ragged_dot/mosaic/rows_and_groups": Lowering(
      ragged_mosaic.MosaicRaggedDot(),
      ragged_spec.canonicalize,
      (x, rhs, sizes),
      "tensor<2x256x256xbf16>",
      "tensor<4x256x256xbf16>",
    ),
    "loss/mosaic/rows_and_vocabulary": Lowering(
      loss_mosaic.MosaicLoss(),
      lambda x, labels, w: loss_spec.canonicalize(x, labels, w),
      (x, ((512,), i32, ROWS), vocab),
      "tensor<256x512xbf16>",
      "tensor<256x1024xbf16>",
    ),
  }


def main(names: list[str]) -> None:
  assert jax.device_count() == 8, jax.devices()
  serialize_mosaic_gpu_clusters()
  all_cases = {**cases(), **lowerings()}
  for name in names or all_cases:
    case = all_cases[name]
    try:
      check(case) if isinstance(case, Case) else check_lowering(case)
      error = None
    except Exception:  # Reported per case.
      error = traceback.format_exc(limit=-6)
    print(json.dumps({"case": name, "error": error}), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
