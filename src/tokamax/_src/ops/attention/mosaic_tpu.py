"""dot_product_attention with Pallas Mosaic TPU flash attention kernels.

Forward and backward (`mosaic_tpu_kernel`): causal and local-window masks
(blocks that they hide entirely are skipped), GQA/MQA, soft cap, sequence
lengths, bias and boolean mask (read by the kernels as float32 and int32
planes; the bias gradient comes from XLA's attention); head dims 64 to 256
(multiples of 64), bfloat16 and float32.
`implementation="mosaic"` names this implementation on a TPU.

Block sizes come from a cost model: among the blocks that Mosaic's tiling
allows (query rows a multiple of 8 sublanes, 16 for bfloat16; keys a multiple
of 128 lanes) and whose VMEM footprint (`vmem_bytes`) fits the target chip's
limit (`tpu.Chip`, v5e or v5p), the one with the least roofline time: the key
and value blocks refetched for every query block that sees them (causal
halves that), the matmuls of the visited blocks, plus a fixed cost per grid
step. The backward's blocks come from the same model for its kernels. It
ranks blocks; it claims no timing.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from tokamax._src import tpu
from tokamax._src.ops import kernel_ops
from tokamax._src.ops.attention import mosaic_tpu_kernel as kernel
from tokamax._src.ops.attention import spec, xla

_DTYPES = ("bfloat16", "float32")
# At most 512: the model counts two (forward) or four (backward) float32 [block_q,
# block_kv] temporaries, Mosaic may keep more of them live.
_Q_BLOCKS = (128, 256, 512)
_KV_BLOCKS = (128, 256, 512)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicTpuAttentionConfig:
  """Block sizes of one call.

  Attributes:
    block_q: Query rows per block of the forward (a multiple of 8, 16 for bfloat16).
    block_kv: Keys per block of the forward (a multiple of 128).
    bwd_block_q: Query rows per block of the dq and dk/dv kernels.
    bwd_block_kv: Keys per block of the dq and dk/dv kernels.
  """

  block_q: int = 128
  block_kv: int = 128
  bwd_block_q: int = 128
  bwd_block_kv: int = 128

  # The fields the forward kernel ignores (see `Op._forward_config`).
  BACKWARD_FIELDS: ClassVar[tuple[str, ...]] = ("bwd_block_q", "bwd_block_kv")


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _head_dims(args: spec.AttentionArgs) -> tuple[int, int]:
  return args.query.shape[-1], args.value.shape[-1]


def vmem_bytes(args: spec.AttentionArgs, block_q: int, block_kv: int, backward: bool) -> int:
  """VMEM of one kernel's blocks: double-buffered inputs and outputs, scratch, temporaries.

  Forward: q, k, v (and the bias and mask planes' blocks) in; out and the
  log-sum-exp out; max, sum and the float32 accumulator; logits and
  probabilities. Backward (the larger of dq and dk/dv): q, k, v, dout,
  log-sum-exp and delta (and the planes) in; dk and dv out with their float32
  accumulators; logits, probabilities and their two cotangents.
  """
  h, hv = _head_dims(args)
  size = np.dtype(args.query.dtype).itemsize
  rows = block_q * kernel.LANES * 4
  tile = block_q * block_kv * 4
  planes = sum(
    (block_q if x.shape[2] > 1 else 1) * (block_kv if x.shape[3] > 1 else 1) * 4
    for x in (args.bias, args.mask)
    if x is not None
  )
  if not backward:
    inputs = block_q * h * size + block_kv * (h + hv) * size + planes
    outputs = block_q * hv * size + rows
    return 2 * (inputs + outputs) + 2 * rows + block_q * hv * 4 + 2 * tile
  inputs = (block_q * (h + hv) + block_kv * (h + hv)) * size + 2 * rows + planes
  outputs = block_kv * (h + hv) * size
  return 2 * (inputs + outputs) + block_kv * (h + hv) * 4 + 4 * tile


def _blocks_reason(args: spec.AttentionArgs, block_q: int, block_kv: int, what: str) -> str | None:
  sublanes = 32 // np.dtype(args.query.dtype).itemsize
  if block_q < sublanes or block_q % sublanes:
    return f"{what}block_q={block_q} must be a multiple of {sublanes} for {args.query.dtype}"
  if block_kv < kernel.LANES or block_kv % kernel.LANES:
    return f"{what}block_kv={block_kv} must be a multiple of {kernel.LANES}"
  chip = tpu.chip()
  need = vmem_bytes(args, block_q, block_kv, backward=bool(what))
  if need > chip.vmem_limit_bytes:
    return (
      f"{what}blocks need {need} bytes of VMEM, over the {chip.vmem_limit_bytes} used on"
      f" {chip.name}"
    )
  return None


def config_reason(args: spec.AttentionArgs, config: MosaicTpuAttentionConfig) -> str | None:
  """Why the forward cannot take `config` on the target chip, or None."""
  return _blocks_reason(args, config.block_q, config.block_kv, "")


def bwd_config_reason(args: spec.AttentionArgs, config: MosaicTpuAttentionConfig) -> str | None:
  """Why the backward cannot take `config` on the target chip, or None."""
  return _blocks_reason(args, config.bwd_block_q, config.bwd_block_kv, "bwd_")


def _visited_fraction(args: spec.AttentionArgs, block_q: int, block_kv: int) -> float:
  """The share of (query block, key block) pairs that the masks leave visible."""
  t, s = args.query.shape[1], args.key.shape[1]
  nq, nk = -(-t // block_q), -(-s // block_kv)
  if not args.is_causal and args.local_window is None:
    return 1.0
  p = kernel.Params(
    block_q=block_q, block_kv=block_kv, scale=1.0, causal=args.is_causal, window=args.local_window
  )
  visited = 0
  for i in range(nq):  # The kernels' own block ranges, in numpy.
    first, last = kernel.kv_blocks(i, t, s, p, np)
    visited += max(0, int(last) - int(first) + 1)
  return visited / (nq * nk)


def estimated_seconds(
  args: spec.AttentionArgs, block_q: int, block_kv: int, backward: bool = False
) -> float:
  """The cost model's time for these blocks on the target chip (for ranking blocks only)."""
  b, t, n, h = args.query.shape
  s, hv = args.key.shape[1], args.value.shape[-1]
  size = np.dtype(args.query.dtype).itemsize
  nq, nk = -(-t // block_q), -(-s // block_kv)
  pairs = b * n * nq * nk * _visited_fraction(args, block_q, block_kv)
  flops = 2 * pairs * block_q * block_kv * (h + hv)
  q_bytes = block_q * (h + hv) * size  # q and out (backward: q and dout, read per key block).
  kv_bytes = block_kv * (h + hv) * size
  if backward:
    flops *= 2.5  # Logits again, dS, dq, dk, dv.
    hbm = pairs * (q_bytes + kv_bytes) * 2
  else:
    hbm = pairs * kv_bytes + b * n * nq * q_bytes
  return tpu.chip().seconds(flops, hbm, b * n * nq * nk, size)


def _ranked(args: spec.AttentionArgs, backward: bool) -> list[tuple[int, int]]:
  t, s = args.query.shape[1], args.key.shape[1]
  sublanes = 32 // np.dtype(args.query.dtype).itemsize
  qs = {b for b in _Q_BLOCKS if b < t} | {min(_round_up(t, sublanes), _Q_BLOCKS[-1])}
  ks = {b for b in _KV_BLOCKS if b < s} | {min(_round_up(s, kernel.LANES), _KV_BLOCKS[-1])}
  what = "bwd_" if backward else ""
  fitting = [
    (bq, bk)
    for bq, bk in itertools.product(sorted(qs), sorted(ks))
    if _blocks_reason(args, bq, bk, what) is None
  ]
  return sorted(fitting, key=lambda c: (estimated_seconds(args, *c, backward=backward), c))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicTpuAttention(kernel_ops.MosaicTpuOp):
  """Flash attention in Pallas Mosaic TPU, forward and backward."""

  name = "mosaic_tpu"
  spec = spec.SPEC
  config_cls = MosaicTpuAttentionConfig

  def _unsupported_reason(self, args: spec.AttentionArgs) -> str | None:
    if (reason := spec.empty_reason(args)) is not None:
      return reason
    dtype = np.dtype(args.query.dtype).name
    if dtype not in _DTYPES:
      return f"dtype {dtype} (the Mosaic TPU kernel takes {', '.join(_DTYPES)})"
    for name, dim in zip(("query", "value"), _head_dims(args), strict=True):
      if dim % 64 or not 64 <= dim <= 256:
        return f"{name} head dim {dim} (the Mosaic TPU kernel takes 64, 128, 192 or 256)"
    config = self.config if self.config is not None else self._get_heuristics_config(args)
    return config_reason(args, config)

  def _bwd_unsupported_reason(self, args: spec.AttentionArgs) -> str | None:
    config = self.config if self.config is not None else self._get_heuristics_config(args)
    return bwd_config_reason(args, config)

  def _get_heuristics_config(self, args: spec.AttentionArgs) -> MosaicTpuAttentionConfig:
    fwd, bwd = _ranked(args, False), _ranked(args, True)
    default = MosaicTpuAttentionConfig()
    bq, bk = fwd[0] if fwd else (default.block_q, default.block_kv)
    bwd_q, bwd_kv = bwd[0] if bwd else (default.bwd_block_q, default.bwd_block_kv)
    return MosaicTpuAttentionConfig(block_q=bq, block_kv=bk, bwd_block_q=bwd_q, bwd_block_kv=bwd_kv)

  def _get_autotuning_configs(self, args: spec.AttentionArgs) -> set[MosaicTpuAttentionConfig]:
    fwd, bwd = _ranked(args, False)[:4], _ranked(args, True)[:4]
    configs = {
      MosaicTpuAttentionConfig(block_q=a, block_kv=b, bwd_block_q=c, bwd_block_kv=d)
      for (a, b), (c, d) in itertools.product(fwd, bwd)
    }
    return configs or {self._get_heuristics_config(args)}

  def _params(self, args: spec.AttentionArgs, block_q: int, block_kv: int) -> kernel.Params:
    return kernel.Params(
      block_q=block_q,
      block_kv=block_kv,
      scale=args.scale,
      soft_cap=args.soft_cap,
      causal=args.is_causal,
      window=args.local_window,
      precision=args.precision,
      bias=args.bias is not None,
      mask=args.mask is not None,
    )

  def _common(self) -> dict:
    return dict(vmem_limit_bytes=tpu.chip().vmem_limit_bytes, interpret=self.interpret_params)

  def _fwd(self, args: spec.AttentionArgs, config: MosaicTpuAttentionConfig):
    q, k, v = args.query, args.key, args.value
    t = q.shape[1]
    lengths = _lengths(args)
    p = self._params(args, config.block_q, config.block_kv)
    out, lse = kernel.forward(
      _heads_first(q, p.block_q),
      _heads_first(k, p.block_kv),
      _heads_first(v, p.block_kv),
      *lengths,
      _planes(args, p),
      p,
      **self._common(),
    )
    return jnp.swapaxes(out[:, :, :t], 1, 2), (lse[:, :, :t, 0], lengths)

  def _bwd(self, args, config, out, residuals, dout):
    lse, (q_len, kv_len) = residuals
    q, k, v = args.query, args.key, args.value
    t, s = q.shape[1], k.shape[1]
    p = self._params(args, config.bwd_block_q, config.bwd_block_kv)
    delta = jnp.einsum(
      "btnh,btnh->bnt",
      out.astype(jnp.float32),
      dout.astype(jnp.float32),
      precision=args.precision,
    )
    t_pad = _round_up(t, p.block_q)

    def rows(x):  # [B, N, T] -> [B, N, T_pad, LANES]
      x = jnp.pad(x, ((0, 0), (0, 0), (0, t_pad - t)))
      return jnp.broadcast_to(x[..., None], (*x.shape, kernel.LANES))

    dq, dk, dv = kernel.backward(
      _heads_first(q, p.block_q),
      _heads_first(k, p.block_kv),
      _heads_first(v, p.block_kv),
      _heads_first(dout.astype(v.dtype), p.block_q),
      rows(lse),
      rows(delta),
      q_len,
      kv_len,
      _planes(args, p),
      p,
      **self._common(),
    )
    grads = {
      "query": jnp.swapaxes(dq[:, :, :t], 1, 2),
      "key": jnp.swapaxes(dk[:, :, :s], 1, 2),
      "value": jnp.swapaxes(dv[:, :, :s], 1, 2),
    }
    if args.bias is not None:
      grads["bias"] = xla.bias_grad(args, out, dout)
    return grads


def _planes(args: spec.AttentionArgs, p: kernel.Params) -> list[jax.Array]:
  """The bias (float32) and mask (int32) planes, T and S padded to whole blocks where full."""
  planes = []
  for x, dtype in ((args.bias, jnp.float32), (args.mask, jnp.int32)):
    if x is None:
      continue
    pad = [(0, 0), (0, 0)]
    for length, block in ((x.shape[2], p.block_q), (x.shape[3], p.block_kv)):
      pad.append((0, _round_up(length, block) - length if length > 1 else 0))
    planes.append(jnp.pad(x.astype(dtype), pad))
  return planes


def _heads_first(x: jax.Array, block: int) -> jax.Array:
  """[B, L, N, H] -> [B, N, L_pad, H], L padded with zeros to a multiple of `block`."""
  length = x.shape[1]
  x = jnp.pad(x, ((0, 0), (0, _round_up(length, block) - length), (0, 0), (0, 0)))
  return jnp.swapaxes(x, 1, 2)


def _lengths(args: spec.AttentionArgs) -> tuple[jax.Array, jax.Array]:
  """int32 [B] query and key lengths, at most T and S (the full lengths by default)."""
  (b, t), s = args.query.shape[:2], args.key.shape[1]
  out = []
  for given, full in ((args.q_seq_lengths, t), (args.kv_seq_lengths, s)):
    x = jnp.full((b,), full, jnp.int32) if given is None else jnp.clip(given, 0, full)
    out.append(x.astype(jnp.int32))
  return out[0], out[1]
