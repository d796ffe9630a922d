"""dot_product_attention as Triton flash-attention kernels, called through jax-triton.

The kernels live in `triton_flash.py`. This module turns a canonical
`AttentionArgs` into kernel launches through `triton_call` (jax-triton,
imported only when a kernel runs; recorded or interpreted in CPU tests), and
decides what the kernels support and which block sizes they use.

The backward pass is two deterministic kernels: one program per key block
accumulates dK and dV over every query head of its key/value head, and one
program per query block accumulates dQ; neither uses atomics.
"""

import dataclasses
import itertools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from tokamax._src import device, numerics, triton_call
from tokamax._src.ops import kernel_ops
from tokamax._src.ops.attention import spec, triton_flash

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class TritonAttentionConfig:
  """Block sizes and compile options of the kernels.

  The forward kernel holds `block_q` query rows and streams `block_k` keys at a
  time. In the backward pass the dK/dV kernel holds `bwd_block_outer` keys and
  streams `bwd_block_inner` query rows; the dQ kernel holds `bwd_block_outer`
  query rows and streams `bwd_block_inner` keys.
  """

  block_q: int = 128
  block_k: int = 64
  num_warps: int = 8
  num_stages: int = 3
  bwd_block_outer: int = 128
  bwd_block_inner: int = 64
  bwd_num_warps: int = 8
  bwd_num_stages: int = 2

  # The fields the forward kernel ignores (see `Op._forward_config`).
  BACKWARD_FIELDS: ClassVar[tuple[str, ...]] = (
    "bwd_block_outer",
    "bwd_block_inner",
    "bwd_num_warps",
    "bwd_num_stages",
  )

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if f.name.startswith(("block", "bwd_block")) and (value < 16 or value & (value - 1)):
        raise ValueError(f"`{f.name}` must be a power of two >= 16, got {value}.")
      if f.name.endswith("num_warps") and value & (value - 1):
        # Triton's NVIDIA backend asserts it when compiling.
        raise ValueError(f"`{f.name}` must be a power of two, got {value}.")
      if value < 1:
        raise ValueError(f"`{f.name}` must be positive, got {value}.")


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _pow2(x: int) -> int:
  return max(16, 1 << (int(x) - 1).bit_length())


def _broadcast_strides(x: jax.Array | None) -> tuple[int, int, int, int]:
  """Element strides of a contiguous [B|1,N|1,T|1,S|1] array, 0 along broadcast dims."""
  if x is None:
    return (0, 0, 0, 0)
  strides = np.cumprod((*x.shape[1:], 1)[::-1])[::-1]
  return tuple(0 if d == 1 else int(st) for d, st in zip(x.shape, strides, strict=True))


def _absent(dtype) -> jax.Array:
  """A one-element stand-in for an absent optional input (the kernel never reads it)."""
  return jnp.zeros((1,), dtype)


def _inputs_and_constants(args: spec.AttentionArgs) -> tuple[tuple[jax.Array, ...], dict[str, Any]]:
  """The seven inputs every kernel takes first, and the constants they share."""
  q, k, v = args.query, args.key, args.value
  _, t, n, h = q.shape
  s, kh, hv = k.shape[1], k.shape[2], v.shape[-1]
  left, right = args.local_window if args.local_window is not None else (-1, -1)
  mask = None if args.mask is None else args.mask.astype(jnp.int8)
  inputs = (
    q,
    k,
    v,
    _absent(jnp.float32) if args.bias is None else args.bias,
    _absent(jnp.int8) if mask is None else mask,
    _absent(jnp.int32) if args.q_seq_lengths is None else args.q_seq_lengths,
    _absent(jnp.int32) if args.kv_seq_lengths is None else args.kv_seq_lengths,
  )
  bias_strides = _broadcast_strides(args.bias)
  mask_strides = _broadcast_strides(mask)
  constants = dict(
    T=t,
    S=s,
    N=n,
    KH=kh,
    H=h,
    HV=hv,
    SCALE=float(args.scale),
    SOFT_CAP=float(args.soft_cap or 0.0),
    CAUSAL=bool(args.is_causal),
    LEFT=int(left),
    RIGHT=int(right),
    HAS_BIAS=args.bias is not None,
    **dict(zip(("BIAS_SB", "BIAS_SN", "BIAS_ST", "BIAS_SS"), bias_strides, strict=True)),
    HAS_MASK=mask is not None,
    **dict(zip(("MASK_SB", "MASK_SN", "MASK_ST", "MASK_SS"), mask_strides, strict=True)),
    HAS_Q_LEN=args.q_seq_lengths is not None,
    HAS_KV_LEN=args.kv_seq_lengths is not None,
    DOT_PRECISION=numerics.triton_input_precision(args.query.dtype, args.precision),
    BLOCK_H=_pow2(h),
    BLOCK_HV=_pow2(hv),
  )
  return inputs, constants


def forward(args: spec.AttentionArgs, config: TritonAttentionConfig) -> tuple[jax.Array, jax.Array]:
  """The attention output and the base-2 log-sum-exp [B,N,T] (+inf where a row sees nothing)."""
  inputs, constants = _inputs_and_constants(args)
  b, t, n, _ = args.query.shape
  hv = args.value.shape[-1]
  out, lse = triton_call.call(
    triton_flash.fwd_kernel,
    *inputs,
    out_shape=(
      jax.ShapeDtypeStruct((b, t, n, hv), args.query.dtype),
      jax.ShapeDtypeStruct((b, n, t), jnp.float32),
    ),
    grid=(cdiv(t, config.block_q) * n * b,),
    num_warps=config.num_warps,
    num_stages=config.num_stages,
    BLOCK_M=config.block_q,
    BLOCK_N=config.block_k,
    **constants,
  )
  return out, lse


def backward(
  args: spec.AttentionArgs,
  config: TritonAttentionConfig,
  out: jax.Array,
  lse: jax.Array,
  dout: jax.Array,
) -> dict[str, jax.Array | None]:
  """Cotangents of query, key, value and bias: a dK/dV kernel, then a dQ kernel."""
  inputs, constants = _inputs_and_constants(args)
  q, k, v = args.query, args.key, args.value
  b, t, n, _ = q.shape
  s, kh = k.shape[1], k.shape[2]
  dout = dout.astype(q.dtype)
  delta = spec.output_delta(out, dout)
  grad_inputs = (*inputs, dout, lse, delta)
  has_bias = args.bias is not None
  options = dict(num_warps=config.bwd_num_warps, num_stages=config.bwd_num_stages)
  dk, dv, dbias = triton_call.call(
    triton_flash.dkdv_kernel,
    *grad_inputs,
    out_shape=(
      jax.ShapeDtypeStruct(k.shape, k.dtype),
      jax.ShapeDtypeStruct(v.shape, v.dtype),
      # In the bias's dtype: half the bytes of float32 for a bf16 bias, which the sum
      # over broadcast dims reads back (then in float32).
      jax.ShapeDtypeStruct((b, n, t, s), args.bias.dtype)
      if has_bias
      else jax.ShapeDtypeStruct((1,), jnp.float32),
    ),
    grid=(cdiv(s, config.bwd_block_outer) * kh * b,),
    BLOCK_M=config.bwd_block_inner,
    BLOCK_N=config.bwd_block_outer,
    HAS_DBIAS=has_bias,
    **options,
    **constants,
  )
  (dq,) = triton_call.call(
    triton_flash.dq_kernel,
    *grad_inputs,
    out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),),
    grid=(cdiv(t, config.bwd_block_outer) * n * b,),
    BLOCK_M=config.bwd_block_outer,
    BLOCK_N=config.bwd_block_inner,
    **options,
    **constants,
  )
  return {"query": dq, "key": dk, "value": dv, "bias": _reduce_dbias(args, dbias)}


def _reduce_dbias(args: spec.AttentionArgs, dbias: jax.Array) -> jax.Array | None:
  """Sums the full [B,N,T,S] logits gradient over the bias's broadcast dims (in float32)."""
  if args.bias is None:
    return None
  axes = tuple(i for i, d in enumerate(args.bias.shape) if d == 1 and dbias.shape[i] != 1)
  return jnp.sum(dbias, axis=axes, keepdims=True, dtype=jnp.float32).astype(args.bias.dtype)


# -- Configs --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Footprint:
  """What sets the kernels' shared memory: head dims, element bytes, and bytes of
  bias and mask loaded per logit (0 without them)."""

  h: int
  hv: int
  itemsize: int
  logit_bytes: int = 0

  @classmethod
  def of(cls, args: spec.AttentionArgs) -> "Footprint":
    logit_bytes = 0 if args.bias is None else np.dtype(args.bias.dtype).itemsize
    logit_bytes += 0 if args.mask is None else 1
    return cls(
      _pow2(args.query.shape[-1]),
      _pow2(args.value.shape[-1]),
      np.dtype(args.query.dtype).itemsize,
      logit_bytes,
    )


def fwd_shared_memory(config: TritonAttentionConfig, fp: Footprint) -> int:
  """Bytes the forward kernel stages: q, then k, v (and bias/mask tiles) per stage."""
  per_stage = fp.itemsize * config.block_k * (fp.h + fp.hv)
  per_stage += fp.logit_bytes * config.block_q * config.block_k
  return fp.itemsize * config.block_q * fp.h + config.num_stages * per_stage


def bwd_shared_memory(config: TritonAttentionConfig, fp: Footprint) -> int:
  """Bytes of the larger backward kernel: outer tiles held, inner tiles per stage."""
  outer, inner = config.bwd_block_outer, config.bwd_block_inner
  per_stage = (fp.itemsize * (fp.h + fp.hv) + 8) * inner + fp.logit_bytes * outer * inner
  return fp.itemsize * outer * (fp.h + fp.hv) + config.bwd_num_stages * per_stage


def _clamp(config: TritonAttentionConfig, t: int, s: int) -> TritonAttentionConfig:
  """Shrinks blocks larger than the (power-of-two padded) sequences."""
  longest = max(t, s)
  return dataclasses.replace(
    config,
    block_q=min(config.block_q, _pow2(t)),
    block_k=min(config.block_k, _pow2(s)),
    bwd_block_outer=min(config.bwd_block_outer, _pow2(longest)),
    bwd_block_inner=min(config.bwd_block_inner, _pow2(longest)),
  )


_SHRINK_STEPS = (
  (
    fwd_shared_memory,
    (("num_stages", 2), ("block_k", 32), ("block_q", 64), ("block_k", 16), ("block_q", 16)),
  ),
  (
    bwd_shared_memory,
    (
      ("bwd_num_stages", 2),
      ("bwd_block_inner", 32),
      ("bwd_block_outer", 64),
      ("bwd_block_inner", 16),
      ("bwd_block_outer", 16),
    ),
  ),
)


def _shrink(
  config: TritonAttentionConfig, fp: Footprint, cc: tuple[int, int]
) -> TritonAttentionConfig:
  """Fewer stages, then smaller blocks, until each kernel fits in shared memory on `cc`."""
  limit = device.shared_memory_per_block(cc)
  for shared_memory, steps in _SHRINK_STEPS:
    for name, floor in steps:
      while shared_memory(config, fp) > limit and getattr(config, name) > floor:
        value = getattr(config, name)
        value = value - 1 if name.endswith("stages") else value // 2
        config = dataclasses.replace(config, **{name: max(value, floor)})
  return config


def heuristic_config(
  args: spec.AttentionArgs, cc: tuple[int, int] = device.DEFAULT_COMPUTE_CAPABILITY
) -> TritonAttentionConfig:
  """Block sizes by head dim, dtype and the GPU's compute capability `cc`.

  Chosen from the compiler's register and shared-memory reports for sm_90 (the
  16-bit kernels at head dims 64, 128 and 256 compile without spills; see the
  compile tests); not yet tuned by timings on the GPU.
  """
  fp = Footprint.of(args)
  width = max(fp.h, fp.hv)
  if width <= 64:
    config = TritonAttentionConfig(128, 64, 4, 3, 128, 64, 8, 2)
  elif width <= 128:
    config = TritonAttentionConfig(128, 128, 8, 3, 128, 32, 8, 3)
  else:
    config = TritonAttentionConfig(128, 64, 8, 2, 64, 32, 8, 2)
  if cc < (9, 0):
    config = dataclasses.replace(config, num_stages=2, block_k=min(config.block_k, 64))
  if fp.itemsize > 2:
    config = dataclasses.replace(config, block_k=config.block_k // 2)
  config = _clamp(config, args.query.shape[1], args.key.shape[1])
  return _shrink(config, fp, cc)


def autotuning_configs(
  args: spec.AttentionArgs, cc: tuple[int, int] = device.DEFAULT_COMPUTE_CAPABILITY
) -> set[TritonAttentionConfig]:
  """Forward variants around the heuristic's backward, and backward variants around its forward."""
  base = heuristic_config(args, cc)
  t, s = args.query.shape[1], args.key.shape[1]
  variants = [base]
  for bq, bk, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
    variants.append(
      dataclasses.replace(base, block_q=bq, block_k=bk, num_warps=warps, num_stages=stages)
    )
  for outer, inner, warps, stages in itertools.product((64, 128), (32, 64), (4, 8), (2, 3)):
    variants.append(
      dataclasses.replace(
        base,
        bwd_block_outer=outer,
        bwd_block_inner=inner,
        bwd_num_warps=warps,
        bwd_num_stages=stages,
      )
    )
  fp = Footprint.of(args)
  return {_shrink(_clamp(c, t, s), fp, cc) for c in variants}


def unsupported_reason(args: spec.AttentionArgs) -> str | None:
  """Why the kernels cannot compute `args` (independent of the device), or None."""
  q, k, v = args.query, args.key, args.value
  if q.dtype not in DTYPES:
    return f"dtype {q.dtype} (the Triton kernels take bfloat16, float16 and float32)"
  h, hv = q.shape[-1], v.shape[-1]
  if max(h, hv) > MAX_HEAD_DIM:
    return f"head dims {h} and {hv} (the Triton kernels take at most {MAX_HEAD_DIM})"
  if (reason := spec.empty_reason(args)) is not None:
    return reason
  _, t, n, _ = q.shape
  s, kh = k.shape[1], k.shape[2]
  if max(t * n, s * kh) * max(h, hv) >= 2**31:
    return "one batch element of more than 2**31 elements (the kernels index it in 32 bits)"
  return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonAttention(kernel_ops.TritonOp):
  """Flash attention in Triton: forward, and a deterministic dQ, dK, dV (and dbias) backward."""

  name = "triton"
  spec = spec.SPEC
  config_cls = TritonAttentionConfig

  def _unsupported_reason(self, args):
    return unsupported_reason(args)

  def _bwd_unsupported_reason(self, args):
    return None

  def _get_heuristics_config(self, args):
    return heuristic_config(args, device.target_compute_capability())

  def _get_autotuning_configs(self, args):
    return autotuning_configs(args, device.target_compute_capability())

  def _fwd(self, args, config):
    return forward(args, config)

  def _bwd(self, args, config, out, residuals, dout):
    return backward(args, config, out, residuals, dout)
