"""Mosaic GPU (Hopper) fused gated linear unit: `act(x @ w_gate) * (x @ w_up)`.

One persistent kernel computes both projections of an (M tile, N tile) work
item from one read of the x tile per pipeline stage: each of two compute
warpgroups owns 64 rows and accumulates the gate and the up projection; the
gate is applied in the epilogue. A third warpgroup issues the TMA loads.
Optionally the kernel also writes the residuals of the backward pass: the two
factors of the projections' cotangents, so that the backward pass starts with
one multiply by the output cotangent.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.extend import core as jex_core

from tokamax._src.ops import mosaic_gemm as gemm

WG_ROWS = gemm.WG_ROWS
NUM_COMPUTE_WGS = gemm.NUM_COMPUTE_WGS


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicGluKernelConfig:
  """Tiling of the fused GLU kernel.

  Attributes:
    block_n: Columns of each projection per work item.
    block_k: Contraction depth per pipeline stage.
    num_stages: Shared-memory stages of the load pipeline.
    epi_n: Output columns per epilogue store.
    grid_tile_m: Row tiles visited together before moving along N (L2 reuse).
    cluster: CTAs per cluster; 2 computes two neighbouring column tiles of one
      row tile on a CTA pair that shares each x tile through TMA multicast
      (half the x traffic, for few rows where x is re-read per column tile).
  """

  block_n: int = 128
  block_k: int = 64
  num_stages: int = 4
  epi_n: int = 128
  grid_tile_m: int = 16
  cluster: int = 1

  @property
  def block_m(self) -> int:
    return WG_ROWS * NUM_COMPUTE_WGS


# Primitives that `_eval_inlined` replaces by the equations of the jaxpr they call.
INLINED_PRIMITIVES = (jex_core.primitives.jit_p, jex_core.primitives.custom_jvp_call_p)


def apply_activation(activation, gate: jax.Array) -> jax.Array:
  """act(gate) of an elementwise `activation`, as primitives Mosaic GPU lowers: nested
  jits and custom-JVP functions (e.g. `jax.nn.relu`) inlined."""
  jaxpr = jax.make_jaxpr(activation)(gate)
  (act,) = _eval_inlined(jaxpr.jaxpr, jaxpr.consts, gate)
  return act


def activation_and_derivative(activation, gate: jax.Array, up: jax.Array):
  """(act(gate), up * act'(gate)) of an elementwise `activation`, as primitives
  Mosaic GPU lowers: the JVP's `add_any` (which it does not lower) becomes `add`."""
  jaxpr = jax.make_jaxpr(lambda g, u: jax.jvp(activation, (g,), (u,)))(gate, up)
  return tuple(_eval_inlined(jaxpr.jaxpr, jaxpr.consts, gate, up))


def _eval_inlined(jaxpr, consts, *args):
  """Evaluates `jaxpr`, inlining `INLINED_PRIMITIVES`, with `add` in place of `add_any`."""
  env = {}
  read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]
  for var, val in zip((*jaxpr.constvars, *jaxpr.invars), (*consts, *args), strict=True):
    env[var] = val
  prims = jex_core.primitives
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    if eqn.primitive is prims.add_jaxvals_p:
      outs = [lax.add(*ins)]
    elif eqn.primitive in INLINED_PRIMITIVES:
      inner = eqn.params["jaxpr" if eqn.primitive is prims.jit_p else "call_jaxpr"]
      outs = _eval_inlined(inner.jaxpr, inner.consts, *ins)
    else:
      outs = eqn.primitive.bind(*ins, **eqn.params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    for var, val in zip(eqn.outvars, outs, strict=True):
      env[var] = val
  return [read(v) for v in jaxpr.outvars]


def epilogue_slots(save_residuals: bool) -> int:
  """Shared-memory store buffers per compute warpgroup: a ring of two when the
  epilogue stores three values (the output and both residual factors)."""
  return 2 if save_residuals else 1


def smem_bytes(config: MosaicGluKernelConfig, in_itemsize: int, save_residuals: bool) -> int:
  stage = (config.block_m + 2 * config.block_n) * config.block_k * in_itemsize
  slots = epilogue_slots(save_residuals)
  epilogue = slots * NUM_COMPUTE_WGS * WG_ROWS * config.epi_n * in_itemsize
  return config.num_stages * stage + epilogue


def config_reason(
  config: MosaicGluKernelConfig,
  m: int,
  k: int,
  n: int,
  in_itemsize: int,
  save_residuals: bool = False,
):
  del m
  if (reason := gemm.columns_reason(config, n)) is not None:
    return reason
  if k % config.block_k:
    return f"K={k} must be a multiple of block_k={config.block_k}"
  if k // config.block_k < config.num_stages:
    return f"K={k} gives fewer than num_stages={config.num_stages} steps"
  reason = (
    gemm.tile_reason(config, "block_k", in_itemsize)
    or gemm.smem_reason(config, smem_bytes(config, in_itemsize, save_residuals))
    or gemm.cluster_reason(config)
  )
  if reason is not None:
    return reason
  if (n // config.block_n) % config.cluster:
    return f"N={n} must be a multiple of cluster * block_n={config.cluster * config.block_n}"
  return None


def gated_linear_unit(
  x: jax.Array,
  w_gate: jax.Array,
  w_up: jax.Array,
  *,
  up_block_offset: int,
  n: int,
  activation: Callable[[jax.Array], jax.Array] | None,
  config: MosaicGluKernelConfig,
  num_sms: int,
  save_residuals: bool = False,
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
    save_residuals: Also return the residuals of the backward pass.
    interpret: Pallas interpret parameters, or None.

  Returns:
    out [M, N], or (out, residuals [M, 2N]) with `save_residuals`: with
    gate = x @ w_gate and up = x @ w_up, residuals[:, :N] = up * act'(gate) and
    residuals[:, N:] = act(gate), so that the cotangents of the two projections
    are dout * residuals[:, :N] and dout * residuals[:, N:].
  """
  m, k = x.shape
  bm, bn, bk, epi_n = config.block_m, config.block_n, config.block_k, config.epi_n
  m_tiles, n_tiles, k_steps = pl.cdiv(m, bm), n // bn, k // bk
  cluster = config.cluster
  n_units = n_tiles // cluster  # Column tiles per cluster step.
  tile_m = min(config.grid_tile_m, m_tiles)
  collective = ("cluster",) if cluster > 1 else None
  tf = gemm.transforms(x.dtype)
  dtype = x.dtype
  slots = epilogue_slots(save_residuals)

  def make_pipeline(body, compute_context, mi, ni):
    in_specs = [
      plgpu.BlockSpec(
        (bm, bk), lambda s: (mi, s), transforms=tf, delay_release=0, collective_axes=collective
      ),
      plgpu.BlockSpec((bk, bn), lambda s: (s, ni), transforms=tf, delay_release=0),
      plgpu.BlockSpec(
        (bk, bn), lambda s: (s, ni + up_block_offset), transforms=tf, delay_release=0
      ),
    ]
    return gemm.pipeline(body, compute_context, k_steps, in_specs, config.num_stages)

  def epilogue_values(gate, up, out_ref, res_refs):
    """(float32 value, output ref, its first column) of each store."""
    if not save_residuals:
      act = gate if activation is None else apply_activation(activation, gate)
      return [(act * up, out_ref, 0)]
    (res_ref,) = res_refs
    if activation is None:
      return [(gate * up, out_ref, 0), (up, res_ref, 0), (gate, res_ref, n)]
    act, dgate_factor = activation_and_derivative(activation, gate, up)
    return [(act * up, out_ref, 0), (dgate_factor, res_ref, 0), (act, res_ref, n)]

  def kernel(x_ref, wg_ref, wu_ref, out_ref, *res_refs):
    nothing = lambda *_, **__: None

    @functools.partial(
      pl.run_scoped,
      allocs=make_pipeline(nothing, nothing, 0, 0).get_allocations(x_ref, wg_ref, wu_ref),
      o_smem=plgpu.SMEM((slots, NUM_COMPUTE_WGS, WG_ROWS, epi_n), dtype),
      collective_axes="wg",
    )
    def scope(allocs, o_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((m_tiles * n_units,), collective_axes="sm")
      def _item_loop(info):
        (idx,) = info.index
        mi, nu = plgpu.planar_snake(idx, (m_tiles, n_units), 0, tile_m)
        ni = nu * cluster + (lax.axis_index("cluster") if cluster > 1 else 0)
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
            u = 0  # Stores so far in this item.
            for c in range(bn // epi_n):
              # A column chunk at a time, so that few float32 values are live.
              chunk = slice(c * epi_n, (c + 1) * epi_n)
              for v, ref, col in epilogue_values(gate[:, chunk], up[:, chunk], out_ref, res_refs):
                # Each store is at least one bulk group when this warpgroup has
                # rows, so at most slots - 1 pending groups leave the slot free;
                # the first store also waits out the previous item's stores.
                if u == 0 or u >= slots:
                  plgpu.wait_smem_to_gmem(0 if u == 0 else slots - 1, wait_read_only=True)
                slot = o_smem.at[u % slots, wg]
                slot[...] = v.astype(dtype)
                plgpu.commit_smem()
                cols = pl.ds(col + ni * bn + c * epi_n, epi_n)
                gemm.store_rows(slot, ref.at[:, cols], row0, 0, rows, WG_ROWS)
                u += 1

        make_pipeline(mma, compute_context, mi, ni)(x_ref, wg_ref, wu_ref, allocations=allocs)

      plgpu.wait_smem_to_gmem(0)

  out_type = [jax.ShapeDtypeStruct((m, n), dtype)]
  if save_residuals:
    out_type.append(jax.ShapeDtypeStruct((m, 2 * n), dtype))
  call = gemm.kernel(
    kernel,
    tuple(out_type),
    num_sms=num_sms,
    cluster=cluster,
    approx_math=True,  # The activation's exp (and log) as approximate instructions.
    interpret=interpret,
  )
  outs = call(x, w_gate, w_up)
  return tuple(outs) if save_residuals else outs[0]
