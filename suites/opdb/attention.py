"""dot_product_attention in the op database."""

import jax
import jax.numpy as jnp
from hypothesis import strategies as st

from suites.opdb import base
from suites.opdb import kernel_cases as kc
from tokamax_harness import references

_BIAS_SHAPES = {"full": "bnts", "heads": "1n1s", "batch": "b1ts", "heads_plane": "1nts"}
_MASK_SHAPES = {
  "full": "bnts",
  "keys": "b11s",
  "rows": "11ts",
  "empty_rows": "b1ts",
  "batch_plane": "b1ts",
}


def _plane(layout: str, dims: dict) -> tuple[int, ...]:
  return tuple(1 if c == "1" else dims[c] for c in layout)


def build(d: base.Draw, shape: dict, dtype: str, f: dict) -> base.Built:
  b, t, s, n, k, h = (shape[x] for x in "btsnkh")
  hv = shape.get("hv", h)
  dims = dict(b=b, n=n, t=t, s=s)
  # `magnitude` scales the logits (q.k has unit variance at magnitude 1).
  q = d.normal((b, t, n, h), dtype, f.get("magnitude", 1.0))
  key = d.normal((b, s, k, h), dtype)
  v = d.normal((b, s, k, hv), dtype)
  bias = mask = None
  if f.get("bias"):
    bias = d.normal(_plane(_BIAS_SHAPES[f["bias"]], dims), dtype)
  if f.get("mask"):
    mask = d.bools(_plane(_MASK_SHAPES[f["mask"]], dims))
    if f["mask"] == "empty_rows":  # Rows that see no key at all: first, middle and last.
      mask = mask.at[:, :, jax.numpy.asarray([0, t // 2, t - 1]), :].set(False)
  kwargs = {
    "is_causal": bool(f.get("is_causal", False)),
    "scale": f.get("scale"),
    "local_window_size": f.get("local_window_size"),
    "logits_soft_cap": f.get("logits_soft_cap"),
  }
  if f.get("kv_seq_lengths"):
    kwargs["key_value_seq_lengths"] = d.ints((b,), max(1, s // 2), s + 1)
  if f.get("q_seq_lengths"):
    kwargs["query_seq_lengths"] = d.ints((b,), max(1, t // 2), t + 1)
  args = (q, key, v, bias, mask)
  diff = (0, 1, 2) + ((3,) if bias is not None else ())
  return base.Built(args, kwargs, diff, ("query", "key", "value", "bias", "mask"))


def reference(args: tuple, kwargs: dict):
  return references.attention(*args, **{k: v for k, v in kwargs.items() if k != "precision"})


def _jax_nn(args: tuple, kwargs: dict):
  q, k, v, bias, mask = args
  return jax.nn.dot_product_attention(
    q, k, v, bias, mask, scale=kwargs.get("scale"), is_causal=kwargs.get("is_causal", False)
  )


def _sizes():
  heads = st.sampled_from([(1, 1), (2, 1), (4, 2), (2, 2)])
  dims = st.fixed_dictionaries(
    dict(
      b=st.integers(1, 2),
      t=st.integers(1, 40),
      s=st.integers(1, 40),
      h=st.sampled_from([8, 16, 32]),
    )
  )
  return dims.flatmap(lambda d: heads.map(lambda nk: {**d, "n": nk[0], "k": nk[1]}))


_GPU = base.Matrix(
  shapes=(dict(b=2, t=384, s=512, n=8, k=2, h=128),),
  dtypes=("bfloat16", "float32"),
  long_shapes=(
    dict(b=1, t=2048, s=2048, n=8, k=8, h=128),
    dict(b=2, t=1000, s=777, n=4, k=1, h=64),
  ),
)
# TPU v5: the Mosaic TPU kernel takes head dims 64 to 256; the interpret shape runs it in
# the TPU interpreter (TOKAMAX_FAMILY=tpu_v5 on a CPU host).
_TPU = base.Matrix(
  shapes=_GPU.shapes,
  dtypes=("bfloat16", "float32"),
  interpret_shapes=(dict(b=1, t=136, s=130, n=2, k=1, h=64),),
  interpret_dtypes=("float32",),
  long_shapes=_GPU.long_shapes,
)
_ANCHOR_SHAPE = dict(b=4, t=4096, s=4096, n=32, k=32, h=128)
# The cases of docs/perf.md.
_GPU_BENCH = (
  base.BenchCall(_ANCHOR_SHAPE, "bfloat16", "plain"),
  base.BenchCall(_ANCHOR_SHAPE, "bfloat16", "causal"),
  base.BenchCall(dict(b=32, t=2048, s=2048, n=16, k=16, h=64), "bfloat16", "plain"),
  base.BenchCall(dict(b=32, t=2048, s=2048, n=16, k=16, h=64), "bfloat16", "causal"),
  base.BenchCall(dict(b=2, t=8192, s=8192, n=8, k=8, h=256), "bfloat16", "causal"),
  base.BenchCall(dict(b=1, t=16384, s=16384, n=16, k=16, h=128), "bfloat16", "causal"),
  base.BenchCall(dict(_ANCHOR_SHAPE, k=8), "bfloat16", "causal"),
  # Issue 18's bias and mask planes: bias [1, N, T, S], mask [B, 1, T, S], and both.
  base.BenchCall(_ANCHOR_SHAPE, "bfloat16", "bias_plane"),
  base.BenchCall(_ANCHOR_SHAPE, "bfloat16", "mask_plane"),
  base.BenchCall(_ANCHOR_SHAPE, "bfloat16", "bias_mask_planes"),
  # A causal sliding window of 1024 keys (cuDNN takes it since 7b5d152).
  base.BenchCall(_ANCHOR_SHAPE, "bfloat16", "sliding_window"),
)

# Kernel cases (`kernel_cases`): Mosaic GPU cases run in the interpreter with race
# detection; shapes are (b, t, s, n, k, h); the bias and mask planes are random
# draws named by seed; an empty config is the heuristic's.
_MOSAIC_LENGTHS_WINDOW_SOFTCAP_H256 = dict(
  local_window_size=(40, 10),
  logits_soft_cap=4.0,
  query_seq_lengths=(100, 61),
  key_value_seq_lengths=(90, 130),
)
_MOSAIC_CASES = {
  "gqa_plain_h64": kc.AttentionKernelCase(
    dict(b=1, t=128, s=128, n=2, k=1, h=64), "bfloat16", grads=True
  ),
  # Keys padded from 72 to a whole 128-key block, with nothing else to hide them (no
  # lengths, mask or causal mask): the kernels must mask the padding themselves.
  "plain_padded_keys": kc.AttentionKernelCase(
    dict(b=1, t=64, s=72, n=1, k=1, h=64), "bfloat16", grads=True
  ),
  "causal_window_softcap_cross": kc.AttentionKernelCase(
    dict(b=1, t=128, s=256, n=4, k=2, h=64),
    "bfloat16",
    grads=True,
    features=dict(is_causal=True, local_window_size=(90, 20), logits_soft_cap=4.0),
  ),
  "lengths_causal_padded": kc.AttentionKernelCase(
    dict(b=2, t=200, s=150, n=2, k=1, h=64),
    "bfloat16",
    grads=True,
    features=dict(is_causal=True, query_seq_lengths=(150, 37), key_value_seq_lengths=(100, 0)),
  ),
  # Lengths past the sequence (all of it is seen) or negative (none is), with keys padded
  # from 72 to 128: the wrapper clips them to [0, T] and [0, S], so the padding stays hidden.
  "lengths_out_of_range_padded": kc.AttentionKernelCase(
    dict(b=3, t=64, s=72, n=1, k=1, h=64),
    "bfloat16",
    grads=True,
    features=dict(query_seq_lengths=(80, 20, -2), key_value_seq_lengths=(100, -4, 30)),
  ),
  # Query lengths alone: every key block runs unmasked (`kv_blocks` ignores query lengths),
  # so only the forward's epilogue zeroes the rows past them.
  "q_lengths_unmasked_blocks": kc.AttentionKernelCase(
    dict(b=2, t=128, s=128, n=1, k=1, h=64),
    "bfloat16",
    grads=True,
    features=dict(query_seq_lengths=(100, 30)),
  ),
  # A scale other than 1/sqrt(H), in the forward and both backward kernels.
  "scale_causal_gqa": kc.AttentionKernelCase(
    dict(b=1, t=128, s=128, n=2, k=1, h=64),
    "bfloat16",
    grads=True,
    features=dict(scale=0.3, is_causal=True),
  ),
  "fp16_h128_causal_fwd": kc.AttentionKernelCase(
    dict(b=1, t=256, s=256, n=2, k=2, h=128),
    "float16",
    grads=False,
    features=dict(is_causal=True),
  ),
  # 128-row backward blocks (the dq kernel's CTA tile and the dk/dv kernel's streamed
  # block), three dk/dv slots; T and S padded to 256.
  "bwd_blocks_128q_lengths_causal_padded": kc.AttentionKernelCase(
    dict(b=2, t=200, s=150, n=2, k=1, h=64),
    "bfloat16",
    grads=True,
    features=dict(is_causal=True, query_seq_lengths=(150, 37), key_value_seq_lengths=(100, 150)),
    config=dict(dq_block_q=128, bwd_block_q=128, bwd_num_stages=3),
  ),
  # 128-key blocks streamed by the dq kernel, with one slot (value block first).
  "bwd_blocks_128kv_window_softcap_cross": kc.AttentionKernelCase(
    dict(b=1, t=128, s=256, n=2, k=1, h=128),
    "bfloat16",
    grads=True,
    features=dict(local_window_size=(90, 20), logits_soft_cap=4.0),
    config=dict(dq_block_kv=128, dq_num_stages=1),
  ),
  # dq formed by the dk/dv kernel (deterministic_bwd=False): 128-query streamed blocks
  # (dS^T K is [128, H]), GQA, a window that masks like a causal mask (a causal mask itself
  # runs the deterministic kernels), lengths, and T and S padded to 256.
  "atomic_dq_128q_gqa_lengths_window_padded": kc.AttentionKernelCase(
    dict(b=2, t=200, s=150, n=2, k=1, h=64),
    "bfloat16",
    grads=True,
    features=dict(
      local_window_size=(200, 0), query_seq_lengths=(150, 37), key_value_seq_lengths=(100, 150)
    ),
    config=dict(deterministic_bwd=False, bwd_block_q=128),
  ),
  # The same at head dim 128 with 64-query blocks, two key/value heads of two query heads
  # each, a window, a soft cap and a bias plane.
  "atomic_dq_h128_gqa_window_softcap_bias": kc.AttentionKernelCase(
    dict(b=1, t=128, s=256, n=4, k=2, h=128),
    "bfloat16",
    grads=True,
    features=dict(
      local_window_size=(90, 20), logits_soft_cap=4.0, bias=kc.RandomBias(13, (1, 4, 128, 256))
    ),
    config=dict(deterministic_bwd=False),
  ),
  # 64-query blocks at head dim 64, with a band of 40 keys.
  "atomic_dq_h64_64q_window": kc.AttentionKernelCase(
    dict(b=1, t=128, s=128, n=2, k=1, h=64),
    "bfloat16",
    grads=True,
    features=dict(local_window_size=(40, 0)),
    config=dict(deterministic_bwd=False, bwd_block_q=64),
  ),
  # Three forward consumers: T 320 is one whole tile of 192 rows and a partial one whose
  # third consumer holds no row; causal, key lengths and a mask plane (loaded, not staged).
  "three_consumers_partial_tile_causal_mask": kc.AttentionKernelCase(
    dict(b=2, t=320, s=256, n=2, k=1, h=64),
    "bfloat16",
    features=dict(
      is_causal=True, key_value_seq_lengths=(256, 100), mask=kc.RandomMask(5, (2, 1, 320, 256))
    ),
    config=dict(fwd_consumers=3, schedule_barrier=False, block_kv=128),
  ),
  # Head dim 256: dq and the dk pass with one pipeline slot, the dv pass with two.
  "h256_gqa_causal": kc.AttentionKernelCase(
    dict(b=1, t=128, s=128, n=2, k=1, h=256),
    "bfloat16",
    grads=True,
    features=dict(is_causal=True),
  ),
  "h256_lengths_window_softcap_padded": kc.AttentionKernelCase(
    dict(b=2, t=100, s=130, n=1, k=1, h=256),
    "bfloat16",
    grads=True,
    features=_MOSAIC_LENGTHS_WINDOW_SOFTCAP_H256,
  ),
  # Streamed 32-row blocks (dq_block_kv, bwd_block_q; 64-byte swizzles): at H256 with
  # one slot each (value / dO first), and with the slots that fit (dq and dk 2, dv 3).
  "h256_bwd_blocks_32_one_slot_lengths_window_softcap_padded": kc.AttentionKernelCase(
    dict(b=2, t=100, s=130, n=1, k=1, h=256),
    "bfloat16",
    grads=True,
    features=_MOSAIC_LENGTHS_WINDOW_SOFTCAP_H256,
    config=dict(block_kv=64, dq_block_kv=32, dq_num_stages=1, bwd_block_q=32, bwd_num_stages=1),
  ),
  "h256_bwd_blocks_32_gqa_causal": kc.AttentionKernelCase(
    dict(b=1, t=128, s=128, n=2, k=1, h=256),
    "bfloat16",
    grads=True,
    features=dict(is_causal=True),
    config=dict(block_kv=64, dq_block_kv=32, bwd_block_q=32, dq_num_stages=3, bwd_num_stages=3),
  ),
  "h128_bwd_blocks_32_window_cross": kc.AttentionKernelCase(
    dict(b=1, t=128, s=256, n=2, k=1, h=128),
    "bfloat16",
    grads=True,
    features=dict(local_window_size=(90, 20)),
    config=dict(dq_block_kv=32, bwd_block_q=32),
  ),
  # Bias and mask: in every kernel; the bias gradient through XLA.
  "bias_mask_full_softcap": kc.AttentionKernelCase(
    dict(b=1, t=128, s=128, n=2, k=1, h=64),
    "bfloat16",
    grads=True,
    features=dict(
      bias=kc.RandomBias(7, (1, 2, 128, 128)),
      mask=kc.RandomMask(8, (1, 2, 128, 128)),
      logits_soft_cap=5.0,
    ),
  ),
  "bias_bcast_t_mask_bcast_s_causal_padded": kc.AttentionKernelCase(
    dict(b=2, t=120, s=150, n=2, k=1, h=64),
    "bfloat16",
    grads=True,
    features=dict(
      bias=kc.RandomBias(9, (1, 2, 1, 150), "bfloat16"),
      mask=kc.RandomMask(10, (2, 1, 120, 1)),
      is_causal=True,
      key_value_seq_lengths=(150, 90),
    ),
  ),
  "bias_bcast_s_mask_bcast_t_window_gqa_fwd": kc.AttentionKernelCase(
    dict(b=1, t=128, s=256, n=4, k=2, h=128),
    "float16",
    grads=False,
    features=dict(
      bias=kc.RandomBias(11, (1, 1, 128, 1), "float16"),
      mask=kc.RandomMask(12, (1, 4, 1, 256), p=0.5, dead_rows=0.0),
      local_window_size=(100, 60),
    ),
  ),
  "bias_scalar_mask_bcast_n_fwd": kc.AttentionKernelCase(
    dict(b=2, t=128, s=128, n=2, k=1, h=64),
    "bfloat16",
    grads=False,
    features=dict(
      bias=kc.RandomBias(13, (1, 1, 1, 1)),
      mask=kc.RandomMask(14, (2, 1, 128, 128)),
      is_causal=True,
    ),
  ),
  # Backward with broadcast planes: the dk/dv kernel reads them transposed, so a
  # bias over keys only is a row plane there, and GQA walks the query heads.
  "bias_bcast_t_mask_bcast_s_window_gqa_h128": kc.AttentionKernelCase(
    dict(b=1, t=128, s=256, n=4, k=2, h=128),
    "float16",
    grads=True,
    features=dict(
      bias=kc.RandomBias(17, (1, 4, 1, 256), "float16"),
      mask=kc.RandomMask(18, (1, 1, 128, 1), p=0.8),
      local_window_size=(100, 60),
    ),
  ),
  "bias_scalar_mask_bcast_n_causal_lengths": kc.AttentionKernelCase(
    dict(b=2, t=128, s=128, n=2, k=1, h=64),
    "bfloat16",
    grads=True,
    features=dict(
      bias=kc.RandomBias(19, (1, 1, 1, 1)),
      mask=kc.RandomMask(20, (2, 1, 128, 128)),
      is_causal=True,
      query_seq_lengths=(128, 70),
    ),
  ),
  "bias_mask_h256_gqa_softcap_padded": kc.AttentionKernelCase(
    dict(b=1, t=100, s=130, n=2, k=1, h=256),
    "bfloat16",
    grads=True,
    features=dict(
      bias=kc.RandomBias(21, (1, 2, 100, 130)),
      mask=kc.RandomMask(22, (1, 2, 100, 130)),
      logits_soft_cap=4.0,
    ),
  ),
  "bias_mask_bwd_blocks_32_gqa": kc.AttentionKernelCase(
    dict(b=1, t=128, s=256, n=4, k=2, h=64),
    "bfloat16",
    grads=True,
    features=dict(
      bias=kc.RandomBias(23, (1, 4, 128, 1)),
      mask=kc.RandomMask(24, (1, 4, 128, 256)),
      is_causal=True,
    ),
    config=dict(dq_block_kv=32, bwd_block_q=32, bwd_block_kv=128),
  ),
  # Rows that see no key in steps without positional masks: a mask alone (no bias), and a
  # bias alone with -inf rows (no mask); the forward must not take exp2(-inf - -inf) there.
  "mask_only_dead_rows_fwd": kc.AttentionKernelCase(
    dict(b=1, t=128, s=256, n=2, k=1, h=64),
    "bfloat16",
    grads=False,
    features=dict(mask=kc.RandomMask(25, (1, 2, 128, 256))),
  ),
  "minus_inf_bias_rows_fwd": kc.AttentionKernelCase(
    dict(b=1, t=128, s=256, n=2, k=1, h=64),
    "bfloat16",
    grads=False,
    features=dict(bias=kc.RandomBias(26, (1, 2, 128, 256), dead_rows=0.2)),
  ),
  # A bias of about -100 on every logit, with a window: rows 74..127 see nothing of their
  # consumer's first key block (64 keys), and then only logits far below 0. The softmax
  # ignores the shift; a running max held at 0 after the empty block would underflow them.
  "window_far_negative_bias_fwd": kc.AttentionKernelCase(
    dict(b=1, t=128, s=128, n=1, k=1, h=64),
    "bfloat16",
    grads=False,
    features=dict(bias=kc.RandomBias(27, (1, 1, 1, 1), shift=-100.0), local_window_size=(10, 10)),
    config=dict(block_kv=64),
  ),
  # Full bias and mask planes staged through shared memory (64-key blocks fit) over two query
  # tiles: the producer copies each tile's own rows, tile_r0 + c * block_q (every other staged
  # case has one tile, whose tile_r0 is 0).
  "staged_bias_mask_two_query_tiles_fwd": kc.AttentionKernelCase(
    dict(b=1, t=256, s=128, n=1, k=1, h=64),
    "bfloat16",
    grads=False,
    features=dict(
      bias=kc.RandomBias(31, (1, 1, 256, 128)), mask=kc.RandomMask(32, (1, 1, 256, 128))
    ),
  ),
  # Three key/value heads of two query heads each: the only gradient cases where the group
  # size (2) differs from the key/value heads (3), so a kernel that walks the query heads of
  # kv head j from j * K (not j * G) reads the wrong heads' queries and bias planes.
  "gqa_three_kv_heads_bias": kc.AttentionKernelCase(
    dict(b=1, t=128, s=128, n=6, k=3, h=64),
    "bfloat16",
    grads=True,
    features=dict(bias=kc.RandomBias(29, (1, 6, 128, 128))),
  ),
  # The same with dq formed by the dk/dv kernel: its shares go to query heads j * G + g.
  "atomic_dq_gqa_three_kv_heads_bias": kc.AttentionKernelCase(
    dict(b=1, t=128, s=128, n=6, k=3, h=64),
    "bfloat16",
    grads=True,
    features=dict(bias=kc.RandomBias(30, (1, 6, 128, 128))),
    config=dict(deterministic_bwd=False),
  ),
  # overlap_qk (forward only: no race at all). Batch 0 leaves the second consumer
  # of the tile no key block (rows >= 64 see none), so only one runs the pipeline.
  "overlap_qk_window_lengths_softcap_padded_fwd": kc.AttentionKernelCase(
    dict(b=2, t=128, s=150, n=2, k=1, h=64),
    "bfloat16",
    grads=False,
    features=dict(local_window_size=(0, 70), logits_soft_cap=4.0, key_value_seq_lengths=(64, 150)),
    config=dict(block_kv=64, overlap_qk=True),
  ),
  "overlap_qk_bias_mask_window_gqa_h128_fwd": kc.AttentionKernelCase(
    dict(b=1, t=128, s=384, n=4, k=2, h=128),
    "float16",
    grads=False,
    features=dict(
      bias=kc.RandomBias(15, (1, 4, 128, 384)),
      mask=kc.RandomMask(16, (1, 1, 1, 384), p=0.6, dead_rows=0.0),
      local_window_size=(100, 160),
    ),
    config=dict(overlap_qk=True),
  ),
  "overlap_qk_no_schedule_barrier_h256_causal_gqa_fwd": kc.AttentionKernelCase(
    dict(b=1, t=256, s=256, n=2, k=1, h=256),
    "bfloat16",
    grads=False,
    features=dict(is_causal=True),
    config=dict(block_kv=64, overlap_qk=True, schedule_barrier=False),
  ),
  # overlap_qk over whole key blocks: keys padded from 200 to 256 leave blocks 0-2 all
  # visible and block 3 partly, so each consumer runs its first step, two unmasked steps and
  # a masked one (in the cases above no unmasked step follows the first).
  "overlap_qk_plain_steps_padded_fwd": kc.AttentionKernelCase(
    dict(b=1, t=128, s=200, n=2, k=1, h=64),
    "bfloat16",
    grads=False,
    config=dict(block_kv=64, overlap_qk=True),
  ),
  # overlap_qk through three pipeline slots (the cases above have two, where the slot of
  # the step before is also the slot of the step after): each step's P.V must read the
  # value block of the step before from its own slot, as the autotuner's 3- and 4-stage
  # overlap_qk configs do.
  "overlap_qk_three_stages_fwd": kc.AttentionKernelCase(
    dict(b=1, t=128, s=256, n=2, k=1, h=64),
    "bfloat16",
    grads=False,
    config=dict(block_kv=64, num_stages=3, overlap_qk=True),
  ),
}
# Compiled on a Hopper GPU: outputs and gradients against XLA, and determinism.
_MOSAIC_GPU_CASES = {
  "h64": kc.AttentionKernelCase(dict(b=2, t=512, s=512, n=4, k=4, h=64), "bfloat16"),
  "h128_causal": kc.AttentionKernelCase(
    dict(b=1, t=640, s=640, n=4, k=2, h=128), "bfloat16", features=dict(is_causal=True)
  ),
  "h128_window_softcap_cross_fp16": kc.AttentionKernelCase(
    dict(b=2, t=384, s=500, n=4, k=1, h=128),
    "float16",
    features=dict(local_window_size=(100, 30), logits_soft_cap=5.0),
  ),
  "h256_causal": kc.AttentionKernelCase(
    dict(b=1, t=512, s=512, n=2, k=2, h=256), "bfloat16", features=dict(is_causal=True)
  ),
}
# Compiled on a Hopper GPU with configs other than the heuristics' (overlap_qk,
# deterministic_bwd): outputs against XLA, and gradients where `grads`.
_MOSAIC_GPU_CONFIG_CASES = {
  "h128_causal_softcap_lengths": kc.AttentionKernelCase(
    dict(b=2, t=512, s=500, n=4, k=2, h=128),
    "bfloat16",
    grads=False,
    features=dict(is_causal=True, logits_soft_cap=5.0, key_value_seq_lengths=(500, 77)),
    config=dict(overlap_qk=True),
  ),
  "h64_window": kc.AttentionKernelCase(
    dict(b=1, t=384, s=384, n=4, k=1, h=64),
    "bfloat16",
    grads=False,
    features=dict(local_window_size=(100, 30)),
    config=dict(block_kv=64, overlap_qk=True),
  ),
  "h256_causal_no_schedule_barrier": kc.AttentionKernelCase(
    dict(b=1, t=512, s=512, n=2, k=2, h=256),
    "bfloat16",
    grads=False,
    features=dict(is_causal=True),
    config=dict(block_kv=64, overlap_qk=True, schedule_barrier=False),
  ),
  # Three forward consumers with a partial last tile: T 2048 is 10 tiles of 192 rows and one
  # of 128 (its third consumer idle); T 448 two and one of 64 (two idle).
  "h64_three_consumers": kc.AttentionKernelCase(
    dict(b=2, t=2048, s=2048, n=4, k=2, h=64),
    "bfloat16",
    grads=False,
    config=dict(fwd_consumers=3, schedule_barrier=False, block_kv=128),
  ),
  "h64_three_consumers_causal_lengths": kc.AttentionKernelCase(
    dict(b=2, t=448, s=512, n=4, k=4, h=64),
    "bfloat16",
    grads=False,
    features=dict(is_causal=True, key_value_seq_lengths=(512, 77)),
    config=dict(fwd_consumers=3, schedule_barrier=False, block_kv=128, num_stages=3),
  ),
  # dq by reduce-adds from the dk/dv kernel (not bitwise reproducible): gradients too.
  "h128_window_gqa_atomic_dq": kc.AttentionKernelCase(
    dict(b=2, t=640, s=640, n=4, k=2, h=128),
    "bfloat16",
    features=dict(local_window_size=(300, 0)),
    config=dict(deterministic_bwd=False),
  ),
  "h128_atomic_dq": kc.AttentionKernelCase(
    dict(b=1, t=512, s=512, n=4, k=4, h=128),
    "bfloat16",
    config=dict(deterministic_bwd=False),
  ),
  "h64_lengths_atomic_dq": kc.AttentionKernelCase(
    dict(b=2, t=512, s=500, n=4, k=4, h=64),
    "bfloat16",
    features=dict(key_value_seq_lengths=(500, 77)),
    config=dict(deterministic_bwd=False, bwd_block_q=128),
  ),
}

# Triton: bias and mask are plane shapes (random draws of the test's seed);
# q_lengths/kv_lengths draw random lengths. Compiled for sm_80 and sm_90 with the
# heuristic's config, forward and backward.
_TRITON_COMPILE = dict(b=1, t=512, s=512, n=4, k=2)
_TRITON_COMPILE_CASES = {
  "bf16-h128": kc.AttentionKernelCase(dict(_TRITON_COMPILE, h=128), "bfloat16"),
  "bf16-h64-causal": kc.AttentionKernelCase(
    dict(_TRITON_COMPILE, h=64), "bfloat16", features=dict(is_causal=True)
  ),
  "bf16-h256": kc.AttentionKernelCase(dict(_TRITON_COMPILE, h=256), "bfloat16"),
  "f16-h128-gqa-window-lengths": kc.AttentionKernelCase(
    dict(_TRITON_COMPILE, k=1, h=128),
    "float16",
    features=dict(local_window_size=(64, 0), q_lengths=True, kv_lengths=True),
  ),
  "f32-h128-causal": kc.AttentionKernelCase(
    dict(_TRITON_COMPILE, h=128), "float32", features=dict(is_causal=True)
  ),
  "f32-h256-highest": kc.AttentionKernelCase(
    dict(_TRITON_COMPILE, h=256), "float32", features=dict(precision=jax.lax.Precision.HIGHEST)
  ),
  "bf16-h128-bias-softcap-mask": kc.AttentionKernelCase(
    dict(_TRITON_COMPILE, h=128),
    "bfloat16",
    features=dict(bias=(1, 4, 512, 512), mask=(1, 1, 512, 512), logits_soft_cap=30.0),
  ),
  "bf16-h96-hv64-causal": kc.AttentionKernelCase(
    dict(_TRITON_COMPILE, h=96, hv=64), "bfloat16", features=dict(is_causal=True)
  ),
}
# In Triton's interpreter with small blocks (partial blocks everywhere).
_TRITON_SMALL_BLOCKS = dict(
  block_q=16,
  block_k=16,
  num_warps=4,
  num_stages=2,
  bwd_block_outer=32,
  bwd_block_inner=16,
  bwd_num_warps=4,
  bwd_num_stages=2,
)
_TRITON_INTERPRET = dict(b=2, t=37, s=45, n=4, k=2, h=32)


def _triton_interpret(shape=_TRITON_INTERPRET, dtype="float32", **features):
  return kc.AttentionKernelCase(shape, dtype, features=features, config=_TRITON_SMALL_BLOCKS)


_TRITON_INTERPRET_CASES = {
  "plain": _triton_interpret(),
  "causal-gqa": _triton_interpret(is_causal=True),
  "window": _triton_interpret(local_window_size=(5, 3)),
  "causal-window": _triton_interpret(is_causal=True, local_window_size=(7, 0)),
  "soft-cap": _triton_interpret(logits_soft_cap=2.0),
  "bias": _triton_interpret(bias=(2, 4, 37, 45)),
  "bias-bcast-softcap": _triton_interpret(bias=(1, 4, 1, 45), logits_soft_cap=3.0),
  "mask": _triton_interpret(mask=(2, 1, 37, 45)),
  "lengths-causal": _triton_interpret(q_lengths=True, kv_lengths=True, is_causal=True),
  "mqa-hv-t-lt-s": _triton_interpret(dict(_TRITON_INTERPRET, k=1, hv=16, t=20, s=70)),
  "f16-odd-heads-causal": _triton_interpret(
    dict(_TRITON_INTERPRET, h=24, hv=40), "float16", is_causal=True
  ),
  # Key/value lengths alone, without causal: key blocks that run past the length meet
  # query blocks that would otherwise run without masks.
  "kv-lengths": _triton_interpret(kv_lengths=True),
  # A window side of 0 bounds that side (only -1 means unbounded in the kernels).
  "window-left0": _triton_interpret(local_window_size=(0, 6)),
  "window-right0": _triton_interpret(local_window_size=(6, 0)),
  # A wide left window with a right side that is no block multiple: each key block's
  # query range starts off a query block boundary, then has masked and full blocks.
  "window-wide": _triton_interpret(dict(_TRITON_INTERPRET, t=100, s=70), local_window_size=(60, 3)),
  # A mask that differs by head, broadcast over batch and query rows (strides 0).
  "mask-per-head": _triton_interpret(mask=(1, 4, 1, 45)),
  # A bias broadcast over keys (key stride 0); the soft cap keeps it from cancelling.
  "bias-per-query-softcap": _triton_interpret(bias=(2, 4, 37, 1), logits_soft_cap=2.0),
}
# Compiled on an NVIDIA GPU through the public API: outputs and gradients against XLA.
_TRITON_GPU_CASES = {
  "bf16-h128": kc.AttentionKernelCase(dict(b=2, t=384, s=512, n=8, k=2, h=128), "bfloat16"),
  "bf16-h128-causal": kc.AttentionKernelCase(
    dict(b=2, t=512, s=512, n=8, k=8, h=128), "bfloat16", features=dict(is_causal=True)
  ),
  "bf16-h64-causal-t-gt-s": kc.AttentionKernelCase(
    dict(b=2, t=700, s=300, n=4, k=1, h=64), "bfloat16", features=dict(is_causal=True)
  ),
  "bf16-h256-window": kc.AttentionKernelCase(
    dict(b=2, t=333, s=400, n=4, k=2, h=256),
    "bfloat16",
    features=dict(local_window_size=(100, 20)),
  ),
  "bf16-h128-bias-softcap": kc.AttentionKernelCase(
    dict(b=2, t=256, s=320, n=4, k=2, h=128),
    "bfloat16",
    features=dict(bias=(2, 4, 256, 320), logits_soft_cap=20.0),
  ),
  "bf16-h128-bias-bcast-mask": kc.AttentionKernelCase(
    dict(b=2, t=200, s=300, n=4, k=2, h=128),
    "bfloat16",
    features=dict(bias=(1, 4, 1, 300), mask=(2, 1, 200, 300)),
  ),
  "bf16-h128-lengths": kc.AttentionKernelCase(
    dict(b=2, t=300, s=500, n=4, k=2, h=128),
    "bfloat16",
    features=dict(q_lengths=True, kv_lengths=True, is_causal=True),
  ),
  "bf16-h96-hv64": kc.AttentionKernelCase(
    dict(b=2, t=260, s=260, n=4, k=2, h=96, hv=64), "bfloat16"
  ),
  "f16-h128-causal": kc.AttentionKernelCase(
    dict(b=2, t=512, s=512, n=4, k=2, h=128), "float16", features=dict(is_causal=True)
  ),
  "f32-h64": kc.AttentionKernelCase(dict(b=2, t=256, s=384, n=4, k=2, h=64), "float32"),
  "f32-h256-causal": kc.AttentionKernelCase(
    dict(b=2, t=256, s=256, n=4, k=2, h=256), "float32", features=dict(is_causal=True)
  ),
}
# Compiled on a Hopper GPU through the public API (suites/kernels/test_gpu_compiled.py):
# lengths draws random lengths; bias and mask are plane shapes ([B|1, N|1, T|1, S|1]).
_MOSAIC_GPU_COMPILED_CASES = {
  "plain_h64": kc.AttentionKernelCase(dict(b=2, t=256, s=256, n=2, k=2, h=64), "bfloat16"),
  "causal_h128": kc.AttentionKernelCase(
    dict(b=1, t=384, s=384, n=2, k=1, h=128), "bfloat16", features=dict(is_causal=True)
  ),
  "gqa_causal_h128_fp16": kc.AttentionKernelCase(
    dict(b=2, t=256, s=256, n=4, k=2, h=128), "float16", features=dict(is_causal=True)
  ),
  "window_softcap_h64": kc.AttentionKernelCase(
    dict(b=1, t=320, s=320, n=2, k=2, h=64),
    "bfloat16",
    features=dict(local_window_size=(100, 40), logits_soft_cap=5.0),
  ),
  "lengths_causal_h128": kc.AttentionKernelCase(
    dict(b=3, t=256, s=256, n=2, k=2, h=128),
    "bfloat16",
    features=dict(is_causal=True, lengths=True),
  ),
  "cross_uneven_h64": kc.AttentionKernelCase(dict(b=1, t=200, s=300, n=2, k=1, h=64), "bfloat16"),
  "causal_h256": kc.AttentionKernelCase(
    dict(b=1, t=256, s=256, n=2, k=2, h=256), "bfloat16", features=dict(is_causal=True)
  ),
  "cross_uneven_fp16_h256": kc.AttentionKernelCase(
    dict(b=2, t=200, s=330, n=2, k=1, h=256), "float16"
  ),
  "gqa_lengths_window_softcap_h256": kc.AttentionKernelCase(
    dict(b=2, t=384, s=384, n=4, k=2, h=256),
    "bfloat16",
    features=dict(lengths=True, local_window_size=(150, 30), logits_soft_cap=5.0),
  ),
  "bias_full_mask_full_h128": kc.AttentionKernelCase(
    dict(b=2, t=256, s=256, n=4, k=2, h=128),
    "bfloat16",
    features=dict(bias=(2, 4, 256, 256), mask=(2, 4, 256, 256)),
  ),
  "bias_bcast_b_mask_bcast_n_causal_softcap_h64": kc.AttentionKernelCase(
    dict(b=2, t=320, s=320, n=2, k=1, h=64),
    "bfloat16",
    features=dict(
      bias=(1, 2, 320, 320), mask=(2, 1, 320, 320), is_causal=True, logits_soft_cap=5.0
    ),
  ),
  "bias_bcast_t_mask_bcast_s_window_cross_h128_fp16": kc.AttentionKernelCase(
    dict(b=1, t=200, s=300, n=4, k=4, h=128),
    "float16",
    features=dict(bias=(1, 4, 1, 300), mask=(1, 4, 200, 1), local_window_size=(100, 40)),
  ),
  # Logits about -100 under a narrow window, with the heuristic's blocks: rows near the end
  # of a query tile see nothing of its first key block, then only logits far below 0 (the
  # running max must stay -inf through the empty step; 62cf52f). The bias varies over keys:
  # one constant over keys has a gradient of exactly 0, which no relative error can judge.
  "window_far_negative_bias_h64": kc.AttentionKernelCase(
    dict(b=1, t=512, s=512, n=2, k=1, h=64),
    "bfloat16",
    features=dict(bias=(1, 1, 1, 512), bias_shift=-100.0, local_window_size=(10, 10)),
  ),
}
# Mosaic TPU's, in Pallas's TPU interpreter (suites/kernels/test_tpu_attention.py), forward
# and gradients against float64: T and S not multiples of the blocks (padded), several
# blocks per sequence so that masks skip some; sequence lengths are values per batch.
_TPU_SMALL_BLOCKS = dict(block_q=64, block_kv=128, bwd_block_q=32, bwd_block_kv=128)
_MOSAIC_TPU_CASES = {
  "gqa_causal_f32": kc.AttentionKernelCase(
    dict(b=1, t=200, s=250, n=4, k=2, h=64),
    "float32",
    features=dict(is_causal=True),
    config=_TPU_SMALL_BLOCKS,
  ),
  "window_softcap_bf16_h128": kc.AttentionKernelCase(
    dict(b=1, t=256, s=256, n=2, k=1, h=128),
    "bfloat16",
    features=dict(local_window_size=(70, 10), logits_soft_cap=3.0),
    config=dict(block_q=32, block_kv=128, bwd_block_q=64, bwd_block_kv=128),
  ),
  # Batch 1 sees no key: zeros and zero gradients.
  "lengths_causal_f32": kc.AttentionKernelCase(
    dict(b=2, t=130, s=140, n=2, k=2, h=64),
    "float32",
    features=dict(is_causal=True, query_seq_lengths=(100, 37), key_value_seq_lengths=(90, 0)),
    config=_TPU_SMALL_BLOCKS,
  ),
  # Rows past S + 5 see no key.
  "mqa_window_t_gt_s_hv128": kc.AttentionKernelCase(
    dict(b=1, t=256, s=130, n=2, k=1, h=64, hv=128),
    "float32",
    features=dict(local_window_size=(20, 5)),
    config=_TPU_SMALL_BLOCKS,
  ),
  "heuristic_bf16": kc.AttentionKernelCase(dict(b=2, t=128, s=128, n=2, k=1, h=64), "bfloat16"),
  # Full planes (padded with T and S) with rows that see nothing; the bias gradient too.
  "bias_mask_full_causal_f32": kc.AttentionKernelCase(
    dict(b=2, t=136, s=200, n=2, k=1, h=64),
    "float32",
    features=dict(
      is_causal=True,
      bias=kc.RandomBias(21, (2, 2, 136, 200)),
      mask=kc.RandomMask(22, (2, 2, 136, 200)),
    ),
    config=_TPU_SMALL_BLOCKS,
  ),
  # Planes broadcast in B, N, T or S: [1, N, 1, S] bias, [B, 1, T, 1] mask.
  "bias_mask_broadcast_softcap_bf16": kc.AttentionKernelCase(
    dict(b=2, t=128, s=256, n=4, k=2, h=64),
    "bfloat16",
    features=dict(
      logits_soft_cap=5.0,
      bias=kc.RandomBias(23, (1, 4, 1, 256), "bfloat16"),
      mask=kc.RandomMask(24, (2, 1, 128, 1), p=0.8, dead_rows=0.0),
    ),
    config=_TPU_SMALL_BLOCKS,
  ),
}
_KERNEL_CASES = {
  "mosaic": _MOSAIC_CASES,
  "mosaic_tpu": _MOSAIC_TPU_CASES,
  "mosaic:gpu_compiled": _MOSAIC_GPU_COMPILED_CASES,
  "mosaic:gpu": _MOSAIC_GPU_CASES,
  "mosaic:gpu_configs": _MOSAIC_GPU_CONFIG_CASES,
  "triton:compile": _TRITON_COMPILE_CASES,
  "triton:interpret": _TRITON_INTERPRET_CASES,
  "triton:gpu": _TRITON_GPU_CASES,
}

INFO = base.OpInfo(
  name="dot_product_attention",
  build=build,
  reference=reference,
  reduction_length=lambda s, f: base.conditioned(max(s["h"], s["s"]), f),
  has_matmul=True,
  features={
    "plain": {},
    "causal": {"is_causal": True},
    "bias": {"bias": "full"},
    "bias_bcast": {"bias": "heads"},
    "mask": {"mask": "full"},
    "mask_bcast": {"mask": "keys"},
    "window": {"local_window_size": (7, 3)},
    "causal_window": {"is_causal": True, "local_window_size": 5},
    "soft_cap": {"logits_soft_cap": 2.0},
    "kv_lengths": {"kv_seq_lengths": True},
    "q_lengths": {"q_seq_lengths": True, "is_causal": True},
    "scale": {"scale": 0.3},
    # Logits in the hundreds. Softmax rounding grows with the logits' size (and gradients
    # cancel terms that large: dk sums dS * q), so `conditioning` c widens the bound as a
    # c**2-times longer reduction would (atol scales with sqrt(L)).
    "large_logits": {"magnitude": 100.0, "conditioning": 100.0},
    "empty_rows": {"mask": "empty_rows"},
  },
  matrices={
    base.CPU: base.Matrix(
      shapes=(
        dict(b=2, t=40, s=56, n=4, k=2, h=32),
        dict(b=1, t=33, s=33, n=3, k=1, h=16, hv=24, dtypes=("float32",)),
      ),
      dtypes=("float32", "bfloat16"),
      interpret_shapes=(dict(b=1, t=40, s=72, n=2, k=1, h=32),),
    ),
    base.H100: _GPU,
    base.A100: _GPU,
    base.TPU_V5: _TPU,
  },
  golden_shape=dict(b=1, t=128, s=128, n=2, k=1, h=64),
  abstract_call=(jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16),) * 3,
  bench={
    base.CPU: (base.BenchCall(dict(b=1, t=256, s=256, n=4, k=4, h=64), "float32", "causal"),),
    base.H100: _GPU_BENCH,
    base.A100: _GPU_BENCH,
    base.TPU_V5: _GPU_BENCH,
  },
  sizes=_sizes,
  # Key chunks of 16: the matrix's S=56 and S=33 end in a partial chunk (8 and 1 keys).
  config_variants={"xla_chunked": {"kv16": {"kv_chunk_size": 16}}},
  anchors={"jax.nn": _jax_nn},
  kernel_cases=_KERNEL_CASES,
  bench_features={
    "bias_plane": {"bias": "heads_plane"},
    "mask_plane": {"mask": "batch_plane"},
    "bias_mask_planes": {"bias": "heads_plane", "mask": "batch_plane"},
    "sliding_window": {"is_causal": True, "local_window_size": (1024, 0)},
  },
)
