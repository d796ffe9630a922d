"""The Hopper GEMM skeleton shared by the Mosaic GPU matmul kernels.

The ragged_dot kernels (`ragged_dot/mosaic_fwd.py`, `ragged_dot/mosaic_drhs.py`)
and the fused GLU kernel (`gated_linear_unit/mosaic_kernel.py`) are persistent
(one CTA per SM, or per cluster of CTAs) and warp specialised: a memory
warpgroup streams operand tiles by TMA into a ring of shared-memory stages and
two compute warpgroups, each owning `WG_ROWS` rows of the output tile, run
wgmma on them. Operand tiles span 128 bytes of the contraction with a 128-byte
swizzle. The float32 accumulators are stored through shared memory a column
chunk at a time. This module holds those common pieces; each kernel keeps its
own work list, operands and epilogue values.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax._src import device as device_lib

# Rows of the output tile handled by one compute warpgroup (one wgmma M tile).
WG_ROWS = 64
NUM_COMPUTE_WGS = 2
# Shared memory a CTA can use on sm_90 (227 KiB), less room for barriers.
SMEM_BYTES = 227 * 1024 - 1024
# Registers per thread of the memory warpgroup, which only issues TMA copies.
MEMORY_REGISTERS = 40
ROW_ALIGN = 8  # Row tiling of the TMA copies.
_SWIZZLE = 128
# Persistent CTAs simulated in interpret mode (few, so that it stays fast).
INTERPRET_NUM_SMS = 2


def num_sms(interpret: bool = False) -> int:
  """Persistent CTAs: the SMs of the GPU at hand, else an H100/H200's; few when interpreted."""
  return INTERPRET_NUM_SMS if interpret else device_lib.sm_count()


def swizzle_elems(dtype) -> int:
  """Elements of `dtype` in the 128-byte swizzle span: the contraction depth of a tile row."""
  return _SWIZZLE // jnp.dtype(dtype).itemsize


def transforms(dtype) -> tuple:
  """TMA tiling and swizzle of an operand tile whose rows span 128 bytes."""
  return (plgpu.TilingTransform((8, swizzle_elems(dtype))), plgpu.SwizzleTransform(_SWIZZLE))


def columns_reason(config: Any, n: int) -> str | None:
  """Why `n` output columns do not tile by the config's `block_n` and `epi_n`, or None."""
  if n % config.block_n or config.block_n % config.epi_n:
    return f"N={n} must be a multiple of block_n={config.block_n} (and of epi_n={config.epi_n})"
  return None


def tile_reason(config: Any, depth: str, in_itemsize: int) -> str | None:
  """Why the operand tiles of `config` do not suit wgmma, or None.

  Args:
    config: A config with `block_n` and the contraction depth field `depth`.
    depth: The name of that field, e.g. "block_k".
    in_itemsize: Bytes per operand element.
  """
  value = getattr(config, depth)
  if value * in_itemsize != _SWIZZLE:
    return f"{depth}={value} must span 128 bytes"
  if config.block_n > 256 or config.block_n % 64:
    return f"block_n={config.block_n} must be a multiple of 64 up to 256"
  return None


def smem_reason(config: Any, nbytes: int) -> str | None:
  """Why `nbytes` of shared memory for `config` do not fit a CTA, or None."""
  if nbytes > SMEM_BYTES:
    return f"{config} needs more than {SMEM_BYTES} bytes of shared memory"
  return None


def cluster_reason(config: Any) -> str | None:
  if config.cluster not in (1, 2):
    return f"cluster={config.cluster} (supported: 1, 2)"
  return None


def store_rows(o_smem, o_gmem, row0, first, size, max_rows: int):
  """Stores rows [first, first + size) of `o_smem` to rows row0 + first.. of `o_gmem`.

  A ladder of power-of-two TMA stores, so that any row count up to `max_rows`
  needs static copy shapes only.
  """
  start = first
  p = 1 << (max_rows.bit_length() - 1)
  while p >= 1:
    bit = jnp.bitwise_and(size, p)

    @pl.when(bit != 0)
    def _(start=start, p=p):
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, p)], o_gmem.at[pl.ds(row0 + start, p)])

    start = start + bit
    p //= 2


def pipeline(
  body: Callable, compute_context: Callable, steps, in_specs: Sequence[Any], num_stages: int
):
  """The warp-specialised pipeline of `steps` stages of `in_specs` tiles."""
  return plgpu.emit_pipeline_warp_specialized(
    body,
    grid=(steps,),
    memory_registers=MEMORY_REGISTERS,
    in_specs=in_specs,
    wg_axis="wg",
    num_compute_wgs=NUM_COMPUTE_WGS,
    max_concurrent_steps=num_stages,
    compute_context=compute_context,
  )


def stored_accumulator(
  block_n: int, epi_n: int, o_wg, out_dtype, store: Callable[[int], None]
) -> Callable:
  """A pipeline compute context with one float32 [WG_ROWS, block_n] accumulator.

  After the pipeline, the accumulator goes to `o_wg` [WG_ROWS, epi_n] in
  `out_dtype` one column chunk at a time, and `store(c)` copies chunk c out.
  """

  def compute_context(run):
    @functools.partial(pl.run_scoped, acc=plgpu.ACC((WG_ROWS, block_n), jnp.float32))
    def _acc_scope(acc):
      run(acc)
      out = acc[...].astype(out_dtype)
      for c in range(block_n // epi_n):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        o_wg[...] = out[:, c * epi_n : (c + 1) * epi_n]
        plgpu.commit_smem()
        store(c)

  return compute_context


def kernel(
  body: Callable,
  out_type: Any,
  *,
  num_sms: int,
  cluster: int = 1,
  approx_math: bool = False,
  interpret=None,
):
  """The persistent kernel: `num_sms` CTAs in clusters of `cluster`, three warpgroups each.

  `approx_math` lowers exp2 and log to the fast approximate PTX instructions.
  """
  return plgpu.kernel(
    body,
    out_type=out_type,
    grid=(num_sms // cluster,),
    grid_names=("sm",),
    **(dict(cluster=(cluster,), cluster_names=("cluster",)) if cluster > 1 else {}),
    num_threads=NUM_COMPUTE_WGS + 1,
    thread_name="wg",
    compiler_params=plgpu.CompilerParams(
      lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=approx_math
    ),
    interpret=interpret,
  )
