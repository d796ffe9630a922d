"""Mosaic GPU (Hopper) fused gated linear unit: `act(x @ w_gate) * (x @ w_up)`.

One persistent kernel computes both projections of an (M tile, N tile) work
item from one read of the x tile per pipeline stage: each of two compute
warpgroups owns 64 rows and accumulates the gate and the up projection; the
gate is applied in the epilogue. A third warpgroup issues the TMA loads.
Optionally the kernel also writes the two pre-activation projections, the
residuals of the backward pass.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax._src.ops.ragged_dot import mosaic_fwd

WG_ROWS = mosaic_fwd.WG_ROWS
NUM_COMPUTE_WGS = mosaic_fwd.NUM_COMPUTE_WGS


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Tiling of the fused GLU kernel.

  Attributes:
    block_n: Columns of each projection per work item.
    block_k: Contraction depth per pipeline stage.
    num_stages: Shared-memory stages of the load pipeline.
    epi_n: Output columns per epilogue store.
    grid_tile_m: Row tiles visited together before moving along N (L2 reuse).
  """

  block_n: int = 128
  block_k: int = 64
  num_stages: int = 4
  epi_n: int = 128
  grid_tile_m: int = 16

  @property
  def block_m(self) -> int:
    return WG_ROWS * NUM_COMPUTE_WGS


def smem_bytes(config: Config, in_itemsize: int, num_outputs: int) -> int:
  stage = (config.block_m + 2 * config.block_n) * config.block_k * in_itemsize
  epilogue = num_outputs * NUM_COMPUTE_WGS * WG_ROWS * config.epi_n * in_itemsize
  return config.num_stages * stage + epilogue


def config_reason(config: Config, m: int, k: int, n: int, in_itemsize: int, num_outputs: int):
  del m
  if n % config.block_n or config.block_n % config.epi_n:
    return f"N={n} must be a multiple of block_n={config.block_n} (and of epi_n={config.epi_n})"
  if k % config.block_k:
    return f"K={k} must be a multiple of block_k={config.block_k}"
  if k // config.block_k < config.num_stages:
    return f"K={k} gives fewer than num_stages={config.num_stages} steps"
  if config.block_k * in_itemsize != 128:
    return f"block_k={config.block_k} must span 128 bytes"
  if config.block_n > 256 or config.block_n % 64:
    return f"block_n={config.block_n} must be a multiple of 64 up to 256"
  if smem_bytes(config, in_itemsize, num_outputs) > mosaic_fwd.SMEM_BYTES:
    return f"{config} needs more than {mosaic_fwd.SMEM_BYTES} bytes of shared memory"
  return None


def gated_linear_unit(
  x: jax.Array,
  w_gate: jax.Array,
  w_up: jax.Array,
  *,
  up_block_offset: int,
  n: int,
  activation: Callable[[jax.Array], jax.Array] | None,
  config: Config,
  num_sms: int,
  save_gate_up: bool = False,
  interpret=None,
):
  """Fused GLU on 2D x.

  Args:
    x: [M, K].
    w_gate: [K, *]: the gate weights are its columns from 0 to n.
    w_up: [K, *]: the up weights are its columns from `up_block_offset *
      block_n` on (w_up may be w_gate itself for fused [K, 2N] weights).
    up_block_offset: See `w_up`.
    n: Output columns.
    activation: Applied to the gate projection (float32), or None.
    config: Tiling.
    num_sms: Persistent CTAs.
    save_gate_up: Also return the gate and up projections.
    interpret: Pallas interpret parameters, or None.

  Returns:
    [M, N], or ([M, N], gate [M, N], up [M, N]) with `save_gate_up`.
  """
  m, k = x.shape
  bm, bn, bk, epi_n = config.block_m, config.block_n, config.block_k, config.epi_n
  m_tiles, n_tiles, k_steps = pl.cdiv(m, bm), n // bn, k // bk
  tile_m = min(config.grid_tile_m, m_tiles)
  tf = mosaic_fwd._transforms(x.dtype)
  dtype = x.dtype
  num_outputs = 3 if save_gate_up else 1

  def make_pipeline(body, compute_context, mi, ni):
    return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(k_steps,),
      memory_registers=mosaic_fwd.MEMORY_REGISTERS,
      in_specs=[
        plgpu.BlockSpec((bm, bk), lambda s: (mi, s), transforms=tf, delay_release=0),
        plgpu.BlockSpec((bk, bn), lambda s: (s, ni), transforms=tf, delay_release=0),
        plgpu.BlockSpec(
          (bk, bn), lambda s: (s, ni + up_block_offset), transforms=tf, delay_release=0
        ),
      ],
      wg_axis="wg",
      num_compute_wgs=NUM_COMPUTE_WGS,
      max_concurrent_steps=config.num_stages,
      compute_context=compute_context,
    )

  def kernel(x_ref, wg_ref, wu_ref, *refs):
    out_refs = refs[:num_outputs]
    nothing = lambda *_, **__: None

    @functools.partial(
      pl.run_scoped,
      allocs=make_pipeline(nothing, nothing, 0, 0).get_allocations(x_ref, wg_ref, wu_ref),
      o_smem=plgpu.SMEM((num_outputs, NUM_COMPUTE_WGS, WG_ROWS, epi_n), dtype),
      collective_axes="wg",
    )
    def scope(allocs, o_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
      def _item_loop(info):
        (idx,) = info.index
        mi, ni = plgpu.planar_snake(idx, (m_tiles, n_tiles), 0, tile_m)
        row0 = mi * bm + wg * WG_ROWS
        rows = jnp.clip(m - row0, 0, WG_ROWS)

        def mma(_, x_smem, g_smem, u_smem, accs):
          acc_g, acc_u = accs
          x_wg = x_smem.at[pl.ds(wg * WG_ROWS, WG_ROWS)]
          plgpu.wgmma(acc_g, x_wg, g_smem)
          plgpu.wgmma(acc_u, x_wg, u_smem)
          plgpu.wgmma_wait(0)
          return accs

        def compute_context(run):
          @functools.partial(
            pl.run_scoped,
            acc_g=plgpu.ACC((WG_ROWS, bn), jnp.float32),
            acc_u=plgpu.ACC((WG_ROWS, bn), jnp.float32),
          )
          def _acc_scope(acc_g, acc_u):
            run((acc_g, acc_u))
            gate, up = acc_g[...], acc_u[...]
            act = gate if activation is None else activation(gate)
            values = [(act * up).astype(dtype)]
            if save_gate_up:
              values += [gate.astype(dtype), up.astype(dtype)]
            for c in range(bn // epi_n):
              plgpu.wait_smem_to_gmem(0, wait_read_only=True)
              for j, v in enumerate(values):
                o_smem.at[j, wg][...] = v[:, c * epi_n : (c + 1) * epi_n]
              plgpu.commit_smem()
              cols = pl.ds(ni * bn + c * epi_n, epi_n)
              for j in range(num_outputs):
                mosaic_fwd.store_rows(
                  o_smem.at[j, wg], out_refs[j].at[:, cols], row0, 0, rows, WG_ROWS
                )

        make_pipeline(mma, compute_context, mi, ni)(x_ref, wg_ref, wu_ref, allocations=allocs)

      plgpu.wait_smem_to_gmem(0)

  out_type = jax.ShapeDtypeStruct((m, n), dtype)
  call = plgpu.kernel(
    kernel,
    out_type=(out_type,) * num_outputs,
    grid=(num_sms,),
    grid_names=("sm",),
    num_threads=NUM_COMPUTE_WGS + 1,
    thread_name="wg",
    compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    interpret=interpret,
  )
  outs = call(x, w_gate, w_up)
  return tuple(outs) if save_gate_up else outs[0]
