"""layer_norm (LayerNorm/RMSNorm) as Triton kernels, with a fused backward pass."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from tokamax._src import device, triton_call
from tokamax._src.ops import kernel_ops
from tokamax._src.ops.normalization import spec
from tokamax._src.ops.normalization import triton_layer_norm as kernels

_DTYPES = ("float32", "bfloat16", "float16")
_MAX_D = 32768  # Rows are held in registers; longer rows would spill.
# Shared memory for the pipelined loops' stages: at most 128 KiB, and 2 KiB under a block's
# limit (the loops' 96 KiB compile to 96-98 KiB; sm_86/89/120 blocks have 99 KiB).
_SMEM = 128 * 1024
_SMEM_HEADROOM = 2 * 1024


def _smem_budget() -> int:
  return min(_SMEM, device.shared_memory_per_block() - _SMEM_HEADROOM)


# Columns per program of the partial sums' reduction: one 128-byte line of float32 per row.
_SUM_BLOCK_C = 32


@dataclasses.dataclass(frozen=True)
class TritonNormConfig:
  """Launch parameters.

  Attributes:
    block_m: Rows per program in the forward kernel.
    num_warps: Warps per program in the forward kernel.
    bwd_block_m: Rows per step in the backward kernel.
    bwd_num_warps: Warps per program in the backward kernel.
    bwd_programs: Programs of the backward kernel (each sums dscale/doffset
      over a contiguous run of rows).
    fwd_programs: 0 for one program per row block; else this many persistent
      programs, each loading its next block before normalising the current one.
    bwd_prefetch: Whether the backward kernel loads the next rows into
      registers before the current rows' reductions.
    fwd_stages: With `fwd_programs`, > 1 pipelines the persistent forward's
      loads through shared memory this many stages deep (instead of the
      register prefetch).
    bwd_stages: > 1 pipelines the backward's loads of x and dy through shared
      memory this many stages deep (cp.async; overrides `bwd_prefetch`).
    fwd_one_pass: Whether the LayerNorm forward reduces a row's sum and sum of
      squares (shifted by its first element) together, in one round.
    fwd_streaming: Whether a forward that saves nothing for a gradient loads x
      as first to leave L2 (evict_first) and stores y past it (.cs): no
      backward rereads x then.
  """

  block_m: int = 1
  num_warps: int = 8
  bwd_block_m: int = 1
  bwd_num_warps: int = 8
  bwd_programs: int = 528
  fwd_programs: int = 0
  bwd_prefetch: bool = False
  fwd_stages: int = 0
  bwd_stages: int = 0
  fwd_one_pass: bool = False
  fwd_streaming: bool = False

  # The fields the forward kernel ignores (see `Op._forward_config`).
  BACKWARD_FIELDS: ClassVar[tuple[str, ...]] = (
    "bwd_block_m",
    "bwd_num_warps",
    "bwd_programs",
    "bwd_prefetch",
    "bwd_stages",
  )


def _rows(args: spec.NormArgs) -> tuple[int, int]:
  d = args.x.shape[args.axis]
  return math.prod(args.x.shape) // max(d, 1), d


def _block_d(d: int) -> int:
  return max(16, 1 << (d - 1).bit_length())


def _to_rows(args: spec.NormArgs) -> jax.Array:
  x = jnp.moveaxis(args.x, args.axis, -1)
  return x.reshape(-1, x.shape[-1])


def _from_rows(args: spec.NormArgs, y: jax.Array) -> jax.Array:
  shape = list(args.x.shape)
  shape.append(shape.pop(args.axis))
  return jnp.moveaxis(y.reshape(shape), -1, args.axis)


def _common_meta(args: spec.NormArgs, d: int) -> dict:
  return dict(
    D=d,
    BLOCK_D=_block_d(d),
    SCALE_OFFSET=float(args.scale_offset),
    HAS_SCALE=args.scale is not None,
    SUBTRACT_MEAN=bool(args.subtract_mean),
  )


def _vector(value: jax.Array | None, unused: jax.Array) -> jax.Array:
  # An unused pointer argument still needs an array: any one will do, where a
  # new zeros array would cost a kernel launch.
  return value if value is not None else unused


def forward(
  args: spec.NormArgs, config: TritonNormConfig, streaming: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Returns y (rows layout), mean and rstd (float32, [M]).

  Args:
    args: The call.
    config: Launch parameters.
    streaming: Whether x and y bypass L2 as far as cache hints allow.
  """
  x = _to_rows(args)
  m, d = x.shape
  blocks = _cdiv(m, config.block_m)
  persistent = 0 < config.fwd_programs < blocks
  stages = {"STAGES": config.fwd_stages} if persistent else {}
  y, mean, rstd = triton_call.call(
    kernels.layer_norm_fwd_persistent if persistent else kernels.layer_norm_fwd,
    x,
    _vector(args.scale, x),
    _vector(args.offset, x),
    m,
    out_shape=[
      jax.ShapeDtypeStruct((m, d), x.dtype),
      jax.ShapeDtypeStruct((m,), jnp.float32),
      jax.ShapeDtypeStruct((m,), jnp.float32),
    ],
    grid=(config.fwd_programs if persistent else blocks,),
    BLOCK_M=config.block_m,
    EPS=float(args.epsilon),
    HAS_OFFSET=args.offset is not None,
    ONE_PASS=config.fwd_one_pass,
    EVICT="evict_first" if streaming else "",
    STORE=".cs" if streaming else "",
    num_warps=config.num_warps,
    num_stages=1,
    **stages,
    **_common_meta(args, d),
  )
  return y, mean, rstd


def backward(
  args: spec.NormArgs, config: TritonNormConfig, mean: jax.Array, rstd: jax.Array, dy: jax.Array
) -> dict:
  """Returns the cotangents of x, scale and offset."""
  x = _to_rows(args)
  m, d = x.shape
  dy = _to_rows(dataclasses.replace(args, x=dy))
  programs = max(1, min(config.bwd_programs, _cdiv(m, config.bwd_block_m)))
  has_offset = args.offset is not None
  # Partial sums are only written for the vectors there are.
  partials = [
    jax.ShapeDtypeStruct((programs, d) if present else (1,), jnp.float32)
    for present in (args.scale is not None, has_offset)
  ]
  dx, dscale, doffset = triton_call.call(
    kernels.layer_norm_bwd,
    x,
    _vector(args.scale, x),
    dy,
    mean,
    rstd,
    m,
    out_shape=[jax.ShapeDtypeStruct((m, d), x.dtype), *partials],
    grid=(programs,),
    BLOCK_M=config.bwd_block_m,
    HAS_OFFSET=has_offset,
    PREFETCH=config.bwd_prefetch and config.bwd_stages <= 1,
    STAGES=config.bwd_stages,
    num_warps=config.bwd_num_warps,
    num_stages=2,
    **_common_meta(args, d),
  )
  grads = {"x": _from_rows(args, dx), "scale": None, "offset": None}
  if args.scale is not None or has_offset:
    grads["scale"], grads["offset"] = _sum_partials(args, dscale, doffset, programs)
  return grads


def _sum_partials(
  args: spec.NormArgs, dscale: jax.Array, doffset: jax.Array, programs: int
) -> tuple[jax.Array | None, jax.Array | None]:
  """dscale and doffset (or None) in their parameters' dtypes, from per-program partials."""
  vectors = (args.scale, args.offset)
  d = next(v.shape[0] for v in vectors if v is not None)
  # As with the partials, a missing vector gets a one-element placeholder output.
  sums = triton_call.call(
    kernels.sum_partials,
    dscale,
    doffset,
    programs,
    out_shape=[
      jax.ShapeDtypeStruct((d,), v.dtype)
      if v is not None
      else jax.ShapeDtypeStruct((1,), jnp.float32)
      for v in vectors
    ],
    grid=(_cdiv(d, _SUM_BLOCK_C),),
    D=d,
    BLOCK_P=min(256, max(16, 1 << (programs - 1).bit_length())),
    BLOCK_C=_SUM_BLOCK_C,
    HAS_SCALE=args.scale is not None,
    HAS_OFFSET=args.offset is not None,
    num_warps=4,
    num_stages=1,
  )
  return tuple(s if v is not None else None for s, v in zip(sums, vectors, strict=True))


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonLayerNorm(kernel_ops.TritonOp):
  """LayerNorm/RMSNorm in Triton: one pass forward, one fused pass backward."""

  name = "triton"
  spec = spec.SPEC
  config_cls = TritonNormConfig

  def _unsupported_reason(self, args: spec.NormArgs) -> str | None:
    m, d = _rows(args)
    for name in ("x", "scale", "offset"):
      value = getattr(args, name)
      if value is not None and np.dtype(value.dtype).name not in _DTYPES:
        return f"`{name}` dtype {np.dtype(value.dtype).name} (supported: {', '.join(_DTYPES)})"
    if m * d == 0:
      return "empty input"
    if d > _MAX_D:
      return f"normalised axis of size {d} > {_MAX_D}"
    return None

  def _get_heuristics_config(self, args: spec.NormArgs) -> TritonNormConfig:
    _, d = _rows(args)
    block_d = _block_d(d)
    # Forward: one program per block of >= 2048 elements. At most 8 warps: the
    # 16-warp program of D=8192 needs 52 registers, so only two fit an SM (~32 KB
    # of loads in flight; 1.9 TB/s on the H200), against four with 8 warps.
    num_warps = int(np.clip(block_d // 512, 1, 8)) if block_d < 32768 else 16
    # D=4096 takes two rows: 3.99 against 3.84 TB/s for one at 16384x4096
    # (h200/layer_norm_triton_ab_335b460.json; D=8192 is best with one).
    block_m = 2 if block_d == 4096 else int(np.clip(2048 // block_d, 1, 16))
    # Backward: without prefetch it kept only ~32 KB of loads in flight per SM
    # (ptxas: 63-114 registers, 1-2 programs per SM) and ran at ~1.75 TB/s on the
    # H200. Prefetching the next rows doubles that at 16 elements per thread
    # (<= 128 registers, no spills); two persistent programs per SM. From D=8192
    # the 16-warp program takes 113-128 registers, so one fits an SM: 132
    # programs, their rows pipelined through shared memory (3 rows of x and dy
    # in flight), which beat register prefetch there (docs/perf_decisions.md, Layer norm).
    bwd_block_m = int(np.clip(2048 // block_d, 1, 8))
    bwd_num_warps = int(np.clip(block_d * bwd_block_m // 512, 1, 16))
    wide = block_d >= 8192
    in_flight = 3 * 2 * block_d * np.dtype(args.x.dtype).itemsize  # Bytes of 3 rows of x, dy.
    bwd_stages = 4 if wide and in_flight <= _smem_budget() else 0
    # LayerNorm rows of 8192: persistent programs, 4 per SM, each loading its next row and
    # the scale and offset once (0.0939 against 0.0986 ms forward+backward at 4096x8192 in
    # the H200 tuning of src/tokamax/data/NVIDIA_H200.json, 28b7769; RMSNorm gained 0.6%).
    sms = device.sm_count()
    fwd_programs = sms * 4 if args.subtract_mean and block_d == 8192 else 0
    return TritonNormConfig(
      block_m=block_m,
      num_warps=num_warps,
      fwd_programs=fwd_programs,
      bwd_block_m=bwd_block_m,
      bwd_num_warps=bwd_num_warps,
      bwd_programs=sms if wide else sms * 2,
      bwd_prefetch=bwd_stages == 0,
      bwd_stages=bwd_stages,
    )

  def _get_autotuning_configs(self, args: spec.NormArgs) -> set[TritonNormConfig]:
    _, d = _rows(args)
    block_d = _block_d(d)
    row_bytes = block_d * np.dtype(args.x.dtype).itemsize
    base = self._get_heuristics_config(args)
    sms = device.sm_count()
    budget = _smem_budget()
    rep = dataclasses.replace
    configs = {base}
    for block_m in (1, 2, 4):
      for num_warps in (4, 8, 16, 32):
        per_thread = block_m * block_d // (32 * num_warps)
        if not 4 <= per_thread <= 64:
          continue
        if num_warps <= 16:
          for fwd_programs in (0, sms * 4):
            for one_pass in (False, True) if args.subtract_mean else (False,):
              configs.add(
                rep(
                  base,
                  block_m=block_m,
                  num_warps=num_warps,
                  fwd_programs=fwd_programs,
                  fwd_one_pass=one_pass,
                )
              )
          if block_m == 1 and per_thread <= 32 and 3 * row_bytes <= budget:
            configs.add(
              rep(base, block_m=block_m, num_warps=num_warps, fwd_programs=sms * 4, fwd_stages=4)
            )
        # Without the heuristic's pipeline (wide rows have one): stages are added below
        # where their rows fit shared memory, and they would override the prefetch.
        bwd = rep(base, bwd_block_m=block_m, bwd_num_warps=num_warps, bwd_stages=0)
        for bwd_programs in (sms, sms * 2, sms * 4, sms * 8):
          if num_warps <= 16:
            for prefetch in (False, True) if per_thread <= 32 else (False,):
              configs.add(rep(bwd, bwd_programs=bwd_programs, bwd_prefetch=prefetch))
          # Pipelined through shared memory: STAGES - 1 rows of x and dy in flight
          # (blocks of 2 rows and more ran 1.6-2x slower on the H200 at 4096x8192).
          for stages in (3, 4):
            smem = (stages - 1) * 2 * row_bytes  # Stages in flight of x and dy.
            if block_m == 1 and per_thread <= 32 and bwd_programs <= sms * 2 and smem <= budget:
              configs.add(
                rep(bwd, bwd_programs=bwd_programs, bwd_prefetch=False, bwd_stages=stages)
              )
    return configs

  def _fwd(self, args: spec.NormArgs, config: TritonNormConfig):
    y, mean, rstd = forward(args, config)
    return _from_rows(args, y), (mean, rstd)

  def _fwd_primal(self, args: spec.NormArgs, config: TritonNormConfig) -> jax.Array:
    y, _, _ = forward(args, config, streaming=config.fwd_streaming)
    return _from_rows(args, y)

  def _bwd(self, args, config, out, residuals, dout) -> dict:
    mean, rstd = residuals
    return backward(args, config, mean, rstd, dout)
